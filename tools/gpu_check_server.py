"""Steps 4 and 10 of tools/gpu_check.py: `pipelinerl serve` on the tiny model, one weight update over gloo,
per-token versions of sampled completions, and the lag-0 agreement of the server's log-probs with the trainer's;
on a mixture of experts, with the routed experts the server returns (inference.return_routed_experts), and the
share of them the trainer's router at the same weights would have chosen otherwise."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from gpu_check_common import Row, write_config

# ---- step 4: a vLLM server, one update, per-token versions, lag-0 log-prob agreement --------------------

def start_server(cfg_path: Path, run_dir: Path, port: int, timeout_s: float):
    """`pipelinerl serve` under a Supervisor (its own process group); the URL once it announces itself."""
    from pipelinerl.launch.procs import Role, Supervisor
    from pipelinerl.rundir import list_servers

    sup = Supervisor()
    sup.start(Role("server", [sys.executable, "-m", "pipelinerl.cli", "serve", str(cfg_path), "--port", str(port)],
                   run_dir / "server.log", env={"HF_HUB_OFFLINE": "1"}))
    deadline = time.monotonic() + timeout_s
    try:
        while not (urls := list_servers(run_dir)):
            sup.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not announce itself within {timeout_s:.0f} s; log: "
                                   f"{run_dir / 'server.log'}")
            time.sleep(0.5)
    except BaseException:
        sup.stop_all()
        raise
    return sup, urls[0]


def perturbed_model(model_dir: Path, seed: int):
    """The served model's weights plus noise: an update the server can only reproduce by loading it."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipelinerl.trainer.model import enable_chunked_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    enable_chunked_logprobs(model)
    return model


def update_and_sample(cfg, url: str, model, prompts: list[list[int]]) -> tuple[dict, list]:
    """Broadcast `model` as version 1 (the project's WeightBroadcaster, gloo), then sample each prompt
    through the actor's completions client; returns the broadcast's reply and the completions."""
    import asyncio

    import httpx

    from pipelinerl.actor.client import CompletionsClient
    from pipelinerl.launch.procs import free_port
    from pipelinerl.rundir import run_token
    from pipelinerl.weights import TensorMeta, WeightBroadcaster, dtype_name

    sender = WeightBroadcaster([url], "gloo", "127.0.0.1", free_port(), cfg.inference.weight_update_timeout_s,
                               int(cfg.trainer.broadcast_bucket_mb * 2**20), run_token(cfg.run_dir), checksum_every=1)
    try:
        sender.connect()
        named = list(model.named_parameters())
        reply = sender.broadcast(1, [TensorMeta(n, dtype_name(p.dtype), list(p.shape)) for n, p in named],
                                 (p.detach() for _, p in named))
    finally:
        sender.close()
    client = CompletionsClient(cfg.actor, cfg.run_dir, reference=False)

    async def sample():
        async with httpx.AsyncClient() as http:
            return [c for p in prompts for c in await client.complete(http, p, greedy=False, n=2)]

    return reply, asyncio.run(sample())


def trainer_logprobs(model, prompt: list[int], completion, cfg, tap=None) -> tuple[list[float], tuple[float, float]]:
    """The trainer's completion log-probs (completion_forward, chunked, at the sampling temperature), and with
    `tap` (a RouterTap on `model`) and the completion's served routing (Completion.routed_experts) the count of
    token-layer routings compared and of those whose expert set the trainer's router chose otherwise."""
    import contextlib

    import torch

    from pipelinerl.trainer.model import completion_logprobs
    from pipelinerl.trainer.moe import replay_ids
    from pipelinerl.trainer.packing import Sample, pack

    (mb,) = pack([Sample(prompt, completion.token_ids, index=0)], len(prompt) + len(completion.token_ids))
    compare = contextlib.nullcontext()
    if tap is not None:
        routed_NW = torch.as_tensor(completion.routed_experts.astype("int64")).flatten(1)
        compare = tap.replaying(replay_ids(tap, mb, routed_NW), apply=False)
        tap.start()
    with torch.no_grad(), compare:
        ours = completion_logprobs(model, mb, torch.device("cpu"), cfg.actor.sampling.temperature,
                                   cfg.trainer.logprob_chunk_tokens).tolist()
    return ours, tuple(tap.compared.tolist()) if tap is not None else (0.0, 0.0)


def server_check(model_dir: Path, workdir: Path, args, moe: bool = False) -> Row:
    """Step 4, or with `moe` step 10 on a mixture of experts (its routing returned and compared)."""
    from pipelinerl.config import load_config
    from pipelinerl.launch.procs import free_port
    from pipelinerl.tiny.model import build_tokenizer
    from pipelinerl.trainer.moe import RouterTap

    step = (f"server MoE [{model_dir.name.removeprefix('model_')}]: routed experts + lag-0 routing" if moe else
            "server: update + versions + lag-0 log-probs")
    run_dir = workdir / f"server_run_{model_dir.name}"
    cfg_path = write_config(workdir / f"server_{model_dir.name}.yaml", model_dir, run_dir, args,
                            ("model.dtype=float32", "inference.max_model_len=256",
                             f"inference.return_routed_experts={moe}", "actor.sampling.max_new_tokens=32",
                             "actor.sampling.temperature=0.7"))
    cfg = load_config(cfg_path)
    start = time.monotonic()
    sup, url = start_server(cfg_path, run_dir, free_port(), cfg.inference.startup_timeout_s)
    ready_s = time.monotonic() - start
    try:
        model = perturbed_model(model_dir, seed=1)
        tap = RouterTap(model) if moe else None
        tok = build_tokenizer()
        prompts = [list(tok(text).input_ids) for text in ("12+34=", "7*8=", "99-1=")]
        reply, completions = update_and_sample(cfg, url, model, prompts)
        deltas, versions, compared = [], set(), [0.0, 0.0]
        for i, c in enumerate(completions):
            if moe and not routing_well_formed(c, tap):
                shape = None if c.routed_experts is None else c.routed_experts.shape
                return Row(step, f"FAILED: routed experts {shape} for {len(c.token_ids)} tokens, "
                                 f"{len(tap.routers)} layers x top-{tap.top_k}")
            ours, counts = trainer_logprobs(model, prompts[i // 2], c, cfg, tap)
            deltas += [abs(a - b) for a, b in zip(ours, c.logprobs, strict=True)]
            versions.update(c.versions)
            compared = [a + b for a, b in zip(compared, counts)]
    finally:
        sup.stop_all()
    mean_d, max_d = statistics.fmean(deltas), max(deltas)
    mismatch = compared[1] / max(compared[0], 1)
    numbers = (f"ready {ready_s:.0f} s; update {reply['bytes'] / 1e6:.2f} MB in {reply['total_s']:.2f} s; "
               f"{len(deltas)} tokens, versions {sorted(versions)}; lag-0 |dlogprob| mean {mean_d:.1e} "
               f"max {max_d:.1e} (float32, T={cfg.actor.sampling.temperature})")
    if moe:
        numbers += f"; routing differs on {compared[1]:.0f} of {compared[0]:.0f} token-layers ({mismatch:.3f})"
    values = {"ready_s": ready_s, "update_s": reply["total_s"], "tokens": len(deltas),
              "versions": sorted(versions), "mean_abs_diff": mean_d, "max_abs_diff": max_d,
              "routings_compared": compared[0], "routing_mismatch": mismatch}
    if versions != {1}:
        return Row(step, f"FAILED: token versions {sorted(versions)}, expected all 1", numbers, values)
    if max_d > args.max_logprob_diff:
        return Row(step, f"FAILED: max |dlogprob| {max_d:.1e} > {args.max_logprob_diff}", numbers, values)
    if mismatch > args.max_routing_mismatch:
        return Row(step, f"FAILED: lag-0 routing mismatch {mismatch:.3f} > {args.max_routing_mismatch}", numbers,
                   values)
    return Row(step, "ok", numbers, values)


def routing_well_formed(completion, tap) -> bool:
    """A completion's routed experts: [tokens, MoE layers, top-k] ids of this model's experts."""
    routed = completion.routed_experts
    return (routed is not None and routed.shape == (len(completion.token_ids), len(tap.routers), tap.top_k)
            and int(routed.max(initial=0)) < tap.num_experts)


# ---- the table ------------------------------------------------------------------------------------------

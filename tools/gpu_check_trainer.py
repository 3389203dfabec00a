"""Steps 1 and 3 of tools/gpu_check.py, measured in a child process (`gpu_check.py --child CONFIG`, so that peaks
are per model): optimizer steps of the project's trainer backend (or plain torch in its precision scheme) on random
samples, peak memory, then the full-model gather packed into the broadcast's buckets; on a mixture of experts, what
the routing replay did (random routing replayed in the steps, the trainer's own after them)."""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gpu_check_common import GB, REPO


def random_samples(vocab: int, tokens: int, seq_len: int, seed: int, routing: tuple[int, int, int] | None = None):
    """Packed-sequence samples of random ids (1/8 prompt), filling one micro-batch of `tokens`. routing
    (MoE layers, experts, top-k): each completion token also carries a random routing, k distinct experts per
    layer, as the stream's `routed_experts` field does."""
    import torch

    from pipelinerl.trainer.packing import Sample

    g = torch.Generator().manual_seed(seed)
    prompt = max(1, seq_len // 8)
    out = []
    for i in range(max(1, tokens // seq_len)):
        ids = torch.randint(3, vocab, (seq_len,), generator=g).tolist()
        adv = float(torch.randn((), generator=g))
        fields = {"advantage": [adv] * (seq_len - prompt)}
        if routing is not None:
            layers, experts, k = routing
            chosen = torch.rand(seq_len - prompt, layers, experts, generator=g).argsort(-1)[..., :k]
            fields["routed_experts"] = chosen.reshape(seq_len - prompt, layers * k).tolist()
        out.append(Sample(ids[:prompt], ids[prompt:], index=i, token_fields=fields))
    return out


def pg_loss(mb, new_N, values_N, num_sequences: int):
    """A policy-gradient loss of the trainer's form (a share of the step's sum over sequences)."""
    loss = -(new_N * mb.fields_N["advantage"].to(new_N)).sum() / num_sequences
    return loss, {"loss": loss.item()}


class BackendStepper:
    """The project's trainer backend (cfg.trainer.backend) on one rank, built as `pipelinerl train` builds it."""

    def __init__(self, cfg):
        from pipelinerl.launch.procs import free_port
        from pipelinerl.trainer.backends import build_trainer
        from pipelinerl.trainer.dist import init_process_group, read_dist_env

        self.name = "deepspeed zero-3" if cfg.trainer.backend == "deepspeed" else cfg.trainer.backend

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
        dist = read_dist_env()
        init_process_group(dist, cfg.trainer.dist_timeout_s, cfg.trainer.jit_lock_stale_s)
        self.trainer = build_trainer(cfg, dist, publisher=None)
        self.trainer.init(cfg.model.path)
        self.device = self.trainer.device
        self.vocab = self.trainer.lm.config.vocab_size
        self.tap = self.trainer.router_tap  # a mixture of experts: replays the samples' routing (r3)
        self.compared = [0.0, 0.0]  # over the steps: token-layer routings replayed, of them the trainer's differs

    def step(self, mbs, num_sequences: int) -> tuple[float, float]:
        """One optimizer step; (the step's loss, the gradient norm)."""
        import functools

        stats = self.trainer.accumulate(mbs, functools.partial(pg_loss, num_sequences=num_sequences))
        for s in stats:
            if "moe_compared" in s:
                self.compared = [a + float(b) for a, b in zip(self.compared, s["moe_compared"])]
        return sum(s["loss"] for s in stats), self.trainer.optimizer_step()["grad_norm"]

    def self_replay(self, mb) -> dict:
        """The micro-batch's completion log-probs routed by the trainer, then replaying that same routing: their
        largest difference, and that of a second unreplayed forward (the kernels' run-to-run noise: 0 unless
        they reduce with atomics). trainer/moe.py's claim is that replay adds nothing to that noise."""
        import torch

        with torch.no_grad():
            own_N, _ = self.trainer.forward(mb)
            ids_TLk = torch.stack([layer.experts for layer in self.tap.layers], dim=1)
            again_N, _ = self.trainer.forward(mb)
            with self.tap.replaying(ids_TLk):
                replayed_N, _ = self.trainer.forward(mb)
        return {"self_replay_max_diff": float((own_N - replayed_N).abs().max()),
                "rerun_max_diff": float((own_N - again_N).abs().max()),
                "self_replay_bitwise": bool(torch.equal(own_N, replayed_N))}

    def weights(self):
        from pipelinerl.weights import TensorMeta

        metas = [TensorMeta(n, d, s) for n, d, s in self.trainer.named_shapes()]
        return metas, (t for _, t in self.trainer.gathered_parameters())


class TorchStepper:
    """Plain torch, one device, ZeRO-3's precision scheme at world size 1: 16-bit weights and gradients,
    float32 master weights and AdamW states (16 bytes per parameter), the same chunked log-prob head."""

    name = "torch adamw (no deepspeed)"

    def __init__(self, cfg, device: str):
        import torch
        from transformers import AutoModelForCausalLM

        from pipelinerl.dtypes import torch_dtype
        from pipelinerl.trainer.model import attention_implementation, enable_chunked_logprobs

        self.cfg, self.device = cfg, torch.device(device)
        attn = attention_implementation(cfg.trainer.attn_implementation, self.device, cfg.model.dtype)
        self.lm = AutoModelForCausalLM.from_pretrained(
            cfg.model.path, dtype=torch_dtype(cfg.model.dtype), attn_implementation=attn).to(self.device)
        self.lm.config.use_cache = False
        enable_chunked_logprobs(self.lm)
        self.params = [p for p in self.lm.parameters()]
        mixed = self.params[0].dtype != torch.float32
        self.masters = [p.detach().float().requires_grad_() for p in self.params] if mixed else self.params
        t = cfg.trainer
        self.opt = torch.optim.AdamW(self.masters, lr=t.lr, betas=tuple(t.betas), eps=t.adam_eps,
                                     weight_decay=t.weight_decay)
        self.vocab = self.lm.config.vocab_size

    def step(self, mbs, num_sequences: int) -> tuple[float, float]:
        """One optimizer step; (the step's loss, the gradient norm). Gradients are float32 from the first
        micro-batch's backward on (the masters' .grad), as ZeRO's float32 accumulation keeps them."""
        import torch

        from pipelinerl.trainer.model import completion_forward

        loss_sum = 0.0
        for mb in mbs:
            new_N, _ = completion_forward(self.lm, mb, self.device, self.cfg.actor.sampling.temperature,
                                          self.cfg.trainer.logprob_chunk_tokens)
            loss = pg_loss(mb, new_N, None, num_sequences)[0]
            loss.backward()
            loss_sum += loss.item()
            if self.masters is not self.params:
                for m, p in zip(self.masters, self.params):
                    m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
                    p.grad = None
        clip = self.cfg.trainer.grad_clip or float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(self.masters, clip))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.masters is not self.params:
            with torch.no_grad():
                for m, p in zip(self.masters, self.params):
                    p.copy_(m)
        return loss_sum, norm

    def weights(self):
        from pipelinerl.weights import TensorMeta, dtype_name

        named = list(self.lm.named_parameters())
        return [TensorMeta(n, dtype_name(p.dtype), list(p.shape)) for n, p in named], (p.detach() for _, p in named)


def pack_buckets(metas, tensors, bucket_bytes: int, device):
    """Each bucket's buffer on the device, packed as WeightBroadcaster packs it before broadcasting
    (plan_buckets layout). No collective: one device has no receiver."""
    import torch

    from pipelinerl.weights import plan_buckets

    it = iter(tensors)
    for bucket in plan_buckets(metas, bucket_bytes):
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        for off in bucket.offsets:
            t = next(it)
            buf[off:off + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
        yield buf
    assert next(it, None) is None, "more tensors than metas"


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_bytes(device, rss_baseline: int) -> tuple[int, str]:
    import torch

    if device.type == "cuda":
        reserved = torch.cuda.max_memory_reserved(device) / GB
        return torch.cuda.max_memory_allocated(device), f"max_memory_allocated; reserved {reserved:.2f} GB"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return rss - rss_baseline, "peak RSS (getrusage) above the RSS after imports"


def current_rss() -> int:
    """Resident bytes now (Linux /proc); the high-water mark where /proc is absent."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_child(args) -> dict:
    """One trainer measurement (this process only): steps, peak memory, then gather + bucket packing."""
    import torch

    from pipelinerl.config import load_config
    from pipelinerl.trainer.packing import pack

    torch.set_num_threads(args.threads or torch.get_num_threads())
    cfg = load_config(args.child)
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401 - loaded before the baseline: not the model's memory

    if args.trainer != "torch":
        import deepspeed  # noqa: F401 - both backends' process group starts through deepspeed.init_distributed
    rss0 = current_rss()
    stepper = TorchStepper(cfg, args.device) if args.trainer == "torch" else BackendStepper(cfg)
    tap = getattr(stepper, "tap", None)
    routing = (len(tap.routers), tap.num_experts, tap.top_k) if tap is not None else None
    times, losses, norms = [], [], []
    for step in range(args.steps):
        samples = random_samples(stepper.vocab, args.tokens, min(args.seq_len, args.tokens), seed=step,
                                 routing=routing)
        mbs = pack(samples, cfg.trainer.micro_batch_tokens)
        synchronize(stepper.device)
        start = time.perf_counter()
        loss, norm = stepper.step(mbs, len(samples))
        synchronize(stepper.device)
        times.append(time.perf_counter() - start)
        losses.append(loss)
        norms.append(norm)
    peak, how = peak_bytes(stepper.device, rss0)
    moe = {}
    if routing is not None:
        layers, experts, k = routing
        moe = {"layers": layers, "experts": experts, "top_k": k, "replay": cfg.rl.routing_replay,
               "replayed": stepper.compared[0], "random_mismatch": stepper.compared[1] / max(stepper.compared[0], 1),
               "chance_mismatch": 1 - 1 / math.comb(experts, k), **stepper.self_replay(mbs[0])}
    metas, tensors = stepper.weights()
    start = time.perf_counter()
    buckets = sum(1 for _ in pack_buckets(metas, tensors, int(cfg.trainer.broadcast_bucket_mb * 2**20),
                                          stepper.device))
    synchronize(stepper.device)
    gather_s = time.perf_counter() - start
    return {"backend": stepper.name, "dtype": cfg.model.dtype, "steps": len(times), "first_step_s": times[0],
            "step_s": statistics.median(times[1:] or times), "tokens_per_step": args.tokens,
            "losses": losses, "grad_norms": norms, "grad_accum": grad_accum_dtype(stepper),
            "peak_bytes": peak, "peak_how": how, "gather_s": gather_s, "buckets": buckets,
            "gather_bytes": sum(m.nbytes for m in metas), "params": sum(_numel(m.shape) for m in metas), "moe": moe}


def grad_accum_dtype(stepper) -> str:
    """The dtype gradients accumulate in: the DeepSpeed engine's, else what this check's stepper does (float32
    masters' .grad for the torch stepper, FSDP2's float32 shards)."""
    engine = getattr(getattr(stepper, "trainer", None), "engine", None)
    if engine is not None:
        return str(engine.get_data_types()[1]).removeprefix("torch.")
    return "float32"


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def measure_trainer(cfg_path: Path, args, workdir: Path) -> dict:
    """run_child in a fresh process; its JSON result (RuntimeError with its output's tail on failure)."""
    argv = [sys.executable, str(REPO / "tools" / "gpu_check.py"), "--child", str(cfg_path), "--device", args.device,
            "--trainer", args.trainer, "--tokens", str(args.tokens), "--seq-len", str(args.seq_len),
            "--steps", str(args.steps), "--threads", str(args.threads)]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=args.step_timeout_s)
    (workdir / f"{cfg_path.stem}.child.log").write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        raise RuntimeError(f"exit {out.returncode}: {(out.stdout + out.stderr).strip()[-800:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])

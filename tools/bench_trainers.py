"""The two trainer backends, each with and without LoRA, side by side in one run (issue #29).

Four trainers on one model built offline: DeepSpeed ZeRO-3 and FSDP2, full fine-tuning and `trainer.lora`.
Each runs in a child process of its own (peaks are per trainer), built from a Config by
`backends.build_trainer` as `pipelinerl train` builds it, on one rank, for `--steps` optimizer steps on
random packed samples. After every step it gathers the weights the servers would get and counts the bytes
of one update three ways:

- dense: the (merged) model, what a dense broadcast sends;
- delta: what DeltaEncoder sends from the previous step's weights (per tensor, the smaller of dense and
  delta: an unchanged tensor costs its block counts only);
- adapter: the LoRA tensors alone, what serving the adapter with vLLM's LoRA support would load instead
  (not the shipped path: servers get the merged weights).

and how long rank 0 takes to gather (and merge) those weights and delta-encode them ("gather s": the
trainer's share of a broadcast, before any byte is sent).

Prints one row per trainer and the ratios FSDP2 / DeepSpeed and LoRA / full.

    python tools/bench_trainers.py                          # the tiny model, float32, 6 steps
    python tools/bench_trainers.py --shape small --tokens 2048 --seq-len 256
    python tools/bench_trainers.py --shape base --tokens 2048 --seq-len 256   # ~88M params
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_check_common import SHAPES, build_model, write_config
from gpu_check_trainer import BackendStepper, current_rss, peak_bytes, pg_loss, random_samples

REPO = Path(__file__).resolve().parent.parent
MB = 1e6
VARIANTS = [("deepspeed", False), ("fsdp2", False), ("deepspeed", True), ("fsdp2", True)]


def update_bytes(trainer, encoder) -> dict[str, int]:
    """One update's bytes, dense and as DeltaEncoder's choice against the previous call's weights."""
    from pipelinerl.weights import TensorMeta
    from pipelinerl.weights.delta import Delta

    metas = [TensorMeta(n, d, s) for n, d, s in trainer.named_shapes()]
    dense = delta = 0
    for meta, (_, t) in zip(metas, trainer.gathered_parameters()):
        sent, _ = encoder.encode(meta, t, delta=bool(encoder.base))
        dense += meta.nbytes
        delta += sum(x.nbytes for x in (sent.counts, sent.offsets, sent.values)) if isinstance(sent, Delta) \
            else meta.nbytes
    return {"dense": dense, "delta": delta}


def run_child(args) -> dict:
    """One trainer (this process only): steps, update bytes after each, peak memory."""
    import functools

    import torch

    from pipelinerl.config import load_config
    from pipelinerl.trainer.packing import pack
    from pipelinerl.weights.delta import DeltaEncoder

    cfg = load_config(args.child)
    import deepspeed  # noqa: F401 - both backends' process group starts through deepspeed.init_distributed

    rss0 = current_rss()
    stepper = BackendStepper(cfg)
    trainer, encoder = stepper.trainer, DeltaEncoder()
    update_bytes(trainer, encoder)  # the base the first delta is computed from: the initial weights
    times, updates, gathers = [], [], []
    for step in range(args.steps):
        samples = random_samples(stepper.vocab, args.tokens, min(args.seq_len, args.tokens), seed=step)
        mbs = pack(samples, cfg.trainer.micro_batch_tokens)
        start = time.perf_counter()
        trainer.accumulate(mbs, functools.partial(pg_loss, num_sequences=len(samples)))
        trainer.optimizer_step()
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        updates.append(update_bytes(trainer, encoder))
        gathers.append(time.perf_counter() - start)
    peak, _ = peak_bytes(stepper.device, rss0)
    lora = {n: p for n, p in trainer.lm.named_parameters() if "lora_" in n}
    size = torch.empty((), dtype=trainer.wire_dtype(next(iter(lora.values())))).element_size() if lora else 0
    params = [p for p in trainer.lm.parameters()]
    return {"steps": len(times), "step_s": statistics.median(times[1:] or times), "first_step_s": times[0],
            "gather_s": statistics.median(gathers[1:] or gathers),
            "peak_bytes": peak, "dense_bytes": statistics.median(u["dense"] for u in updates),
            "delta_bytes": statistics.median(u["delta"] for u in updates),
            "adapter_bytes": sum(trainer.full_shape(p).numel() for p in lora.values()) * size,
            "trainable": sum(trainer.full_shape(p).numel() for p in params if p.requires_grad),
            "params": sum(trainer.full_shape(p).numel() for p in params)}


def measure(cfg_path: Path, args, log: Path) -> dict:
    argv = [sys.executable, __file__, "--child", str(cfg_path), "--tokens", str(args.tokens),
            "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=args.timeout_s)
    log.write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        raise RuntimeError(f"{cfg_path.stem}: exit {out.returncode}: {(out.stdout + out.stderr).strip()[-800:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="model shape (tools/gpu_check.py)")
    p.add_argument("--dtype", default="float32", help="model.dtype (bfloat16 makes deltas sparse)")
    p.add_argument("--tokens", type=int, default=512, help="tokens per step, one micro-batch")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per packed sequence")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per trainer; the first is warm-up")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--timeout-s", type=float, default=900.0, help="limit of one trainer's child")
    p.add_argument("--workdir", help="models, configs and child logs (default: a new temporary folder)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args)))
        return 0

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_trainers_"))
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = workdir / f"model_{args.shape}"
    build_model(model_dir, args.shape, "cpu")
    cfg_args = argparse.Namespace(dtype=args.dtype, trainer=None, tokens=args.tokens, chunk=64, bucket_mb=256.0)
    res = {}
    for backend, lora in VARIANTS:
        name = f"{backend}{'+lora' if lora else ''}"
        cfg_args.trainer = backend
        extra = (f"trainer.lr={args.lr}", f"trainer.lora.rank={args.lora_rank if lora else 0}")
        cfg = write_config(workdir / f"{name}.yaml", model_dir, workdir / f"run_{name}", cfg_args, extra)
        res[name] = measure(cfg, args, workdir / f"{name}.log")
        print(f"bench_trainers: {name} measured", flush=True)

    print(f"\n{args.shape} model ({res['deepspeed']['params'] / 1e6:.2f}M params, {args.dtype}), 1 rank on "
          f"CPU, {args.tokens} tokens/step, median of steps 2..{args.steps}; LoRA rank {args.lora_rank}")
    print(f"{'trainer':<16} {'trainable':>10} {'step s':>8} {'tok/s':>8} {'peak MB':>8} {'dense MB':>9} "
          f"{'delta MB':>9} {'adapter MB':>11} {'gather s':>9}")
    for name, m in res.items():
        print(f"{name:<16} {m['trainable']:>10} {m['step_s']:>8.3f} {args.tokens / m['step_s']:>8.0f} "
              f"{m['peak_bytes'] / MB:>8.0f} {m['dense_bytes'] / MB:>9.3f} {m['delta_bytes'] / MB:>9.3f} "
              f"{m['adapter_bytes'] / MB:>11.3f} {m['gather_s']:>9.3f}")
    for a, b in (("fsdp2", "deepspeed"), ("fsdp2+lora", "deepspeed+lora")):
        print(f"{a} / {b}: step time x{res[a]['step_s'] / res[b]['step_s']:.2f}, "
              f"peak x{res[a]['peak_bytes'] / max(res[b]['peak_bytes'], 1):.2f}")
    for backend in ("deepspeed", "fsdp2"):
        full, lora = res[backend], res[f"{backend}+lora"]
        print(f"{backend}+lora / {backend}: step time x{lora['step_s'] / full['step_s']:.2f}, delta bytes "
              f"x{lora['delta_bytes'] / full['delta_bytes']:.2f}; adapter / merged dense "
              f"x{lora['adapter_bytes'] / lora['dense_bytes']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A prepared one-device check (issue #15): what one GPU runs, measured, in one table. Also a CPU smoke test.

Each step runs what the device and the installed libraries allow, and says "skipped: <why>" otherwise:

1. trainer: optimizer steps of the project's trainer on a random-init model built offline (the tiny model,
   and on CUDA a Qwen2-1.5B-shaped one; mixtures of experts: the tiny Qwen3-MoE, and on CUDA four layers of
   Qwen3-30B-A3B's shape, trained with rollout routing replay, rl.routing_replay=r3). With DeepSpeed: the
   DeepSpeed backend, ZeRO-3 on one rank, built from a Config by `backends.build_trainer` (`--trainer fsdp2`:
   the FSDP2 backend, the same way). Without it: plain torch in the same precision scheme (bf16 weights and
   gradients, float32 master weights and AdamW states), with the same chunked log-prob head.
   Peak memory (CUDA: max_memory_allocated; CPU: growth of the process's peak RSS, getrusage) and step time.
2. plan: `pipelinerl plan`'s predicted trainer memory per GPU for the same config, beside the measured peak.
3. gather: the trainer's full-model gather (ZeRO-3: module by module) packed into the wire format's buckets
   on the device: what WeightBroadcaster does before each broadcast, without the collective.
4. server (vLLM): `pipelinerl serve` on the tiny model, one weight update over gloo, per-token versions of a
   sampled completion, and the lag-0 agreement of the server's log-probs with the trainer's.
5-8. bf16 vs float32 trainer steps, the LM head's GEMMs, the double-buffered receive, and what NCCL needs
   (tools/gpu_check_device.py says what each runs).
9. routing replay (MoE shapes): replaying the trainer's own routing reproduces its log-probs bit for bit, and
   the steps' replayed random routing differs from the trainer's own about as often as chance says.
10. server MoE (MoE shapes, with the server step): the server returns each token's routed experts, and at lag 0
   they agree with the trainer's router (tools/gpu_check_server.py).

Each trainer measurement runs in a child process (`--child`, tools/gpu_check_trainer.py), so peaks are per model;
tools/gpu_check_common.py holds the shapes, the row and the model builder every part shares.

    tools/gpu_check.sh                    # CUDA: tiny + 1.5B-shaped + the two MoE shapes, server steps when
                                          # vLLM imports
    tools/gpu_check.sh --device cpu       # CI smoke test: tiny + tiny_moe, no server unless --with-server
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from gpu_check_common import GB, MOE_SHAPES, REPO, SHAPES, Row, build_model, importable, write_config
from gpu_check_device import head_gemm_row, nccl_row, precision_row, receive_row
from gpu_check_server import server_check
from gpu_check_trainer import measure_trainer, run_child

# ---- step 2: the plan's prediction ----------------------------------------------------------------------

def plan_trainer(cfg_path: Path, gpu_memory_gb: float) -> dict | str:
    """`pipelinerl plan`'s trainer role ({"per_gpu_gb", "items"}), or the reason it is unavailable (a str)."""
    argv = [sys.executable, "-m", "pipelinerl.cli", "plan", str(cfg_path), "--gpu-memory-gb",
            str(gpu_memory_gb), "--json"]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=120)
    if out.returncode == 2 and "invalid choice" in out.stderr:
        return "pipelinerl plan not available"
    try:  # a plan that does not fit may exit non-zero and still print its JSON
        trainer = json.loads(out.stdout)["roles"]["trainer"]
        return {"per_gpu_gb": float(trainer["per_gpu_gb"]), "items": dict(trainer.get("items", {}))}
    except (ValueError, KeyError, TypeError) as err:
        raise RuntimeError(f"plan exit {out.returncode}, no trainer per_gpu_gb ({err!r}): "
                           f"{(out.stdout + out.stderr).strip()[-500:]}") from None


def trainer_rows(shape: str, workdir: Path, args) -> list[Row]:
    """Steps 1-3 for one model shape."""
    model_dir = workdir / f"model_{shape}"
    start = time.monotonic()
    build_model(model_dir, shape, args.device)
    build_s = time.monotonic() - start
    extra = ("rl.routing_replay=r3",) if shape in MOE_SHAPES else ()
    cfg_path = write_config(workdir / f"{shape}.yaml", model_dir, workdir / f"run_{shape}", args, extra)
    try:
        m = measure_trainer(cfg_path, args, workdir)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        return [Row(f"trainer [{shape}]", f"FAILED: {err}")]
    rows = [Row(f"trainer [{shape}]", "ok",
                f"{m['backend']}, {m['dtype']}, {m['params'] / 1e6:.1f}M params (built in {build_s:.0f} s); "
                f"{m['tokens_per_step']} tokens/step, chunk {args.chunk}: step {m['step_s']:.2f} s "
                f"(first {m['first_step_s']:.2f} s), {m['tokens_per_step'] / m['step_s']:.0f} tok/s; "
                f"peak {m['peak_bytes'] / GB:.3f} GB ({m['peak_how']})", m)]
    rows.append(plan_row(shape, cfg_path, m, args))
    rows.append(Row(f"gather for broadcast [{shape}]", "ok",
                    f"{m['gather_bytes'] / 1e6:.1f} MB {m['dtype']} in {m['buckets']} bucket(s) of "
                    f"{args.bucket_mb:g} MiB: {m['gather_s']:.3f} s, {m['gather_bytes'] / m['gather_s'] / GB:.2f} GB/s "
                    f"(gather + pack on the device, no collective)",
                    {k: m[k] for k in ("gather_s", "gather_bytes", "buckets")}))
    if shape in MOE_SHAPES:
        rows.append(replay_row(shape, m["moe"]))
    return rows


def replay_row(shape: str, moe: dict) -> Row:
    """Step 9: what the trainer's routing replay did in the steps (random routing replayed) and after them (its
    own routing replayed)."""
    step = f"routing replay [{shape}]"
    if not moe:
        return Row(step, "skipped: needs the project's trainer backend (deepspeed or fsdp2)")
    n, p = moe["replayed"], moe["chance_mismatch"]
    bound = 5 * math.sqrt(p * (1 - p) / max(n, 1)) + 1e-3  # 5 standard errors of a binomial share
    numbers = (f"{moe['layers']} layers x {moe['experts']} experts, top-{moe['top_k']}: random routing replayed on "
               f"{n:.0f} token-layers differs from the trainer's {moe['random_mismatch']:.3f} (chance {p:.3f}); own "
               f"routing replayed: max |dlogprob| {moe['self_replay_max_diff']:.1e} (rerun noise "
               f"{moe['rerun_max_diff']:.1e})")
    if moe["self_replay_max_diff"] > moe["rerun_max_diff"]:
        return Row(step, "FAILED: replaying the trainer's own routing changed its log-probs", numbers, moe)
    if n == 0 or abs(moe["random_mismatch"] - p) > bound:
        return Row(step, f"FAILED: the replayed routing's mismatch is not chance's (+-{bound:.3f})", numbers, moe)
    return Row(step, "ok", numbers, moe)


def plan_row(shape: str, cfg_path: Path, measured: dict, args) -> Row:
    step = f"plan vs measured [{shape}]"
    try:
        plan = plan_trainer(cfg_path, args.gpu_memory_gb)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        return Row(step, f"FAILED: {err}")
    if isinstance(plan, str):
        return Row(step, f"skipped: {plan}")
    # The measured peak counts tensors only (allocated bytes or RSS growth), not the CUDA context and
    # library workspaces the plan adds as "*runtime*" items: compare it with the plan's tensors alone.
    predicted, runtime = plan["per_gpu_gb"], sum(v for k, v in plan["items"].items() if "runtime" in k)
    peak = measured["peak_bytes"] / GB
    ratio = (predicted - runtime) / max(peak, 1e-9)
    return Row(step, "ok", f"predicted trainer {predicted:.3f} GB/GPU ({predicted - runtime:.3f} GB of tensors "
                           f"+ {runtime:.3f} GB runtime), measured {peak:.3f} GB: tensors predicted/measured "
                           f"x{ratio:.2f}",
               {"predicted_gb": predicted, "predicted_tensors_gb": predicted - runtime, "measured_gb": peak,
                "ratio": ratio, "items": plan["items"]})


def print_table(rows: list[Row]) -> None:
    w_step = max(len(r.step) for r in rows)
    w_res = max(len("result"), *(min(len(r.result), 60) for r in rows))
    print(f"\n{'step':<{w_step}}  {'result':<{w_res}}  numbers")
    print(f"{'-' * w_step}  {'-' * w_res}  {'-' * 7}")
    for r in rows:
        print(f"{r.step:<{w_step}}  {r.result:<{w_res}}  {r.numbers}")


def run_checks(args) -> list[Row]:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="gpu_check_"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"gpu_check: device {args.device}, trainer {args.trainer}, models {args.models}; work in {workdir}",
          flush=True)
    rows = []
    for shape in args.models.split(","):
        start = time.monotonic()
        rows += trainer_rows(shape, workdir, args)
        print(f"gpu_check: {shape} model measured in {time.monotonic() - start:.0f} s", flush=True)
    for check in (lambda a: precision_row(workdir, a), head_gemm_row, receive_row, nccl_row):
        try:
            rows.append(check(args))
        except Exception as err:  # noqa: BLE001 - one failed step is a row, the table still prints
            rows.append(Row(check.__name__, f"FAILED: {type(err).__name__}: {str(err)[-500:]}"))
    step = "server: update + versions + lag-0 log-probs"
    if not args.with_server:
        rows.append(Row(step, "skipped: not asked (--with-server)"))
    elif not importable("vllm"):
        rows.append(Row(step, "skipped: vllm not importable"))
    else:
        moe_shapes = [s for s in args.models.split(",") if s in MOE_SHAPES]
        for shape, moe in [("tiny", False)] + [(s, True) for s in moe_shapes]:
            try:
                rows.append(server_check(workdir / f"model_{shape}", workdir, args, moe=moe))
            except Exception as err:  # noqa: BLE001 - one failed step is a row, the table still prints
                rows.append(Row(f"server [{shape}]", f"FAILED: {type(err).__name__}: {str(err)[-500:]}"))
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--trainer", choices=("auto", "deepspeed", "fsdp2", "torch"), default="auto",
                   help="auto: the DeepSpeed backend when deepspeed imports, else plain torch")
    p.add_argument("--models", help="comma-separated shapes of " + ", ".join(SHAPES) +
                   " (default: tiny,1.5b,tiny_moe,a3b_4l on CUDA, tiny,tiny_moe on CPU)")
    p.add_argument("--dtype", help="trainer dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--tokens", type=int, help="tokens per step, one micro-batch (default 8192 CUDA, 256 CPU)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per packed sequence")
    p.add_argument("--chunk", type=int, help="trainer.logprob_chunk_tokens (default 1024 CUDA, 64 CPU)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps; the first is warm-up")
    p.add_argument("--bucket-mb", type=float, default=256.0, help="trainer.broadcast_bucket_mb")
    p.add_argument("--gpu-memory-gb", type=float, help="for `pipelinerl plan` (default: this GPU's, or 80)")
    p.add_argument("--with-server", action=argparse.BooleanOptionalAction, default=None,
                   help="run the vLLM server step (default: on CUDA when vllm imports; off on CPU)")
    p.add_argument("--max-logprob-diff", type=float, default=1e-3, help="lag-0 max |dlogprob| that passes")
    p.add_argument("--max-routing-mismatch", type=float, default=0.02,
                   help="MoE: the lag-0 share of token-layers routed otherwise by server and trainer that passes")
    p.add_argument("--threads", type=int, default=0, help="torch threads in the trainer child (0: torch's)")
    p.add_argument("--step-timeout-s", type=float, default=420.0, help="limit of one trainer measurement")
    p.add_argument("--json", help="also write the rows (with their raw numbers) to this JSON file")
    p.add_argument("--workdir", help="where models, configs and logs go (default: a new temporary folder)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # a config: run one trainer measurement, print JSON
    return resolve_defaults(p.parse_args(argv))


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: --device cuda, but torch sees no CUDA device")
    gpu = args.device == "cuda"
    if args.trainer == "auto":
        args.trainer = "deepspeed" if importable("deepspeed") else "torch"
    args.models = args.models or ("tiny,1.5b,tiny_moe,a3b_4l" if gpu else "tiny,tiny_moe")
    unknown = set(args.models.split(",")) - set(SHAPES)
    if unknown:
        raise SystemExit(f"gpu_check: unknown --models {sorted(unknown)}; choose from {', '.join(SHAPES)}")
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.tokens = args.tokens or (8192 if gpu else 256)
    args.seq_len = min(args.seq_len, args.tokens) if gpu else min(args.seq_len, 32)
    args.chunk = args.chunk or (1024 if gpu else 64)
    if args.gpu_memory_gb is None:
        args.gpu_memory_gb = torch.cuda.get_device_properties(0).total_memory / GB if gpu else 80.0
    if args.with_server is None:
        args.with_server = gpu
    return args


def main() -> None:
    if not importable("omegaconf"):  # pipelinerl.config's one dependency a bare PyTorch machine lacks
        raise SystemExit("gpu_check: pipelinerl needs omegaconf and antlr4-python3-runtime; without network, "
                         "put their wheels in .whl/ (tools/gpu_check.sh installs them into a private folder)")
    args = parse_args()
    if args.child:
        print(json.dumps(run_child(args)))
        return
    rows = run_checks(args)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2))
    failed = [r.step for r in rows if r.failed]
    if failed:
        print(f"gpu_check: FAILED: {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()

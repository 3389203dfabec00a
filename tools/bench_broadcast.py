"""Weight broadcast per optimizer step: gather (ZeRO-3, module by module) and send to a real server.

For each model (the tiny one and a ~20M-parameter one, both built offline) this starts one
`pipelinerl serve` (vLLM; CPU here), runs a 2-rank ZeRO-3 DeepSpeed trainer whose rank 0 connects to
it, and times `broadcast_weights` over several versions: once gather-only (no server), once with the
broadcast. It prints bytes per step, gather time, broadcast time and the server's own update time.

    python tools/bench_broadcast.py [--steps 5] [--models tiny,20m] [--work-dir /tmp/bench_broadcast] [--summary PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch.multiprocessing as mp
from bench_summary import Summary

from pipelinerl.config import TinyModelConfig
from pipelinerl.launch.procs import free_port

TINY_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny_cpu.yaml"

SHAPES = {
    "tiny": TinyModelConfig(),
    "20m": TinyModelConfig(hidden_size=512, num_layers=7, num_attention_heads=8, num_key_value_heads=2,
                           intermediate_size=1536),
}


def start_server(model_dir: Path, run_dir: Path) -> subprocess.Popen:
    from pipelinerl.inference.rundir import list_servers

    cmd = [sys.executable, "-m", "pipelinerl.cli", "serve", str(TINY_CONFIG), "--model", str(model_dir), "--port",
           str(free_port(19600)), "--run-dir", str(run_dir), "inference.gpu_memory_utilization=0.3",
           "inference.max_model_len=256"]
    with open(run_dir / "server.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    while not list_servers(run_dir):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server did not start; see {run_dir / 'server.log'}")
        time.sleep(0.5)
    return proc


def worker(rank: int, world: int, port: int, model_dir: str, run_dir: str, steps: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from pipelinerl.config import load_config
    from pipelinerl.trainer.backends import build_trainer
    from pipelinerl.trainer.broadcast import ServerBroadcaster
    from pipelinerl.trainer.dist import init_process_group, read_dist_env

    dist = read_dist_env()
    init_process_group(dist, 300)
    cfg = load_config(None, [f"run_dir={run_dir}", f"model.path={model_dir}", "inference.weight_update_backend=gloo",
                             f"trainer.broadcast_port={free_port(19700)}", "trainer.zero_stage=3",
                             "trainer.deepspeed_config.zero_optimization.stage3_param_persistence_threshold=0"])
    broadcaster = ServerBroadcaster(cfg, dist) if dist.is_main else None
    trainer = build_trainer(cfg, dist, broadcaster)
    trainer.init(model_dir)
    gather = [trainer.broadcast_weights(v) for v in range(1, steps + 1)]  # not connected yet: gather only
    if broadcaster is not None:
        broadcaster.connect()
    send = [trainer.broadcast_weights(v) for v in range(steps + 1, 2 * steps + 1)]
    if dist.is_main:
        Path(out).write_text(json.dumps({"gather": gather, "send": send}, default=str))
        broadcaster.close()


def bench(name: str, work: Path, steps: int) -> dict:
    from pipelinerl.tiny_model import build_tiny_model

    model_dir, run_dir = work / f"model_{name}", work / f"run_{name}"
    run_dir.mkdir(parents=True, exist_ok=True)
    model, _ = build_tiny_model(model_dir, SHAPES[name])
    n_params = sum(p.numel() for p in model.parameters())
    server = start_server(model_dir, run_dir)  # vLLM needs its own cores: results are noisy on 2 CPUs
    try:
        out = work / f"result_{name}.json"
        mp.spawn(worker, args=(2, free_port(19800), str(model_dir), str(run_dir), steps, str(out)), nprocs=2)
        result = json.loads(out.read_text())
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
    gather_s = [r["broadcast_total_s"] for r in result["gather"]]
    send_s = [r["broadcast_total_s"] for r in result["send"]]
    replies = [next(iter(r["servers"].values())) for r in result["send"]]
    return {"model": name, "params": n_params, "bytes_per_step": int(result["send"][0]["bytes"]),
            "gather_s": statistics.median(gather_s), "gather_and_broadcast_s": statistics.median(send_s),
            "wire_s": statistics.median(float(r["broadcast_s"]) for r in result["send"]),
            "server_load_s": statistics.median(float(r.get("load_s", "nan")) for r in replies),
            # the whole pause, from stopping generation to resuming it (the reply's pause_s is the stop call alone)
            "server_pause_s": statistics.median(float(r.get("paused_s", "nan")) for r in replies)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--models", default="tiny,20m")
    parser.add_argument("--work-dir", default="/tmp/bench_broadcast")
    parser.add_argument("--summary", default=None, help="also write the key rows there (tools/bench_summary.py)")
    args = parser.parse_args()
    summary = Summary("broadcast")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    print(f"{'model':6s} {'params':>11s} {'MB/step':>8s} {'gather s':>9s} {'gather+send s':>14s} {'wire s':>7s} "
          f"{'srv pause s':>11s} {'srv load s':>10s}")
    for name in args.models.split(","):
        r = bench(name, work, args.steps)
        print(f"{r['model']:6s} {r['params']:11,d} {r['bytes_per_step'] / 1e6:8.2f} {r['gather_s']:9.3f} "
              f"{r['gather_and_broadcast_s']:14.3f} {r['wire_s']:7.3f} {r['server_pause_s']:11.3f} "
              f"{r['server_load_s']:10.3f}", flush=True)
        summary.add(f"{name}: bytes per step", r["bytes_per_step"] / 1e6, "MB")
        summary.add(f"{name}: gather", r["gather_s"], "s")
        summary.add(f"{name}: gather + broadcast", r["gather_and_broadcast_s"], "s")
        summary.add(f"{name}: server pause (receive + load)", r["server_pause_s"], "s")
    summary.write(args.summary)


if __name__ == "__main__":
    main()

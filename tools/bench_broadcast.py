"""Weights per optimizer step: publish (ZeRO-3 gather, module by module, into rank 0's host memory) and deliver
to a real server.

For each model (the tiny one and a ~20M-parameter one, both built offline) this starts one
`pipelinerl serve` (vLLM; CPU here), runs a 2-rank ZeRO-3 DeepSpeed trainer, and times `publish_weights` over
several versions: once with no delivery running, once with rank 0's delivery thread (the trainer's own
`start_delivery`) taking each version to the server before the next is published. It prints bytes per step,
the publish time (what the training loop waits for), the delivery round and the server's pause.

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
    from pipelinerl.rundir import list_servers

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
    from pipelinerl.trainer.dist import init_process_group, read_dist_env
    from pipelinerl.trainer.loop import start_delivery
    from pipelinerl.weights import Publication

    dist = read_dist_env()
    cfg = load_config(None, [f"run_dir={run_dir}", f"model.path={model_dir}", "inference.weight_update_backend=gloo",
                             f"trainer.broadcast_port={free_port(19700)}", "trainer.zero_stage=3",
                             "trainer.deepspeed_config.zero_optimization.stage3_param_persistence_threshold=0"])
    init_process_group(dist, 300, cfg.trainer.jit_lock_stale_s)
    publication = Publication() if dist.is_main else None
    trainer = build_trainer(cfg, dist, publication)
    trainer.init(model_dir)
    gather = [trainer.publish_weights(v) for v in range(1, steps + 1)]  # no delivery yet: publish only
    delivery = start_delivery(cfg, dist, publication) if dist.is_main else None
    send = []
    for v in range(steps + 1, 2 * steps + 1):
        published = trainer.publish_weights(v)
        if delivery is not None:  # the other ranks wait in the next gather meanwhile
            deadline, done = time.monotonic() + 300, []
            while not done:
                assert time.monotonic() < deadline and delivery.failure is None, delivery.describe()
                done = [r for r in delivery.reports() if r.ok and r.version == v]
                time.sleep(0.01)
            send.append({**published, "round_s": done[0].total_s, "wire_s": done[0].send_s,
                         "bytes": done[0].bytes, "paused_s": done[0].paused_s})
    if dist.is_main:
        Path(out).write_text(json.dumps({"gather": gather, "send": send}, default=str))
        delivery.close()


def bench(name: str, work: Path, steps: int) -> dict:
    from pipelinerl.tiny.model import build_tiny_model

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
    send = result["send"]
    return {"model": name, "params": n_params, "bytes_per_step": int(send[0]["bytes"]),
            "gather_s": statistics.median(r["publish_s"] for r in result["gather"]),
            "publish_s": statistics.median(r["publish_s"] for r in send),
            "round_s": statistics.median(r["round_s"] for r in send),
            "wire_s": statistics.median(r["wire_s"] for r in send),
            # the whole pause, from stopping generation to resuming it
            "server_pause_s": statistics.median(r["paused_s"] for r in send)}


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
    print(f"{'model':6s} {'params':>11s} {'MB/step':>8s} {'publish s':>9s} {'+delivery':>9s} {'round s':>8s} "
          f"{'wire s':>7s} {'srv pause s':>11s}")
    for name in args.models.split(","):
        r = bench(name, work, args.steps)
        print(f"{r['model']:6s} {r['params']:11,d} {r['bytes_per_step'] / 1e6:8.2f} {r['gather_s']:9.3f} "
              f"{r['publish_s']:9.3f} {r['round_s']:8.3f} {r['wire_s']:7.3f} {r['server_pause_s']:11.3f}", flush=True)
        summary.add(f"{name}: bytes per step", r["bytes_per_step"] / 1e6, "MB")
        summary.add(f"{name}: publish (gather + host copy: the loop's wait)", r["gather_s"], "s")
        summary.add(f"{name}: delivery round (off the loop)", r["round_s"], "s")
        summary.add(f"{name}: server pause (receive + load)", r["server_pause_s"], "s")
    summary.write(args.summary)


if __name__ == "__main__":
    main()

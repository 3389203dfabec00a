"""Role placement on CPU against none: the same config run twice, one after the other, with the servers pinned to
their own cores (`launch.inference_cpus`, the trainer on the rest, the actor floating) and without pinning (every
role on every core, the kernel's scheduler sharing them).

Default: configs/tiny_cpu.yaml, the run `make run` starts, shortened to --steps optimizer steps; on this 2-core
machine the pinned run gives core 0 to the server and core 1 to the trainer, seed 001's 50/50 split. Each run is
measured as tools/bench_pipeline_vs_conventional.py measures a mode (samples trained per second over the same
window, generated tokens per second, batch occupancy, trainer idle fraction, lag, time to a held-out target);
then the pinned / unpinned ratios.

    python tools/bench_placement.py [--config C] [--steps 120] [--cpus 0] [--target T] [--summary PATH]
        [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench_pipeline_vs_conventional import print_table, run_mode
from bench_summary import Summary

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description="pinned roles (launch.inference_cpus) vs no pinning, side by side")
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "tiny_cpu.yaml")
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per run")
    parser.add_argument("--cpus", default="0", help="launch.inference_cpus of the pinned run")
    parser.add_argument("--target", type=float, default=0.8, help="held-out greedy success to time")
    parser.add_argument("--eval-every", type=int, default=10, help="actor.eval_every_steps of both runs")
    parser.add_argument("--out-dir", type=Path, default=REPO / "runs" / "bench_placement")
    parser.add_argument("--base-port", type=int, default=18750)
    parser.add_argument("--summary", type=Path, default=None, help="also write the ratios here (bench_all)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides applied to both runs")
    args = parser.parse_args()
    summary = Summary("placement")  # the load average before the runs
    common = [f"trainer.max_steps={args.steps}", f"actor.eval_every_steps={args.eval_every}",
              f"inference.base_port={args.base_port}", f"trainer.broadcast_port={args.base_port + 40}", *args.overrides]
    placements = {"pinned": [f"launch.inference_cpus='{args.cpus}'"],
                  "unpinned": ["launch.inference_cpus=null", "launch.training_cpus=null", "launch.actor_cpus=null"]}
    results = {}
    for name, overrides in placements.items():
        print(f"running {name} ({args.steps} steps)...", flush=True)
        results[name] = run_mode(args.config, name, args.out_dir, overrides + common, args.target)
    print_table(results, args.target)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results.json").write_text(json.dumps(
        {name: {k: v for k, v in r.items() if k != "lengths"} for name, r in results.items()}, indent=1))

    pinned, unpinned = results["pinned"], results["unpinned"]
    summary.add("samples/s, pinned / unpinned", pinned["samples_per_s"] / unpinned["samples_per_s"], "ratio")
    speedup = None
    if pinned["time_to_target_s"] is not None and unpinned["time_to_target_s"] is not None:
        speedup = unpinned["time_to_target_s"] / pinned["time_to_target_s"]
    summary.add(f"time to held-out {args.target:.2f}, unpinned / pinned", speedup, "ratio")
    for name, r in results.items():
        summary.add(f"{name}: samples trained/s", r["samples_per_s"], "samples/s")
    summary.write(args.summary)
    print(f"\nwrote {args.out_dir / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

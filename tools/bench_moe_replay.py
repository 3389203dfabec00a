"""What rollout routing replay buys a mixture of experts trained in flight: configs/tiny_moe.yaml four ways, one
after the other from one invocation, rl.routing_replay none vs r3 at actor.max_lag 0 and 4, every run with the
servers' routing in the stream (so that `none` measures how often the trainer routes a token otherwise).

Per run, over its trained tokens (the trainer's per-token zarr statistics and TensorBoard scalars):
  |log ratio|     mean |log pi_trainer - log pi_behaviour| of the sampled tokens (the trainer's log-prob is the
                  one its loss used: routed by the server's experts with r3), and its 99th percentile
  ESS             the steps' mean effective sample size of the importance weights (1: on-policy)
  KL(b||t)        the steps' mean k3 estimate of KL(behaviour || trainer)
  mismatch        the share of token-layer routings the trainer's own top-k would choose otherwise
                  (moe/routing_mismatch; with r3 it is still measured, then replaced)
  lag             the trained tokens' mean lag, and at lag 0 / >= 1 the |log ratio| separately; a second table
                  gives the |log ratio| lag by lag, the comparison that the runs' different lag mixes do not skew
  held-out        greedy success on held-out prompts at the first and last evaluation

    .venv/bin/python tools/bench_moe_replay.py [--steps 80] [--out runs/bench_moe_replay] [--summary PATH]

The goal row (tools/bench_all.py): at max_lag 4, the stale tokens' |log ratio| with replay at most without it,
lag by lag weighted by the `none` run's lag mix (replay removes the routing part of the mismatch and adds none).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_summary import Summary  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "tiny_moe.yaml"
RUNS = [("none", 0), ("r3", 0), ("none", 4), ("r3", 4)]


def run(out: Path, replay: str, lag: int, steps: int) -> Path:
    run_dir = out / f"{replay}_lag{lag}"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    cmd = [sys.executable, "-m", "pipelinerl.cli", "run", str(CONFIG), f"run_dir={run_dir}",
           f"rl.routing_replay={replay}", "inference.return_routed_experts=true", f"actor.max_lag={lag}",
           f"trainer.max_steps={steps}", "logging.progress_bar=false", "logging.zarr_stats=true"]
    with open(out / f"{run_dir.name}.log", "w") as log:
        subprocess.run(cmd, check=True, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    return run_dir


def scalars(run_dir: Path, role: str) -> dict[str, dict[int, float]]:
    from pipelinerl.metrics import read_scalars

    return {tag: {e.step: e.value for e in events} for tag, events in read_scalars(run_dir / "tb" / role).items()}


def measure(run_dir: Path) -> dict[str, float]:
    from pipelinerl.metrics import read_token_stats

    tokens = read_token_stats(run_dir)
    ratio = np.abs(tokens["current_logprobs"].astype(np.float64) - tokens["behaviour_logprobs"])
    lag = tokens["lag"]
    trainer, actor = scalars(run_dir, "trainer"), scalars(run_dir, "actor0")
    success = [v for _, v in sorted(actor.get("eval/success", {}).items())]
    mean = lambda tag: float(np.mean(list(trainer[tag].values())))  # noqa: E731
    return {"abs_log_ratio": float(ratio.mean()), "abs_log_ratio_p99": float(np.quantile(ratio, 0.99)),
            "abs_log_ratio_lag0": float(ratio[lag == 0].mean()) if (lag == 0).any() else float("nan"),
            "abs_log_ratio_stale": float(ratio[lag >= 1].mean()) if (lag >= 1).any() else float("nan"),
            "stale_share": float((lag >= 1).mean()), "lag_mean": float(lag.mean()), "ess": mean("ess"),
            "kl_k3": mean("kl_k3"), "mismatch": mean("moe/routing_mismatch"),
            "heldout_first": success[0] if success else float("nan"),
            "heldout_last": success[-1] if success else float("nan"), "tokens": int(len(ratio)),
            "by_lag": {int(k): [float(ratio[lag == k].mean()), float(np.quantile(ratio[lag == k], 0.99)),
                                int((lag == k).sum())] for k in np.unique(lag)}}


def lag_matched(replay: dict, plain: dict) -> float:
    """Stale tokens' mean |log ratio| of `replay` over `plain`'s, each lag >= 1 weighted by `plain`'s token count
    there (runs reach different lag mixes; the ratio compares them at the same one)."""
    lags = [k for k in plain["by_lag"] if k >= 1 and k in replay["by_lag"]]
    weights = [plain["by_lag"][k][2] for k in lags]
    return (sum(w * replay["by_lag"][k][0] for k, w in zip(lags, weights))
            / sum(w * plain["by_lag"][k][0] for k, w in zip(lags, weights)))


def table(results: dict[str, dict[str, float]]) -> str:
    rows = ["| run | mismatch | \\|log ratio\\| (p99) | lag 0 / stale | stale share | lag | ESS | KL(b\\|\\|t) k3 "
            "| held-out first -> last |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        rows.append(f"| {name} | {r['mismatch']:.4f} | {r['abs_log_ratio']:.3g} ({r['abs_log_ratio_p99']:.3g}) | "
                    f"{r['abs_log_ratio_lag0']:.3g} / {r['abs_log_ratio_stale']:.3g} | {r['stale_share']:.2f} | "
                    f"{r['lag_mean']:.2f} | {r['ess']:.4f} | {r['kl_k3']:.3g} | "
                    f"{r['heldout_first']:.3f} -> {r['heldout_last']:.3f} |")
    lags = sorted({k for r in results.values() for k in r["by_lag"]})
    rows += ["", "| run | " + " | ".join(f"lag {k}: \\|log ratio\\| (p99, tokens)" for k in lags) + " |",
             "|---|" + "---|" * len(lags)]
    for name, r in results.items():
        cells = [f"{r['by_lag'][k][0]:.3g} ({r['by_lag'][k][1]:.3g}, {r['by_lag'][k][2]})" if k in r["by_lag"]
                 else "-" for k in lags]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps per run (default 80)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_moe_replay")
    parser.add_argument("--summary", type=Path, default=None, help="bench_summary's JSON (tools/bench_all.py)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for replay, lag in RUNS:
        results[f"{replay}, max_lag {lag}"] = measure(run(args.out, replay, lag, args.steps))
        print(f"{replay}, max_lag {lag}: {json.dumps(results[f'{replay}, max_lag {lag}'])}", flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    print(f"max_lag 4, stale tokens at equal lags: |log ratio| r3 / none = "
          f"{lag_matched(results['r3, max_lag 4'], results['none, max_lag 4']):.3f}")
    summary = Summary("moe_replay")
    for name, r in results.items():
        summary.add(f"{name}: routing mismatch", r["mismatch"], "share")
    summary.add("max_lag 4, stale tokens at equal lags: |log ratio| r3 / none",
                lag_matched(results["r3, max_lag 4"], results["none, max_lag 4"]), "x", "<= 1")
    summary.write(args.summary)


if __name__ == "__main__":
    main()

"""Plot a run's learning curves from its TensorBoard event files into one PNG.

    python tools/report.py RUN_DIR [--out RUN_DIR/report.png]

Panels: training reward (trainer's per-step mean), held-out success (the actor's evaluations), lag of
the trained tokens (mean and max per step) and the effective sample size of the importance weights.
"""

from __future__ import annotations

import argparse
from pathlib import Path

PANELS = [  # (title, role, [(tag, label)], y label)
    ("training reward", "trainer", [("reward_mean", "mean reward of the step's samples")], "reward"),
    ("held-out success", "actor0", [("eval/success", "pass@1 on held-out prompts")], "success"),
    ("lag of trained tokens", "trainer", [("lag_mean", "mean"), ("lag_max", "max")], "optimizer steps"),
    ("effective sample size", "trainer", [("ess", "ESS / N")], "ESS"),
]


def role_series(run_dir: Path, role: str) -> dict[str, tuple[list[int], list[float]]]:
    from pipelinerl.metrics import read_scalars as read_folder

    return {tag: ([e.step for e in events], [e.value for e in events])
            for tag, events in read_folder(run_dir / "tb" / role).items()}


def plot(run_dir: Path, out: Path) -> list[str]:
    """Write the PNG; returns the tags that were missing (their panels say so)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roles = {role: role_series(run_dir, role) for role in {p[1] for p in PANELS}}
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    missing = []
    for ax, (title, role, series, ylabel) in zip(axes.flat, PANELS):
        for tag, label in series:
            if tag in roles[role]:
                steps, values = roles[role][tag]
                ax.plot(steps, values, label=label, marker="." if len(steps) < 40 else None)
            else:
                missing.append(f"{role}/{tag}")
                ax.text(0.5, 0.5, f"no `{tag}` in tb/{role}", transform=ax.transAxes, ha="center")
        ax.set(title=title, xlabel="policy version (optimizer steps)", ylabel=ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8)
    fig.suptitle(f"PipelineRL run {run_dir}")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return missing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default RUN_DIR/report.png)")
    args = parser.parse_args()
    if not (args.run_dir / "tb").is_dir():
        raise SystemExit(f"{args.run_dir}/tb does not exist: is it a PipelineRL run directory?")
    out = args.out or args.run_dir / "report.png"
    missing = plot(args.run_dir, out)
    print(f"wrote {out}" + (f" (missing: {', '.join(missing)})" if missing else ""))


if __name__ == "__main__":
    main()

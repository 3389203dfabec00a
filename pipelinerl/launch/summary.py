"""What a finished (or stopped) run left behind, read from its run directory: the last complete
checkpoint, the trainer's last mean reward and the actor's last held-out evaluation. Every batch log
ends with `summary_line` of it; a submitit job returns it (launch/submit.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunSummary:
    """One run's outcome. None: not recorded (no checkpoint yet, no evaluation configured, ...)."""

    run_dir: str
    steps: int  # optimizer steps of the last complete checkpoint (0 without one)
    samples_seen: int  # samples those steps trained on
    last_checkpoint: str | None  # its folder
    reward_mean: float | None  # the trainer's last logged mean reward (TensorBoard `reward_mean`)
    heldout_success: float | None  # the actor's last held-out pass@1 (TensorBoard `eval/success`)

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(run_dir: str | Path) -> RunSummary:
    """The run's summary, from RUN_DIR/checkpoints and RUN_DIR/tb."""
    from pipelinerl.trainer.checkpoints import checkpoint_meta, latest_checkpoint

    run_dir = Path(run_dir)
    latest = latest_checkpoint(run_dir / "checkpoints")
    meta = checkpoint_meta(latest)
    heldout = [_last_scalar(folder, "eval/success") for folder in sorted((run_dir / "tb").glob("actor*"))]
    return RunSummary(str(run_dir), meta.get("step", 0), meta.get("samples_seen", 0),
                      None if latest is None else str(latest), _last_scalar(run_dir / "tb" / "trainer", "reward_mean"),
                      next((value for value in reversed(heldout) if value is not None), None))


def summary_line(summary: RunSummary) -> str:
    """One line for the end of a batch log."""
    line = f"summary: {summary.steps} step(s) trained on {summary.samples_seen} samples"
    line += f"; last checkpoint {summary.last_checkpoint}" if summary.last_checkpoint else "; no checkpoint"
    if summary.heldout_success is not None:
        line += f"; held-out success {summary.heldout_success:.3f}"
    if summary.reward_mean is not None:
        line += f"; reward_mean {summary.reward_mean:.4g}"
    return f"{line} (run_dir {summary.run_dir})"


def _last_scalar(folder: Path, tag: str) -> float | None:
    from pipelinerl.metrics import read_scalars

    events = read_scalars(folder).get(tag)
    return events[-1].value if events else None

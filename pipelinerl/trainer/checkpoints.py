"""Checkpoints under RUN_DIR/checkpoints, written atomically and resumed from the latest complete one.

Layout of one checkpoint (complete once renamed from `step_<8-digit step>.tmp`):

    step_00000120/
      meta.json      step, policy version, stream cursor, samples seen: written last, by rank 0
      hf/            HF weights + config + tokenizer, gathered on rank 0: loadable by transformers and vLLM
      deepspeed/     the backend's state (Trainer.save_state: every rank's weight/optimizer shard, the lr
                     schedule); the folder keeps its first backend's name so older checkpoints resume

Parallel filesystems give no locks and no atomic appends, so a checkpoint is published by renaming its
folder: a crash leaves at most a `.tmp` folder, which no reader trusts and the next save deletes.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelinerl.atomic import write_file
from pipelinerl.trainer.dist import DistInfo, all_reduce_max, barrier

if TYPE_CHECKING:
    from pipelinerl.trainer.contract import Trainer

STATE_DIR = "deepspeed"  # Trainer.save_state's folder inside a checkpoint
_NAME = re.compile(r"^step_(\d{8})$")


def checkpoint_path(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def checkpoint_meta(path: Path | None) -> dict[str, Any]:
    """A complete checkpoint's meta.json ({} for None: no checkpoint)."""
    return json.loads((Path(path) / "meta.json").read_text()) if path is not None else {}


def save_checkpoint(trainer: Trainer, root: Path, step: int, meta: dict[str, Any], keep_last: int,
                    dist: DistInfo) -> Path:
    """Collective: every rank writes its state shard, rank 0 the HF weights, meta.json and the rename."""
    final = checkpoint_path(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    trainer.save_state(tmp / STATE_DIR)
    trainer.save_hf(tmp / "hf")
    barrier()  # every shard is on disk before the checkpoint is declared complete
    if dist.is_main:
        write_file(tmp / "meta.json", json.dumps({"step": step, **meta}, indent=1))
        shutil.rmtree(final, ignore_errors=True)  # a re-save of the same step after a resume
        tmp.rename(final)
        for old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def load_checkpoint(trainer: Trainer, path: Path) -> dict[str, Any]:
    """Collective: restore the backend's state on every rank; returns the checkpoint's meta.json."""
    trainer.load_state(Path(path) / STATE_DIR)
    return checkpoint_meta(path)


class StopSignals:
    """SIGTERM / SIGUSR1 (Slurm's warning before the time limit) ask for a checkpoint and a clean exit.

    The handler only sets a flag; the loop polls `requested()` between steps, which agrees over ranks
    because a signal may reach only some of them.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.received: int | None = None

    def install(self) -> None:
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def requested(self) -> int | None:
        """The stop signal some rank received (the highest number), or None. Collective: every rank calls it
        at the same point, so a rank the signal has not reached yet (srun forwards it task by task) still
        names it in its own log."""
        return all_reduce_max(self.received or 0) or None

"""Checkpoint publication (single process, a stand-in trainer that writes marker files) and stop signals."""

import json
import os
import signal

from pipelinerl.trainer.checkpoints import (
    StopSignals,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from pipelinerl.trainer.dist import DistInfo

MAIN = DistInfo(rank=0, world_size=1, local_rank=0, backend="gloo")


class MarkerTrainer:
    """Writes what DeepSpeedTrainer would (a state folder, an HF folder) as small marker files."""

    def __init__(self):
        self.loaded = None

    def save_state(self, path):
        path.mkdir(parents=True)
        (path / "shard").write_text("state")

    def save_hf(self, path):
        path.mkdir(parents=True)
        (path / "config.json").write_text("{}")

    def load_state(self, path):
        self.loaded = path


def test_save_publishes_whole_folders_prunes_and_resumes_from_the_latest(tmp_path):
    root = tmp_path / "checkpoints"
    trainer = MarkerTrainer()
    for step in (1, 2, 3):
        save_checkpoint(trainer, root, step, {"version": step, "cursors": [{"s": step}]}, keep_last=2, dist=MAIN)
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000002", "step_00000003"]
    assert sorted(os.listdir(root / "step_00000003")) == ["deepspeed", "hf", "meta.json"]
    (root / "step_00000004.tmp").mkdir()  # a save that died before its rename
    (root / "step_00000005").mkdir()  # a folder without meta.json is not complete either
    assert latest_checkpoint(root).name == "step_00000003"
    meta = load_checkpoint(trainer, latest_checkpoint(root))
    assert meta == {"step": 3, "version": 3, "cursors": [{"s": 3}]}
    assert trainer.loaded == root / "step_00000003" / "deepspeed"
    # a resumed run that re-saves step 4 replaces the stale temporary folder
    save_checkpoint(trainer, root, 4, {"version": 4}, keep_last=2, dist=MAIN)
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000003", "step_00000004"]
    assert not (root / "step_00000004.tmp").exists()
    assert json.loads((root / "step_00000004" / "meta.json").read_text())["version"] == 4


def test_no_checkpoint_means_a_fresh_start(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None


def test_stop_signals_set_a_flag_the_loop_polls():
    previous = {sig: signal.getsignal(sig) for sig in StopSignals.SIGNALS}
    try:
        signals = StopSignals()
        signals.install()
        assert not signals.requested()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert signals.requested() and signals.received == signal.SIGUSR1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

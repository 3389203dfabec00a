"""The submitit API (pipelinerl.launch.submit) and the run summary every batch log ends with, without a
cluster: a run directory written by hand, submitit jobs faked where Slurm would answer. Real submitit
jobs run in tests/test_slurm.py (the sweep, slow)."""

import json
import os
from pathlib import Path

import pytest

from pipelinerl.launch import submit
from pipelinerl.launch.summary import RunSummary, summarize, summary_line
from pipelinerl.metrics import Scalars

REPO = Path(__file__).resolve().parent.parent


def _run_dir(tmp_path, steps=(2, 4), evals=(0.25, 0.5), rewards=(0.1, 0.3)):
    """A run directory as the roles leave it: checkpoints (one incomplete), trainer and actor scalars."""
    run = tmp_path / "run"
    for step in steps:
        (run / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
        meta = {"step": step, "samples_seen": 32 * step, "version": step}
        (run / "checkpoints" / f"step_{step:08d}" / "meta.json").write_text(json.dumps(meta))
    (run / "checkpoints" / "step_00000009.tmp").mkdir(parents=True)  # a save cut short: not a checkpoint
    trainer, actor = Scalars(run, "trainer"), Scalars(run, "actor0")
    for i, reward in enumerate(rewards):
        trainer.log(i + 1, {"reward_mean": reward})
    for i, success in enumerate(evals):
        actor.log(2 * i, {"eval/success": success})
    trainer.close()
    actor.close()
    return run


def test_summary_reads_the_last_complete_checkpoint_and_the_last_scalars(tmp_path):
    run = _run_dir(tmp_path)
    summary = summarize(run)
    assert summary == RunSummary(str(run), 4, 128, str(run / "checkpoints" / "step_00000004"),
                                 pytest.approx(0.3), pytest.approx(0.5))
    assert summary_line(summary) == (f"summary: 4 step(s) trained on 128 samples; last checkpoint "
                                     f"{run}/checkpoints/step_00000004; held-out success 0.500; reward_mean 0.3 "
                                     f"(run_dir {run})")


def test_summary_of_a_run_that_left_nothing(tmp_path):
    summary = summarize(tmp_path / "empty")
    assert summary == RunSummary(str(tmp_path / "empty"), 0, 0, None, None, None)
    assert summary_line(summary) == f"summary: 0 step(s) trained on 0 samples; no checkpoint (run_dir {tmp_path}/empty)"


class _Job:
    """A submitit job as the API reads it: id, log path, done()."""

    def __init__(self, job_id: str, done: bool = False):
        self.job_id, self._done = job_id, done
        self.paths = type("Paths", (), {"stdout": f"/logs/{job_id}.out"})()

    def done(self, force_check: bool = False) -> bool:
        return self._done


def test_waiting_on_a_crashed_job_without_accounting_ends(monkeypatch):
    """Without accounting, a hard-crashed job is never done and has no result: squeue decides."""
    monkeypatch.setattr(submit, "_in_queue", lambda job_id: False)  # gone from squeue, never a result
    outcomes = submit.wait_jobs([_Job("7_0")], timeout_s=30, poll_s=0.05, vanish_grace_s=0.3)
    assert outcomes == [("CRASHED", "left the queue without a result; log: /logs/7_0.out")]
    monkeypatch.setattr(submit, "_in_queue", lambda job_id: True)  # still queued: the deadline names it
    with pytest.raises(TimeoutError, match="Slurm job.s. 7_1 not finished after 0 s"):
        submit.wait_jobs([_Job("7_1")], timeout_s=0.2, poll_s=0.05)


def test_outcomes_become_a_table(tmp_path, monkeypatch):
    run = _run_dir(tmp_path)
    monkeypatch.setattr(submit, "_outcome", lambda job: ("COMPLETED", summarize(run)))
    jobs = [_Job("8_0", done=True)]
    rows = submit.outcome_rows(jobs, submit.wait_jobs(jobs, timeout_s=5), ["trainer.lr=1e-4"])
    rows += submit.outcome_rows([_Job("8_1")], [("FAILED", "boom")], ["trainer.lr=2e-4"])
    lines = submit.format_table(rows).splitlines()
    assert lines[0].split() == ["point", "job", "state", "steps", "samples_seen", "reward_mean", "heldout_success",
                                "run_dir"]
    assert lines[1].split() == ["trainer.lr=1e-4", "8_0", "COMPLETED", "4", "128", "0.3", "0.5", str(run)]
    assert lines[2].split() == ["trainer.lr=2e-4", "8_1", "FAILED", "-", "-", "-", "-", "boom"]


def test_executor_asks_for_one_allocation_of_every_node(tmp_path, monkeypatch):
    """On any machine, Slurm or not: submitit's SlurmExecutor refuses to be built unless an `srun` is on PATH
    (it only looks for one; building the executor runs nothing). The `srun` given here records any call, and
    none must come."""
    from pipelinerl.config import load_config

    bin_dir, calls = tmp_path / "bin", tmp_path / "srun.calls"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\nexit 1\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    cfg = load_config(REPO / "configs/qwen32b_orz.yaml", ["launch.slurm.partition=gpu"])
    params = submit.executor(cfg, tmp_path / "submitit").parameters
    assert not calls.exists()
    assert params["additional_parameters"] == {"nodes": 4, "time": "6-12:00:00", "signal": "B:USR1@300",
                                               "requeue": True}
    assert (params["partition"], params["gpus_per_node"], params["mem"], params["use_srun"]) == ("gpu", 8, "0", False)

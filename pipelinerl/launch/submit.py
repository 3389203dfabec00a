"""The pipeline from Python through submitit: what a user's own sweep script imports.

    from pipelinerl.config import load_config
    from pipelinerl.launch.submit import executor, run_pipeline

    ex = executor(load_config("configs/tiny_cpu.yaml"), folder="runs/submitit")
    job = ex.submit(run_pipeline, "/abs/path/configs/tiny_cpu.yaml", ["trainer.lr=1e-4"])
    print(job.result())  # RunSummary(run_dir=..., steps=..., last_checkpoint=..., heldout_success=...)

`local_executor` + `run_local_pipeline` run the same on this machine instead, one job at a time.
`executor` asks for one homogeneous allocation of inference_nodes + training_nodes (submitit cannot
submit heterogeneous jobs, nor can Slurm make arrays of them; launch/slurm.py's "split" shape);
`run_pipeline` is what each job runs; `wait_jobs` + `outcome_rows` + `format_table` turn finished
jobs into a table (tools/sweep.py, `pipelinerl slurm submit`).
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

from pipelinerl.config import Config
from pipelinerl.launch.slurm import allocation_from_env, launch, slurm_command
from pipelinerl.launch.summary import RunSummary, summarize

__all__ = ["RunSummary", "executor", "format_table", "local_executor", "outcome_rows", "run_local_pipeline",
           "run_pipeline", "summarize", "wait_jobs"]


def run_pipeline(config: str, overrides: list[str]) -> RunSummary:
    """What a submitit job runs, in its batch step: the pipeline on this allocation, then its summary.
    `config` must be readable from the job (an absolute path is safest)."""
    from pipelinerl.config import load_config

    cfg = load_config(config, overrides)
    launch(cfg, allocation_from_env(cfg))
    return summarize(cfg.run_dir)


def run_local_pipeline(config: str, overrides: list[str]) -> RunSummary:
    """What a `local_executor` job runs: `pipelinerl run` (every role on this machine), then its summary."""
    from pipelinerl.config import load_config
    from pipelinerl.launch.local import run_local

    cfg = load_config(config, overrides)
    run_local(cfg)
    return summarize(cfg.run_dir)


def local_executor(folder: str | Path, timeout_min: int):
    """A submitit executor running jobs as processes of this machine (`run_local_pipeline`), for a laptop or one
    node: submit one point at a time and wait for it, each run takes the whole machine."""
    import submitit

    ex = submitit.LocalExecutor(folder)
    ex.update_parameters(timeout_min=timeout_min)
    return ex


def executor(cfg: Config, folder: str | Path):
    """A submitit executor for one split allocation of the config's node counts and #SBATCH fields."""
    import submitit

    s = cfg.launch.slurm
    # `exec`: the batch shell becomes this Python, so --signal=B:USR1 reaches `launch` (a bash running a
    # foreground child would die of it); use_srun=False: `launch` runs in the batch step, as from sbatch.
    ex = submitit.SlurmExecutor(folder, python=f"exec {shlex.quote(sys.executable)}")
    # --nodes goes in additional_parameters: submitit would expect a result from every node's task, but
    # only the batch step runs the function (use_srun=False), so results() would wait for the others.
    nodes = s.inference_nodes + s.training_nodes
    params = {"ntasks_per_node": 1, "use_srun": False, "stderr_to_stdout": True, "job_name": "pipelinerl",
              "additional_parameters": {"nodes": nodes, "time": s.time, "signal": f"B:USR1@{s.signal_seconds}",
                                        "requeue": True}}
    for key in ("partition", "account", "qos", "gpus_per_node", "cpus_per_task", "mem"):
        if getattr(s, key) is not None:
            params[key] = getattr(s, key)
    ex.update_parameters(**params)
    return ex


def _in_queue(job_id: str) -> bool:
    out = slurm_command("squeue", "-h", "-j", job_id, "-o", "%i")
    return out.returncode == 0 and bool(out.stdout.strip())


def _outcome(job) -> tuple[str, object]:
    from submitit.core.utils import FailedJobError, UncompletedJobError

    try:
        return "COMPLETED", job.result()
    except (FailedJobError, UncompletedJobError) as err:  # the job's state and the error's first line
        return job.state, str(err).strip().splitlines()[0]


def wait_jobs(jobs: list, timeout_s: float, poll_s: float = 5.0, vanish_grace_s: float = 60.0) -> list:
    """(state, RunSummary or error text) per submitit job, in order.

    submitit learns that a job ended only from sacct: without accounting, a job that crashed before
    writing its result stays "UNKNOWN" and job.result() waits forever. So squeue is asked too: a job
    that left the queue and has no result `vanish_grace_s` later is reported as CRASHED.
    """
    deadline, gone_since, outcomes = time.monotonic() + timeout_s, {}, {}
    while len(outcomes) < len(jobs):
        for job in jobs:
            if job.job_id in outcomes:
                continue
            if job.done(force_check=True):
                outcomes[job.job_id] = _outcome(job)
            elif _in_queue(job.job_id):
                gone_since.pop(job.job_id, None)
            elif time.monotonic() - gone_since.setdefault(job.job_id, time.monotonic()) > vanish_grace_s:
                outcomes[job.job_id] = ("CRASHED", f"left the queue without a result; log: {job.paths.stdout}")
        if len(outcomes) < len(jobs):
            if time.monotonic() > deadline:
                pending = [j.job_id for j in jobs if j.job_id not in outcomes]
                raise TimeoutError(f"Slurm job(s) {', '.join(pending)} not finished after {timeout_s:.0f} s")
            time.sleep(poll_s)
    return [outcomes[j.job_id] for j in jobs]


def format_table(rows: list[dict]) -> str:
    """A fixed-width text table of dicts (columns from the first row)."""
    cols = list(rows[0])
    cells = [[_cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _cell(value) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def outcome_rows(jobs: list, outcomes: list, labels: list[str]) -> list[dict]:
    """Table rows: label, job, state, then the summary fields (or the error in the run_dir column)."""
    rows = []
    for label, job, (state, result) in zip(labels, jobs, outcomes):
        summary = result.as_dict() if isinstance(result, RunSummary) else {"run_dir": None, "error": result}
        rows.append({"point": label, "job": job.job_id, "state": state, "steps": summary.get("steps"),
                     "samples_seen": summary.get("samples_seen"), "reward_mean": summary.get("reward_mean"),
                     "heldout_success": summary.get("heldout_success"),
                     "run_dir": summary.get("run_dir") or summary.get("error")})
    return rows

"""Sweep config overrides as one Slurm job array (submitit), one run directory per point, then a table.

    python tools/sweep.py configs/tiny_cpu.yaml --grid trainer.lr=1e-4,3e-4 --grid actor.attempts=4,8 \\
        [--folder runs/sweeps/submitit] [--timeout-s S] [key=value ...]

The grid is the product of every --grid; key=value arguments apply to every point. Each point is the
pipeline `sbatch slurm/run_*.sh` runs, but in one homogeneous allocation per array task: Slurm cannot
make arrays of heterogeneous jobs and submitit cannot submit them (pipelinerl/launch/slurm.py splits
the nodes itself); it is a thin user of pipelinerl.launch.submit, the Python API for your own sweep
scripts. Point i runs in RUN_DIR/<its overrides>; so that array tasks sharing a host do not collide,
its servers listen on inference.base_port + i * num_servers, its weight-update store on
trainer.broadcast_port + i and its trainer rendezvous on launch.slurm.master_port + i (when set).
Exit code 1 when a point did not complete.
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
from pathlib import Path

from pipelinerl.config import ConfigError, load_config


def grid_points(grids: list[str]) -> list[list[str]]:
    """`key=v1,v2` strings -> every combination, as lists of key=value overrides."""
    axes = []
    for grid in grids:
        key, sep, values = grid.partition("=")
        if not sep or not key or not values:
            raise ConfigError(f"--grid {grid!r} is not of the form key=v1,v2 (e.g. trainer.lr=1e-4,3e-4)")
        if key.startswith("launch.slurm."):
            raise ConfigError(f"--grid {key}: one job array shares its resources; set launch.slurm.* for all points")
        axes.append([f"{key}={v}" for v in values.split(",")])
    return [list(combo) for combo in itertools.product(*axes)]


def point_name(point: list[str]) -> str:
    """A folder name for one point, readable: `trainer.lr=0.0001_actor.attempts=4`."""
    return re.sub(r"[^A-Za-z0-9._=+-]", "-", "_".join(point)) or "base"


def point_overrides(config: str, common: list[str], point: list[str], index: int, name: str | None = None) -> list[str]:
    """The full override list of point `index` (validated): common, its grid values, run dir (RUN_DIR/`name`,
    by default point_name) and ports."""
    base = load_config(config, [*common, *point])
    overrides = [*common, *point, f"run_dir={Path(base.run_dir) / (name or point_name(point))}",
                 f"inference.base_port={base.inference.base_port + index * base.inference.num_servers}",
                 f"trainer.broadcast_port={base.trainer.broadcast_port + index}"]
    if base.launch.slurm.master_port is not None:  # else derived from each array task's own job id
        overrides.append(f"launch.slurm.master_port={base.launch.slurm.master_port + index}")
    load_config(config, overrides)
    return overrides


def main(argv: list[str] | None = None) -> int:
    from pipelinerl.launch.submit import executor, format_table, outcome_rows, run_pipeline, wait_jobs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="YAML config file (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="overrides for every point")
    parser.add_argument("--grid", action="append", default=[], metavar="key=v1,v2", help="one swept key (repeat)")
    parser.add_argument("--folder", default="runs/sweeps/submitit", help="submitit's scripts, logs and results")
    parser.add_argument("--timeout-s", type=float, default=7 * 86400, help="give up waiting after this long")
    args = parser.parse_intermixed_args(argv)  # options may come after key=value overrides
    try:
        points = grid_points(args.grid)
        all_overrides = [point_overrides(args.config, args.overrides, p, i) for i, p in enumerate(points)]
    except ConfigError as err:
        print(f"sweep: error: {err}", file=sys.stderr)
        return 2
    config = str(Path(args.config).resolve())
    ex = executor(load_config(config, all_overrides[0]), args.folder)
    jobs = ex.map_array(run_pipeline, [config] * len(points), all_overrides)
    print(f"submitted job array {jobs[0].job_id.split('_')[0]}: {len(jobs)} point(s); logs in {args.folder}",
          flush=True)
    outcomes = wait_jobs(jobs, args.timeout_s)
    print(format_table(outcome_rows(jobs, outcomes, [" ".join(p) or "(base)" for p in points])), flush=True)
    return 0 if all(state == "COMPLETED" for state, _ in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())

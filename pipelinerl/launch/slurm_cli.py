"""`pipelinerl slurm WHAT ...`: the Slurm commands, each in its module. `launch` (the job's launcher) and its
--dry-run: launch/slurm.py; `servers` (a node's servers agent): launch/slurm_node.py; `script` (an sbatch
script rendered from a config): launch/script.py; `submit` (one submitit job, waited for): launch/submit.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipelinerl.config import Config, load_config
from pipelinerl.launch.script import render_script
from pipelinerl.launch.slurm import allocation_from_env, check_config, dry_run_allocation, launch, render
from pipelinerl.launch.slurm_node import run_node_servers
from pipelinerl.launch.submit import executor, format_table, outcome_rows, run_pipeline, wait_jobs


def _config_args(parser) -> None:
    parser.add_argument("config", help="YAML config file (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. trainer.lr=1e-5")


def _parser():
    parser = argparse.ArgumentParser(prog="pipelinerl slurm", description="Run the pipeline on Slurm.")
    sub = parser.add_subparsers(dest="what", required=True, metavar="WHAT")
    p = sub.add_parser("launch", help="run the pipeline on this job's nodes (what slurm/run_*.sh executes)")
    _config_args(p)
    p.add_argument("--dry-run", action="store_true", help="print the srun line of each role; start nothing")
    p = sub.add_parser("servers", help="(started by launch on each inference node) this node's vLLM servers "
                                         "(and OpenEnv servers, task.openenv.serve)")
    p.add_argument("config", help="the run's resolved RUN_DIR/config.yaml")
    p.add_argument("--model", required=True, help="HF folder the servers load")
    p.add_argument("--version", type=int, required=True, help="policy version of those weights")
    p.add_argument("--side-node", default=None,
                   help="the node whose first server slots serve the reference, reward and eval servers "
                        "(launch/slurm.py)")
    p = sub.add_parser("script", help="print the sbatch script of CONFIG: #SBATCH lines from its launch.slurm "
                                      "(save it: `pipelinerl slurm script CONFIG > job.sh`)")
    p.add_argument("--job-name", default="pipelinerl", help="the job's name (#SBATCH --job-name)")
    p.add_argument("--path", default="job.sh", help="where the script will be saved, as its usage comment names it")
    p.add_argument("config", help="YAML config file; the script runs it")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="overrides the script applies to CONFIG (its shape: node counts, servers, ...)")
    p = sub.add_parser("submit", help="submit the pipeline with submitit, wait, print its summary")
    _config_args(p)
    p.add_argument("--folder", default="runs/submitit", help="submitit's folder (scripts, logs, results)")
    p.add_argument("--timeout-s", type=float, default=7 * 86400, help="give up waiting after this long")
    return parser


def main(argv: list[str]) -> None:
    args = _parser().parse_args(argv)
    cfg = load_config(args.config, getattr(args, "overrides", []))
    try:
        check_config(cfg)
        if args.what == "servers":
            run_node_servers(cfg, args.config, args.model, args.version, args.side_node)
        elif args.what == "launch" and args.dry_run:
            print(render(cfg, dry_run_allocation(cfg)))
        elif args.what == "launch":
            launch(cfg, allocation_from_env(cfg))
        elif args.what == "script":
            print(render_script(cfg, args.config, args.overrides, args.job_name, args.path), end="")
        else:
            _submit(cfg, args)
    except ValueError as err:  # user errors (allocation vs config, GPUs per server): a message, no traceback
        raise SystemExit(f"pipelinerl slurm {args.what}: error: {err}") from None


def _submit(cfg: Config, args) -> None:
    """`pipelinerl slurm submit`: one submitit job, waited for, its summary as a table."""
    job = executor(cfg, args.folder).submit(run_pipeline, str(Path(args.config).resolve()), args.overrides)
    print(f"submitted Slurm job {job.job_id}; waiting (log: {job.paths.stdout})", flush=True)
    print(format_table(outcome_rows([job], wait_jobs([job], args.timeout_s), ["-"])))

"""`pipelinerl eval CHECKPOINT_OR_RUN_DIR`: evaluate a checkpoint outside a run.

What is evaluated (resolve_target):
  - a run directory (it has config.yaml or checkpoints/): its latest complete checkpoint, or `--step K`;
    with no checkpoint yet, the run's initial model (model.path) at version 0, as `pipelinerl run` would
    serve it. The config is RUN_DIR/config.yaml unless `--config` names another.
  - an HF model folder (it has config.json): served at the version of the checkpoint it belongs to
    (../meta.json), else 0. The config is `--config`; without it, a checkpoint's weights folder
    (RUN_DIR/checkpoints/step_K/hf) takes its run's RUN_DIR/config.yaml, any other folder is an error.

How: the policy servers (and the OpenEnv environment servers of task.openenv.serve) are started as the launchers
start theirs (launch/commands.py's command lines, under launch/procs.py's Supervisor, by launch/local.py's
start_servers) with a scratch run directory of their own (a fresh temporary folder: discovery files, auth token,
logs) on free ports from inference.base_port, so a live run on the same machine is never disturbed. The eval sets
of `--sets a,b` (default: `default`) are read before any server starts (a missing file is an error naming the
set), sampled through the actor's CompletionsClient and graded with task.reward / task.is_success, exactly as the
actor evaluates them (pipelinerl/eval/sets.py). The JSON report (per set and mode: pass@k, mean length,
truncation rate, every item's outcomes; eval/metrics.py) is written atomically and printed as a table. The scratch
folder is deleted on success and kept (its path logged) when a server fails.

Eval sets:
  - `default`: the first actor.eval_samples items of the task's held-out split (task.eval_dataset_path, or
    task.eval_fraction of the data), greedy (n = 1, unless --no-greedy) and/or sampled at --temperature
    (default actor.sampling.temperature) with n = --samples;
  - a name of task.eval_sets: that set as the config defines it (its file, max_prompts, samples per prompt
    and temperature; the report's mode is `greedy` at temperature 0, else `sampled`). Override a definition
    like any key, e.g. task.eval_sets.aime24.samples=32.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipelinerl.config import Config, ConfigError, load_config, save_config
from pipelinerl.config.actor import DEFAULT_EVAL_SET

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """The weights to evaluate and where their config and report live."""

    model: str  # HF folder the servers load
    version: int  # policy version of those weights (the servers report it)
    step: int | None  # the checkpoint's optimizer step; None: not a checkpoint
    config: Path  # config file the eval runs with (before the command's overrides)
    run_dir: Path | None  # the run the weights come from, if known (the default report goes there)

    def default_report(self) -> Path:
        name = f"step_{self.step:08d}.json" if self.step is not None else f"{Path(self.model).name}.json"
        return (self.run_dir / "eval" / name) if self.run_dir is not None else Path("eval_report.json")


def resolve_target(target: str | Path, step: int | None = None, config: str | Path | None = None,
                   overrides: list[str] | tuple[str, ...] = ()) -> Target:
    """What `pipelinerl eval TARGET [--step K] [--config C]` evaluates (see the module's docstring)."""
    from pipelinerl.trainer.checkpoints import checkpoint_meta, checkpoint_path, complete_checkpoints, latest_checkpoint

    path = Path(target)
    if (path / "config.json").is_file():  # an HF model folder
        if step is not None:
            raise ConfigError(f"--step picks a checkpoint of a run directory; {path} is a model folder")
        run_dir = path.parent.parent.parent if path.parent.parent.name == "checkpoints" else None
        if config is None and (run_dir is None or not (run_dir / "config.yaml").is_file()):
            raise ConfigError(f"{path} is not a checkpoint of a run directory: give its config with --config")
        meta = checkpoint_meta(path.parent if (path.parent / "meta.json").is_file() else None)
        return Target(str(path), int(meta.get("version", 0)), meta.get("step"),
                      Path(config) if config is not None else run_dir / "config.yaml", run_dir)
    if not ((path / "config.yaml").is_file() or (path / "checkpoints").is_dir()):
        raise ConfigError(f"{path} is neither a run directory (config.yaml, checkpoints/) nor an HF model folder "
                          "(config.json)")
    config_path = Path(config) if config is not None else path / "config.yaml"
    if not config_path.is_file():
        raise ConfigError(f"{config_path} not found: give the run's config with --config")
    if step is not None:
        ckpt = checkpoint_path(path / "checkpoints", step)
        if not (ckpt / "meta.json").is_file():
            found = [int(p.name.split("_")[1]) for p in complete_checkpoints(path / "checkpoints")]
            raise ConfigError(f"{path} has no complete checkpoint at step {step}; complete steps: {found or 'none'}")
    else:
        ckpt = latest_checkpoint(path / "checkpoints")
    if ckpt is None:  # nothing trained yet: the run's initial model, as its servers would start
        cfg = load_config(config_path, [*overrides, f"run_dir={path}"])
        return Target(cfg.model.path, 0, None, config_path, path)
    meta = checkpoint_meta(ckpt)
    return Target(str(ckpt / "hf"), int(meta["version"]), int(meta["step"]), config_path, path)


def free_base_port(start: int, count: int) -> int:
    """The first port p >= start with p .. p+count-1 all free on 127.0.0.1 (a live run's servers hold theirs)."""
    from pipelinerl.launch.procs import free_port

    base = start
    while True:
        base = free_port(base)
        if all(free_port(base + i) == base + i for i in range(1, count)):
            return base
        base += 1


def eval_config(target: Target, overrides: list[str], scratch: Path, temperature: float | None) -> Config:
    """The run's config with the command's overrides, the scratch run directory and free server ports."""
    from pipelinerl.launch.commands import server_port

    extra = [f"run_dir={scratch}"]
    if temperature is not None:
        extra.append(f"actor.sampling.temperature={temperature}")
    cfg = load_config(target.config, [*overrides, *extra])
    envs = cfg.task.openenv_servers_started  # their ports come after every vLLM kind's: the span through them
    span = server_port(cfg, envs - 1, "openenv") - cfg.inference.base_port + 1 if envs else cfg.inference.num_servers
    port = free_base_port(cfg.inference.base_port, span)
    return load_config(target.config, [*overrides, *extra, f"inference.base_port={port}"])


def server_roles(cfg: Config, config_path: Path, target: Target) -> list:
    """One Role per policy server of `cfg`, serving the target; on a GPU machine, server i takes GPUs
    i*tp .. (i+1)*tp - 1 of those visible (no trainer to share them with). Then the OpenEnv environment
    servers, as `pipelinerl run` starts them."""
    from pipelinerl.launch.commands import policy_server, server_env
    from pipelinerl.launch.local import machine_gpus, openenv_roles
    from pipelinerl.launch.procs import Role

    gpus, tp = machine_gpus(), cfg.inference.tensor_parallel_size
    if gpus and len(gpus) < cfg.inference.num_servers * tp:
        raise ConfigError(f"{cfg.inference.num_servers} server(s) of tensor_parallel_size {tp} need "
                          f"{cfg.inference.num_servers * tp} GPUs; {len(gpus)} visible (set inference.num_servers)")
    roles = []
    for i in range(cfg.inference.num_servers):
        name, argv = policy_server(cfg, str(config_path), i, target.model, target.version)
        env = server_env(cfg)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i * tp:(i + 1) * tp])
        roles.append(Role(name, argv, Path(cfg.run_dir) / "logs" / f"{name}.log", env))
    return roles + openenv_roles(cfg, config_path)


def check_request(sets: list[str], samples: int, greedy: bool) -> list[str]:
    """The set names asked for (`--sets a,b`, in order, once each); a ConfigError for flags
    that cannot run. --samples and --no-greedy say how the `default` set is sampled."""
    names = list(dict.fromkeys(name for arg in sets for name in arg.split(",") if name))
    if not names:
        raise ConfigError("--sets names no eval set")
    if samples < 0:
        raise ConfigError(f"--samples must be >= 0 (0: no sampled evaluation); got {samples}")
    if DEFAULT_EVAL_SET in names and not greedy and not samples:
        raise ConfigError("nothing to evaluate on the `default` set: --no-greedy needs --samples N")
    if DEFAULT_EVAL_SET not in names and (samples or not greedy):
        raise ConfigError(f"--samples and --no-greedy choose how the `{DEFAULT_EVAL_SET}` set is sampled; a named set "
                          "is sampled as its task.eval_sets entry says: add `default` to --sets or drop them")
    return names


def eval_suites(cfg: Config, task, names: list[str], samples: int, greedy: bool) -> list:
    """The suites of `--sets`: `default` greedy and/or sampled (`samples` completions per item at
    actor.sampling.temperature), a named set as task.eval_sets defines it, its file read now (before any
    server starts)."""
    from pipelinerl.eval.sets import held_out_suite, named_suite

    unknown = [n for n in names if n != DEFAULT_EVAL_SET and n not in cfg.task.eval_sets]
    if unknown:
        raise ConfigError(f"unknown eval set(s) {unknown}: this config's sets are "
                          f"{[DEFAULT_EVAL_SET, *cfg.task.eval_sets]} (`default` is the task's held-out split; "
                          "the others are task.eval_sets)")
    suites = []
    for name in names:
        if name != DEFAULT_EVAL_SET:
            try:
                suites.append(named_suite(cfg, task, name))
            except ValueError as err:  # a missing or malformed file: a user error, not a traceback
                raise ConfigError(str(err)) from None
            continue
        if not cfg.actor.eval_samples:
            raise ConfigError("actor.eval_samples is 0: set it to the number of held-out items to evaluate")
        suites += [held_out_suite(cfg, task, 1, 0.0)] if greedy else []
        suites += [held_out_suite(cfg, task, samples, cfg.actor.sampling.temperature)] if samples else []
    return suites


async def sample_suites(cfg: Config, task, tokenizer, suites: list) -> tuple[list[list], int]:
    """([ItemOutcome per item] per suite, the servers' policy version); at most actor.max_groups_in_flight
    requests at once."""
    import httpx

    from pipelinerl.actor.client import KEEPALIVE_S, CompletionsClient
    from pipelinerl.eval.sets import sample_suite

    client = CompletionsClient(cfg.actor, cfg.run_dir, reference=False)
    gate = asyncio.Semaphore(cfg.actor.max_groups_in_flight)
    limits = httpx.Limits(max_connections=cfg.actor.max_groups_in_flight, keepalive_expiry=KEEPALIVE_S)
    async with httpx.AsyncClient(limits=limits) as http:
        version = await client.serving_version(http)
        sampled = await asyncio.gather(*(sample_suite(client, http, task, tokenizer, suite, cfg, gate)
                                         for suite in suites))
    return [[s.outcome for s in items] for items in sampled], version


def build_report(target: Target, cfg: Config, suites: list, outcomes: list[list], version: int) -> dict:
    """The JSON report: where the weights came from and, per set and mode, the metrics and outcomes."""
    from pipelinerl.eval.metrics import mode_report

    sets: dict[str, dict] = {}
    for suite, items in zip(suites, outcomes):
        sets.setdefault(suite.name, {})[suite.mode] = mode_report(items, suite.temperature)
    return {"model": target.model, "policy_version": version, "step": target.step, "config": str(target.config),
            "task": cfg.task.name, "max_new_tokens": cfg.actor.sampling.max_new_tokens, "sets": sets}


def run_eval(target_arg: str, overrides: list[str], *, config: str | None = None, step: int | None = None,
             sets: list[str] = (DEFAULT_EVAL_SET,), samples: int = 0, temperature: float | None = None,
             greedy: bool = True, out: str | None = None) -> dict:
    """Entry point of `pipelinerl eval`: serve the target, sample, grade, write and print the report."""
    from pipelinerl.atomic import write_file
    from pipelinerl.eval.metrics import format_table
    from pipelinerl.tasks import get_task

    names = check_request(list(sets), samples, greedy)
    target = resolve_target(target_arg, step, config, overrides)
    scratch = Path(tempfile.mkdtemp(prefix="pipelinerl-eval-"))
    cfg = eval_config(target, overrides, scratch, temperature)
    task = get_task(cfg.task, cfg.run_dir)
    try:
        suites = eval_suites(cfg, task, names, samples, greedy)  # the sets' files, read before any server starts
        report = _serve_and_sample(cfg, target, task, suites)
    except ConfigError:
        shutil.rmtree(scratch, ignore_errors=True)  # nothing was started: nothing to keep
        raise
    finally:
        task.close()
    shutil.rmtree(scratch, ignore_errors=True)
    path = Path(out) if out is not None else target.default_report()
    write_file(path, json.dumps(report, indent=1))
    print(format_table(report), flush=True)
    print(f"report: {path}", flush=True)
    return report


def _serve_and_sample(cfg: Config, target: Target, task, suites: list) -> dict:
    """Start the servers on cfg.run_dir (the scratch folder), sample every suite, stop them; the report."""
    from transformers import AutoTokenizer

    from pipelinerl.launch.local import start_servers
    from pipelinerl.launch.procs import RoleFailed, Supervisor

    scratch = Path(cfg.run_dir)
    save_config(cfg, scratch / "config.yaml")
    log.info("evaluating %s (policy version %d) on %s; servers' scratch run directory %s", target.model,
             target.version, ", ".join(dict.fromkeys(s.name for s in suites)), scratch)
    sup = Supervisor()
    try:
        start_servers(cfg, sup, server_roles(cfg, scratch / "config.yaml", target),
                      {"openenv": cfg.task.openenv_servers_started})
        tokenizer = AutoTokenizer.from_pretrained(target.model)
        outcomes, version = asyncio.run(sample_suites(cfg, task, tokenizer, suites))
    except RoleFailed as err:
        raise SystemExit(f"pipelinerl eval: {err} (scratch run directory kept: {scratch})") from None
    finally:
        sup.stop_all()
    if version != target.version:
        raise RuntimeError(f"the eval servers report policy version {version}, expected {target.version}")
    return build_report(target, cfg, suites, outcomes, version)

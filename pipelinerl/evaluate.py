"""`pipelinerl eval CHECKPOINT_OR_RUN_DIR`: evaluate a checkpoint outside a run.

What is evaluated (resolve_target):
  - a run directory (it has config.yaml or checkpoints/): its latest complete checkpoint, or `--step K`;
    with no checkpoint yet, the run's initial model (model.path) at version 0, as `pipelinerl run` would
    serve it. The config is RUN_DIR/config.yaml unless `--config` names another.
  - an HF model folder (it has config.json): served at the version of the checkpoint it belongs to
    (../meta.json), else 0. The config is `--config`; without it, a checkpoint's weights folder
    (RUN_DIR/checkpoints/step_K/hf) takes its run's RUN_DIR/config.yaml, any other folder is an error.

How: the policy servers are started by the launcher's pieces (launch/commands.py's `serve` command line,
launch/procs.py's Supervisor, launch/local.py's wait_for_servers) with a scratch run directory of their own
(a fresh temporary folder: discovery files, auth token, logs) on free ports from inference.base_port, so a
live run on the same machine is never disturbed. The first actor.eval_samples held-out items of the task
are sampled through the actor's CompletionsClient, greedy (n = 1) and/or at --temperature with n =
--samples, and graded with task.reward / task.is_success. The JSON report (pass@k, mean length,
truncation rate, every item's outcomes; eval_metrics.py) is written atomically and printed as a table.
The scratch folder is deleted on success and kept (its path logged) when a server fails.

Eval sets: the task config has no named eval sets yet, so the only set is `default`, the task's held-out
split (task.eval_dataset_path, or task.eval_fraction of the data).
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

log = logging.getLogger(__name__)

DEFAULT_SET = "default"  # the task's held-out split


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


def _meta(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "meta.json").read_text())


def resolve_target(target: str | Path, step: int | None = None, config: str | Path | None = None,
                   overrides: list[str] | tuple[str, ...] = ()) -> Target:
    """What `pipelinerl eval TARGET [--step K] [--config C]` evaluates (see the module's docstring)."""
    from pipelinerl.trainer.checkpoints import checkpoint_path, complete_checkpoints, latest_checkpoint

    path = Path(target)
    if (path / "config.json").is_file():  # an HF model folder
        if step is not None:
            raise ConfigError(f"--step picks a checkpoint of a run directory; {path} is a model folder")
        run_dir = path.parent.parent.parent if path.parent.parent.name == "checkpoints" else None
        if config is None and (run_dir is None or not (run_dir / "config.yaml").is_file()):
            raise ConfigError(f"{path} is not a checkpoint of a run directory: give its config with --config")
        ckpt = path.parent if (path.parent / "meta.json").is_file() else None
        return Target(str(path), int(_meta(ckpt)["version"]) if ckpt else 0, _meta(ckpt)["step"] if ckpt else None,
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
    meta = _meta(ckpt)
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
    extra = [f"run_dir={scratch}"]
    if temperature is not None:
        extra.append(f"actor.sampling.temperature={temperature}")
    cfg = load_config(target.config, [*overrides, *extra])
    port = free_base_port(cfg.inference.base_port, cfg.inference.num_servers)
    return load_config(target.config, [*overrides, *extra, f"inference.base_port={port}"])


def server_roles(cfg: Config, config_path: Path, target: Target) -> list:
    """One Role per policy server of `cfg`, serving the target; on a GPU machine, server i takes GPUs
    i*tp .. (i+1)*tp - 1 of those visible (no trainer to share them with)."""
    from pipelinerl.launch.commands import policy_server, threads_env
    from pipelinerl.launch.local import machine_gpus
    from pipelinerl.launch.procs import Role

    gpus, tp = machine_gpus(), cfg.inference.tensor_parallel_size
    if gpus and len(gpus) < cfg.inference.num_servers * tp:
        raise ConfigError(f"{cfg.inference.num_servers} server(s) of tensor_parallel_size {tp} need "
                          f"{cfg.inference.num_servers * tp} GPUs; {len(gpus)} visible (set inference.num_servers)")
    roles = []
    for i in range(cfg.inference.num_servers):
        name, argv = policy_server(cfg, str(config_path), i, target.model, target.version)
        env = dict(threads_env(cfg))
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i * tp:(i + 1) * tp])
        roles.append(Role(name, argv, Path(cfg.run_dir) / "logs" / f"{name}.log", env))
    return roles


def grade(task, item, completions, max_new_tokens: int):
    """An ItemOutcome: each completion's task.reward and task.is_success."""
    from pipelinerl.eval_metrics import ItemOutcome

    rewards = [task.reward(item, c.text, c.finished, num_tokens=len(c.token_ids), max_new_tokens=max_new_tokens)
               for c in completions]
    return ItemOutcome(item.id, [c.text for c in completions], rewards, [task.is_success(r) for r in rewards],
                       [len(c.token_ids) for c in completions], [c.finished for c in completions])


async def sample_modes(cfg: Config, task, tokenizer, modes: dict[str, tuple[bool, int]]) -> tuple[dict, int]:
    """({mode: [ItemOutcome per eval item]}, the servers' policy version) for modes {name: (greedy, n)}."""
    import httpx

    from pipelinerl.actor.client import CompletionsClient

    items = task.eval_items[: cfg.actor.eval_samples]
    if not items:
        raise ConfigError("actor.eval_samples is 0: set it to the number of held-out items to evaluate")
    client = CompletionsClient(cfg.actor, cfg.run_dir, reference=False)
    gate = asyncio.Semaphore(cfg.actor.max_groups_in_flight)
    limits = httpx.Limits(max_connections=cfg.actor.max_groups_in_flight)

    async def one(http, item, greedy: bool, n: int):
        ids = item.token_ids(tokenizer)
        async with gate:
            completions = await client.complete(http, ids, greedy, n)
        # Off the event loop: a task's grading may block (the math task's worker pool).
        return await asyncio.to_thread(grade, task, item, completions, cfg.actor.sampling.max_new_tokens)

    async with httpx.AsyncClient(limits=limits) as http:
        version = await client.serving_version(http)
        out = {mode: await asyncio.gather(*(one(http, i, greedy, n) for i in items))
               for mode, (greedy, n) in modes.items()}
    return out, version


def build_report(target: Target, cfg: Config, outcomes: dict, version: int) -> dict:
    """The JSON report: where the weights came from and, per set and mode, the metrics and outcomes."""
    from pipelinerl.eval_metrics import mode_report

    temperatures = {"greedy": 0.0, "sampled": cfg.actor.sampling.temperature}
    return {"model": target.model, "policy_version": version, "step": target.step, "config": str(target.config),
            "task": cfg.task.name, "max_new_tokens": cfg.actor.sampling.max_new_tokens,
            "sets": {DEFAULT_SET: {mode: mode_report(items, temperatures[mode]) for mode, items in outcomes.items()}}}


def check_request(sets: list[str], samples: int, greedy: bool) -> dict[str, tuple[bool, int]]:
    """The modes asked for, {name: (greedy, n)}; a ValueError-like ConfigError for what cannot run."""
    unknown = [s for s in sets if s != DEFAULT_SET]
    if unknown:
        raise ConfigError(f"unknown eval set(s) {unknown}: the task config has no named eval sets yet; the one set "
                          f"is `{DEFAULT_SET}` (the task's held-out split)")
    if samples < 0:
        raise ConfigError(f"--samples must be >= 0 (0: no sampled evaluation); got {samples}")
    modes = ({"greedy": (True, 1)} if greedy else {}) | ({"sampled": (False, samples)} if samples else {})
    if not modes:
        raise ConfigError("nothing to evaluate: --no-greedy needs --samples N")
    return modes


def run_eval(target_arg: str, overrides: list[str], *, config: str | None = None, step: int | None = None,
             sets: list[str] = (DEFAULT_SET,), samples: int = 0, temperature: float | None = None,
             greedy: bool = True, out: str | None = None) -> dict:
    """Entry point of `pipelinerl eval`: serve the target, sample, grade, write and print the report."""
    from pipelinerl.atomic import write_file
    from pipelinerl.eval_metrics import format_table
    from pipelinerl.launch.local import wait_for_servers
    from pipelinerl.launch.procs import RoleFailed, Supervisor

    modes = check_request(list(sets), samples, greedy)
    target = resolve_target(target_arg, step, config, overrides)
    scratch = Path(tempfile.mkdtemp(prefix="pipelinerl-eval-"))
    cfg = eval_config(target, overrides, scratch, temperature)
    save_config(cfg, scratch / "config.yaml")
    log.info("evaluating %s (policy version %d); servers' scratch run directory %s", target.model, target.version,
             scratch)
    sup = Supervisor()
    try:
        for role in server_roles(cfg, scratch / "config.yaml", target):
            sup.start(role)
        urls = wait_for_servers(cfg, sup)
        log.info("servers healthy: %s", ", ".join(urls))
        report = _sample_and_report(cfg, target, modes)
    except RoleFailed as err:
        raise SystemExit(f"pipelinerl eval: {err} (scratch run directory kept: {scratch})") from None
    finally:
        sup.stop_all()
    shutil.rmtree(scratch, ignore_errors=True)
    path = Path(out) if out is not None else target.default_report()
    write_file(path, json.dumps(report, indent=1))
    print(format_table(report), flush=True)
    print(f"report: {path}", flush=True)
    return report


def _sample_and_report(cfg: Config, target: Target, modes: dict[str, tuple[bool, int]]) -> dict:
    from transformers import AutoTokenizer

    from pipelinerl.tasks import get_task

    task = get_task(cfg.task)
    try:
        outcomes, version = asyncio.run(sample_modes(cfg, task, AutoTokenizer.from_pretrained(target.model), modes))
    finally:
        task.close()
    if version != target.version:
        raise RuntimeError(f"the eval servers report policy version {version}, expected {target.version}")
    return build_report(target, cfg, outcomes, version)

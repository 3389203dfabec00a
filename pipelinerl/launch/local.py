"""`pipelinerl run CONFIG`: the whole pipeline as child processes of one launcher on this machine.

Order: run directory + resolved config -> (tiny model, built and warm-started if missing) -> inference servers, the
reference servers when the RL objective needs reference log-probs, the reward servers with reward.kind=model and
the eval servers (inference.eval_servers), the OpenEnv environment servers (task.openenv.serve: `openenv-serve`,
on the actor's cores), then at once the trainer (opens the weight-update groups) and, once the environment
servers have announced themselves, the actor: both find the vLLM servers as they announce themselves. Once the
servers are healthy the launcher follows the trainer's progress through the servers' policy version until the
trainer exits. Ctrl-C, SIGTERM or any child's failure stops
every role (newest first) and names the role that failed and its log, unless launch.max_restarts allows starting it
again (launch/restarts.py): a server restarts on its port, cores and environment (a policy or eval server from the
latest checkpoint), the trainer resumes from it by itself, the actor continues its stream. A server that stops
answering /health once announced counts as dead (launch.server_health_timeout_s, launch/health.py). Re-running with
the same run directory resumes: the servers start from the latest checkpoint's weights at its version, and the
trainer restores its state and stream cursor from the same checkpoint; reference servers always serve the initial
model (`model.path`), reward servers reward.model_path.

Placement (launch/placement.py): on a GPU machine the servers, eval servers included, take
launch.inference_gpus (tensor-parallel groups of contiguous GPUs) and the trainer ranks
launch.training_gpus, disjoint; by default the first half of the GPUs serve and the second half train.
The trainer role is `pipelinerl train --nproc N`: N ranks (trainer.num_gpus; gloo processes on CPU) that
receive every stop signal together.
On any machine, launch.inference_cpus / training_cpus / actor_cpus give the roles CPU cores of their own
(placement.split_cpus; applied as CPU affinity by procs.Supervisor, with vLLM's OMP binding and torch
thread counts to match); the eval servers share launch.eval_cpus, which may overlap any role's.
`pipelinerl run --dry-run` prints the placement and every command.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pipelinerl.config import Config, ConfigError, TaskConfig, save_config
from pipelinerl.launch.commands import (
    cli,
    discovery_file,
    frozen_server_counts,
    openenv_server,
    server_command,
    server_env,
    server_name,
    side_server_counts,
    threads_env,
)
from pipelinerl.launch.placement import CpuPlacement, Placement, eval_cores, format_ids, split_cpus, split_node
from pipelinerl.launch.procs import Role, RoleFailed, Supervisor
from pipelinerl.plan.memory import check_before_start
from pipelinerl.rundir import OPENENV_SERVERS_DIR, POLICY_KINDS, SERVER_FOLDERS, SERVERS_DIR, list_servers

log = logging.getLogger(__name__)

SERVING_DIR = "serving"  # RUN_DIR/serving/<pin>: the checkpoint a restarting server loads (serving_weights)
PIN_ATTEMPTS = 5


def prepare_run_dir(cfg: Config) -> Path:
    """Create the run directory, write the resolved config, and forget servers of an earlier launch."""
    run_dir = Path(cfg.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    for folder in SERVER_FOLDERS.values():
        for stale in (run_dir / folder).glob("*"):  # their processes are gone with the old launcher
            stale.unlink()
    save_config(cfg, run_dir / "config.yaml")
    return run_dir / "config.yaml"


def ensure_model(cfg: Config) -> None:
    """Build the tiny policy, teacher and reward models when the config asks for them and they are missing."""
    _ensure_policy_model(cfg)
    _ensure_teacher(cfg)
    _ensure_reward_model(cfg)


def _ensure_teacher(cfg: Config) -> None:
    """rl.teacher missing with model.build_tiny_if_missing: the tiny model warm-started to
    model.tiny.teacher_warm_start_target."""
    teacher = cfg.rl.teacher
    if teacher is None or (Path(teacher) / "config.json").is_file():
        return
    if not cfg.model.build_tiny_if_missing:
        raise ConfigError(f"config `rl.teacher`: {teacher} has no config.json; point it at an HF-format model with "
                          "the policy's tokenizer (or set model.build_tiny_if_missing=true for a tiny one)")
    from pipelinerl.tiny.warm_start import build_warm_tiny_model

    tiny = dataclasses.replace(cfg.model.tiny, warm_start_target=cfg.model.tiny.teacher_warm_start_target)
    log.info("building the tiny teacher in %s (warm start to %.2f on `%s`)...", teacher, tiny.warm_start_target,
             cfg.task.name)
    result = build_warm_tiny_model(teacher, tiny, cfg.task)
    log.info("teacher warm start: %d steps in %.0f s, held-out greedy success %.3f", result["steps"],
             result["seconds"], result["heldout_greedy"])


def _ensure_policy_model(cfg: Config) -> None:
    """Build and warm-start the tiny model when the config asks for it and it is missing."""
    model_dir = Path(cfg.model.path)
    if (model_dir / "config.json").is_file():
        return
    if not cfg.model.build_tiny_if_missing:
        raise ConfigError(f"config `model.path`: {model_dir} has no config.json; point it at an HF-format model "
                         "(or set model.build_tiny_if_missing=true for the tiny CPU model)")
    from pipelinerl.tiny.warm_start import build_warm_tiny_model

    task = cfg.task if cfg.model.tiny.warm_start_task is None else TaskConfig(name=cfg.model.tiny.warm_start_task,
                                                                              seed=cfg.task.seed)
    log.info("building the tiny model in %s and warm-starting it on `%s`...", model_dir, task.name)
    result = build_warm_tiny_model(model_dir, cfg.model.tiny, task)
    log.info("warm start: %d steps in %.0f s, held-out greedy success %.3f", result["steps"], result["seconds"],
             result["heldout_greedy"])


def _ensure_reward_model(cfg: Config) -> None:
    """Build and train the tiny reward model when reward.kind=model asks for it and it is missing."""
    r = cfg.reward
    if r.kind != "model" or (Path(r.model_path) / "config.json").is_file():
        return
    if not r.build_tiny_if_missing:
        raise ConfigError(f"config `reward.model_path`: {r.model_path} has no config.json; point it at an HF-format "
                          "sequence classifier (or set reward.build_tiny_if_missing=true for the tiny CPU one)")
    from pipelinerl.tiny.reward_model import build_tiny_reward_model

    log.info("building the tiny reward model of `%s` in %s...", cfg.task.name, r.model_path)
    report = build_tiny_reward_model(r.model_path, cfg.model.tiny, cfg.task, seed=cfg.seed)
    log.info("reward model: %d steps in %.0f s, held-out pairwise accuracy %.3f", report["steps"], report["seconds"],
             report["heldout_accuracy"])


def serving_weights(cfg: Config, pin: str | None = None) -> tuple[str, int]:
    """(HF folder, policy version) the servers start from: the latest checkpoint's, else the base model.

    With `pin` (a server starting while the trainer runs), the checkpoint's files are hard-linked (copied
    where links fail) into RUN_DIR/serving/<pin> and that folder is returned: checkpoints.keep_last may then
    delete the checkpoint while the server still loads it. A checkpoint rotated away before or while it is
    pinned gives way to the newest one, at most PIN_ATTEMPTS times; then RuntimeError."""
    from pipelinerl.trainer.checkpoints import latest_checkpoint

    root = Path(cfg.run_dir) / "checkpoints"
    for _ in range(PIN_ATTEMPTS):
        latest = latest_checkpoint(root)
        if latest is None:
            return cfg.model.path, 0
        try:
            version = _version(latest)
            if pin is None:
                return str(latest / "hf"), version
            pinned = _pinned(latest / "hf", Path(cfg.run_dir) / SERVING_DIR / pin)
        except (FileNotFoundError, shutil.Error):  # deleted before the lookup's files were read, or mid-copy
            log.info("checkpoint %s was deleted while a server pinned it; taking the newest again", latest.name)
            continue
        # Retention never deletes the newest checkpoint: if it still is, no file of it was gone before its
        # link was made (retention may have started on it before copytree listed it, leaving no error).
        if latest_checkpoint(root) == latest:
            return str(pinned), version
        log.info("checkpoint %s was superseded while a server pinned it; pinning the newest", latest.name)
    raise RuntimeError(f"no checkpoint of {root} stayed the newest long enough to pin it ({PIN_ATTEMPTS} tries); "
                       "a server restarted while checkpoints rotate faster than they can be linked or copied")


def _version(checkpoint: Path) -> int:
    import json

    return int(json.loads((checkpoint / "meta.json").read_text())["version"])


def _link_or_copy(src: str, dest: str) -> None:
    try:
        os.link(src, dest)
    except OSError:  # another filesystem, or one without hard links
        shutil.copy2(src, dest)


def _pinned(src: Path, dest: Path) -> Path:
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, copy_function=_link_or_copy)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def policy_restart(cfg: Config, config_path: str, i: int, where: str = "local",
                   kind: str = "policy") -> Callable[[], list[str]]:
    """Policy server i's (kind "eval": eval server i's) command at a restart (on host `where`): from the latest
    checkpoint then, at its version, pinned (serving_weights) under `<where>_<its role name>` (server<i>, eval<i>)."""
    pin = f"{where}_{server_name(kind, i)}"
    return lambda: server_command(cfg, config_path, kind, i, *serving_weights(cfg, pin=pin))[1]


def machine_gpus() -> list[str]:
    """The GPU ids this launcher may hand out: CUDA_VISIBLE_DEVICES if set, else every GPU nvidia-smi
    lists; [] on a CPU machine. (No torch import: the launcher stays light.)"""
    import subprocess

    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return [g for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False, timeout=60)
    if out.returncode != 0:
        return []
    return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]


def placement(cfg: Config, gpus: list[str], cores: list[int] | None = None) -> Placement:
    """This machine's split between the servers (policy, then reference, reward and eval) and the trainer ranks, in
    the ids of `gpus` (so a launcher started under CUDA_VISIBLE_DEVICES=2,3 hands out 2 and 3), and of the
    `cores` the launcher may use (default: its own CPU affinity) when launch.*_cpus ask for it. Every server takes
    a GPU slot; the eval servers take no share of launch.inference_cpus (launch.eval_cpus are theirs)."""
    launch, inf, tp, sides = cfg.launch, cfg.inference, cfg.inference.tensor_parallel_size, side_server_counts(cfg)
    machine = sorted(os.sched_getaffinity(0)) if cores is None else cores
    try:
        plan = split_node(len(gpus), launch.inference_gpus, launch.training_gpus,
                          inf.num_servers + sum(sides.values()), tp, cfg.trainer.num_gpus)
        cpus = split_cpus(machine, launch.inference_cpus, launch.training_cpus, launch.actor_cpus,
                          inf.num_servers + sum(frozen_server_counts(cfg).values()), tp)
        evals = eval_cores(machine, launch.eval_cpus, tp)
    except ValueError as err:
        raise ConfigError(f"config `launch`: {err}") from None
    if plan.server_gpus is None:
        return dataclasses.replace(plan, cpus=cpus, eval_cpus=evals)
    return Placement([[gpus[int(i)] for i in group] for group in plan.server_gpus],
                     [gpus[int(i)] for i in plan.trainer_gpus], plan.trainer_ranks, cpus, evals)


def _roles(cfg: Config, config_path: Path, where: Placement) -> tuple[list[Role], Role, Role]:
    """(servers: the policy servers, then any reference, reward and eval servers; trainer; actor)."""
    logs, cpus = Path(cfg.run_dir) / "logs", where.cpus or CpuPlacement([], [], None)
    model, version, path = *serving_weights(cfg), str(config_path)
    slots = [("policy", i) for i in range(cfg.inference.num_servers)]
    slots += [(kind, i) for kind, n in side_server_counts(cfg).items() for i in range(n)]
    server_roles = []
    for slot, (kind, i) in enumerate(slots):
        name, argv = server_command(cfg, path, kind, i, model, version)
        cores = where.eval_cpus if kind == "eval" else cpus.servers[slot] if cpus.servers else None
        env = server_env(cfg, cores)
        if where.server_gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(where.server_gpus[slot])
        restart_argv = policy_restart(cfg, path, i, kind=kind) if kind in POLICY_KINDS else None
        server_roles.append(Role(name, argv, logs / f"{name}.log", env, cores, restart_argv=restart_argv,
                                 discovery=discovery_file(cfg, i, kind)))
    ranks = ["--nproc", str(where.trainer_ranks)]  # its port is picked when the ranks start, not minutes before
    if where.trainer_gpus is not None:
        ranks += ["--gpus", ",".join(where.trainer_gpus)]
    trainer_cores = cpus.trainer or None
    trainer = Role("trainer", [*cli(), "train", str(config_path), *ranks], logs / "trainer.log",
                   threads_env(cfg, trainer_cores and max(1, len(trainer_cores) // where.trainer_ranks)), trainer_cores)
    actor = Role("actor", [*cli(), "actor", str(config_path)], logs / "actor.log",
                 threads_env(cfg, cpus.actor and len(cpus.actor)), cpus.actor)
    return server_roles, trainer, actor


def openenv_roles(cfg: Config, config_path: Path, cores: list[int] | None = None) -> list[Role]:
    """The OpenEnv environment servers (task.openenv.serve; none without it) on `cores` (`pipelinerl run`: the
    actor's, whose episodes they answer; None: not pinned). Restarted on their ports with the same command."""
    roles = []
    for i in range(cfg.task.openenv_servers_started):
        name, argv = openenv_server(cfg, str(config_path), i)
        roles.append(Role(name, argv, Path(cfg.run_dir) / "logs" / f"{name}.log",
                          threads_env(cfg, cores and len(cores)), cores, discovery=discovery_file(cfg, i, "openenv")))
    return roles


def render(cfg: Config, config_path: Path, gpus: list[str]) -> str:
    """The placement and each role's command, as `pipelinerl run --dry-run` prints them."""
    import shlex

    where = placement(cfg, gpus)
    servers, trainer, actor = _roles(cfg, config_path, where)
    lines = [f"# GPUs on this machine: {','.join(gpus) or 'none (CPU)'}",
             *(f"# {line}" for line in where.describe([role.name for role in servers]))]
    lines += [f"# {line}" for line in where.cpus.describe()] if where.cpus else []
    for role in (*servers, *openenv_roles(cfg, config_path, where.cpus and where.cpus.actor), trainer, actor):
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in role.env.items())
        pin = f"taskset -c {format_ids(role.cpus)} " if role.cpus else ""  # what the launcher's affinity does
        lines.append(f"# {role.name} (log {role.log_path})\n{env + ' ' if env else ''}{pin}{shlex.join(role.argv)}")
    return "\n".join(lines)


def wait_for_servers(cfg: Config, sup: Supervisor, expected: int | None = None,
                     folder: str = SERVERS_DIR) -> list[str]:
    """Wait until `expected` servers (default inference.num_servers) announce themselves in RUN_DIR/<folder>
    (the policy servers', or another kind's: rundir.SERVER_FOLDERS)."""
    expected = cfg.inference.num_servers if expected is None else expected
    deadline = time.monotonic() + cfg.inference.startup_timeout_s
    while len(urls := list_servers(cfg.run_dir, folder)) < expected:
        sup.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{expected - len(urls)} server(s) of RUN_DIR/{folder} not healthy after "
                               f"{cfg.inference.startup_timeout_s:.0f} s; see the server logs in {cfg.run_dir}/logs/")
        time.sleep(0.5)
    return urls


def start_servers(cfg: Config, sup: Supervisor, roles: list[Role], side: dict[str, int] | None = None,
                  policy: int | None = None) -> list[str]:
    """Start the server `roles` under `sup`, then wait until `policy` policy servers (default
    inference.num_servers) and `side[kind]` servers of each other kind (reference, reward, eval:
    commands.side_server_counts) have announced themselves: the policy servers' URLs. Every launcher starts its
    servers with it: `pipelinerl run`, the Slurm job (its servers steps) and `pipelinerl eval`."""
    for role in roles:
        sup.start(role)
    return await_servers(cfg, sup, side, policy)


def await_servers(cfg: Config, sup: Supervisor, side: dict[str, int] | None = None,
                  policy: int | None = None) -> list[str]:
    """start_servers' wait, for servers already started: the policy servers' URLs."""
    urls = wait_for_servers(cfg, sup, policy)
    log.info("servers healthy: %s", ", ".join(urls))
    for kind, n in (side or {}).items():
        if n:
            log.info("%s servers healthy: %s", kind, ", ".join(wait_for_servers(cfg, sup, n, SERVER_FOLDERS[kind])))
    return urls


def follow_trainer(cfg: Config, sup: Supervisor, urls: list[str]) -> None:
    """A progress bar over optimizer steps (the servers' policy version) until the trainer exits 0; a role
    that dies meanwhile is restarted by `sup.check` within launch.max_restarts, the trainer too."""
    import httpx
    from tqdm import tqdm

    start_version, t0 = None, time.monotonic()
    bar = tqdm(total=cfg.trainer.max_steps, desc="optimizer steps", unit="step",
               disable=not cfg.logging.progress_bar, dynamic_ncols=True)
    with bar, httpx.Client(timeout=5.0) as http:
        while sup.returncode("trainer") != 0:
            sup.check(allow_finished={"trainer"})
            try:
                version = int(http.get(f"{urls[0]}/status").json()["version"])
            except (httpx.HTTPError, KeyError, ValueError):
                version = bar.n
            start_version = version if start_version is None else start_version
            elapsed = time.monotonic() - t0
            rate = (version - start_version) * cfg.trainer.samples_per_step / elapsed if elapsed > 0 else 0.0
            bar.update(version - bar.n)
            bar.set_postfix(samples_per_s=f"{rate:.0f}", refresh=False)
            time.sleep(1.0)


def report_success(cfg: Config) -> None:
    """Held-out greedy success of the starting model and of the last checkpoint (transformers)."""
    from pipelinerl.tasks import get_task
    from pipelinerl.tiny.warm_start import heldout_greedy

    final, version = serving_weights(cfg)
    task = get_task(cfg.task)
    try:
        before, after = heldout_greedy(cfg.model.path, task), heldout_greedy(final, task)
    finally:
        task.close()
    print(f"held-out greedy success: {before:.3f} before RL -> {after:.3f} after {version} optimizer steps "
          f"({100 * (after - before):+.1f} points)", flush=True)


def run_local(cfg: Config, dry_run: bool = False) -> None:
    """Entry point of `pipelinerl run`."""
    if dry_run:
        print(render(cfg, Path(cfg.run_dir) / "config.yaml", machine_gpus()))
        return
    config_path = prepare_run_dir(cfg)
    ensure_model(cfg)
    where = placement(cfg, machine_gpus())
    check_before_start(cfg, where.trainer_ranks)  # every role's GPU memory; on CPU one line saying it was skipped
    if cfg.trainer.max_steps is not None and serving_weights(cfg)[1] >= cfg.trainer.max_steps:
        log.warning("%s already holds a checkpoint at trainer.max_steps=%s: nothing to train (raise "
                    "trainer.max_steps to continue, or pick another run_dir)", cfg.run_dir, cfg.trainer.max_steps)
    else:
        _run_roles(cfg, config_path, where)
    from pipelinerl.tasks import task_class

    if task_class(cfg.task.name).reports_greedy_success:
        report_success(cfg)


def _run_roles(cfg: Config, config_path: Path, where: Placement) -> None:
    servers, trainer, actor = _roles(cfg, config_path, where)
    envs = openenv_roles(cfg, config_path, where.cpus and where.cpus.actor)
    sup = Supervisor.from_config(cfg)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the finally below
    try:
        # The trainer and the actor start with the servers, not after them: each finds the servers as they
        # announce themselves (RUN_DIR/servers), so their start-up (imports, the trainer's model and optimizer)
        # overlaps the servers'. Safe on a GPU node too: servers and trainer ranks have disjoint GPUs. The actor
        # waits for the environment servers (seconds): an episode waits only task.openenv.connect_timeout_s for one.
        for role in (*servers, *envs, trainer):
            sup.start(role)
        if envs:
            log.info("OpenEnv servers healthy: %s",
                     ", ".join(wait_for_servers(cfg, sup, len(envs), OPENENV_SERVERS_DIR)))
        sup.start(actor)
        urls = await_servers(cfg, sup, side_server_counts(cfg))
        follow_trainer(cfg, sup, urls)
    except RoleFailed as err:
        log.error("%s", err)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        log.warning("interrupted; stopping every role")
        raise SystemExit(130) from None
    finally:
        sup.stop_all()

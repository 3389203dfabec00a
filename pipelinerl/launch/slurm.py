"""The pipeline on a Slurm allocation: `slurm/run_*.sh` (sbatch) and submitit both end up in `launch`.

Placement: inference nodes run the vLLM servers (`pipelinerl serve`, one per GPU or per
tensor-parallel group, started by one `servers` agent per node); training nodes run the DeepSpeed
trainer (one srun task per rank, one rank per GPU) and, on the first of them, the actor. Three shapes:

  het        `sbatch slurm/run_*.sh`: a heterogeneous job, component 0 = inference nodes, component 1 =
             training nodes; every srun names its `--het-group` (and, as in split, its `--nodelist`).
  split      submitit, which cannot submit het jobs, and job arrays, which Slurm cannot make of het jobs:
             one homogeneous allocation of inference_nodes + training_nodes; the first inference_nodes
             hosts serve, the others train; every srun names its `--nodelist`.
  colocated  launch.slurm.inference_nodes = 0 (`slurm/run_7b_one_node.sh`): one homogeneous allocation of
             training_nodes, each node split between its servers (launch.inference_gpus) and its trainer
             ranks (launch.training_gpus); all three steps ask for every GPU of the node and `--overlap`,
             and each server / rank selects its own through CUDA_VISIBLE_DEVICES (slurm_node.node_placement).

Reference servers (only when the RL objective needs reference log-probs: rl.kl_coef > 0 or
rl.dpo_reference=reference), then reward servers (reward.kind=model), then eval servers
(inference.eval_servers) take the first server slots of the first inference node: slot i there runs
`serve --reference` (the initial model), `serve --reward` (reward.model_path) or `serve --eval` (the policy,
updated over the eval weight group), on the slot's GPUs and its kind's port (commands.py), instead of a policy
server, which leaves (inference_nodes x num_servers) minus those policy servers. `check_config` refuses a
placement that does not fit on the first node or leaves no policy server. With task.openenv.serve, every server
node also runs task.openenv.servers OpenEnv environment servers (no GPU), started by its agent.

`launch` runs in the batch step. It prepares the run directory, starts one srun per role under a procs.Supervisor
(a `servers@NODE` step per server node, `trainer`, `actor`), waits for the servers through RUN_DIR/servers (and
each other kind's folder), starts trainer and actor, and waits for the trainer. A step that dies is run again
while launch.max_restarts allows (launch/restarts.py): the trainer resumes from the latest checkpoint, the actor
continues its stream, and a node's servers step runs again on that node from the latest checkpoint then, at its
version, its servers' old discovery files removed first (the other nodes' servers keep serving). A server that
dies inside a step is restarted by its node's agent (slurm_node.py) within the same budget.
Requeue: Slurm's `--signal=B:USR1@N` reaches this process (the batch script execs
it); it forwards SIGUSR1 to the trainer step (srun -> every rank), the trainer checkpoints
after its current step and exits, the other roles stop, and the job runs `scontrol requeue` on itself.
The requeued job runs the same command and resumes: servers from the checkpoint's weights at its
version, trainer from its state and stream cursors, actor from the end of its stream.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipelinerl.config import Config
from pipelinerl.launch.commands import (
    cli,
    node_slots,
    openenv_server,
    server_port,
    side_server_counts,
    side_server_kinds,
    slot_names,
    threads_env,
)
from pipelinerl.launch.local import ensure_model, prepare_run_dir, serving_weights, start_servers
from pipelinerl.launch.procs import DiscoveryFiles, Role, RoleFailed, Supervisor
from pipelinerl.launch.restarts import Restarts
from pipelinerl.launch.slurm_node import colocated, node_placement
from pipelinerl.launch.summary import summarize, summary_line
from pipelinerl.netif import interface_env
from pipelinerl.plan.memory import check_before_start
from pipelinerl.rundir import ADVERTISE_ENV, SERVER_FOLDERS, WILDCARDS, StatusFile, bind_host, server_file

log = logging.getLogger(__name__)

TRAINER_RANK_LOG = "trainer_rank%t.log"  # srun --output pattern, in RUN_DIR/logs: trainer_rank0.log, ...
REQUEUE_WAIT_S = 120.0  # after `scontrol requeue`, Slurm ends this job; longer means the requeue failed


@dataclass(frozen=True)
class Allocation:
    """The hosts of one job, split by role."""

    inference: list[str]  # vLLM server hosts
    training: list[str]  # trainer hosts; the actor and trainer rank 0 run on training[0]
    master_addr: str  # training[0]'s address (its NodeAddr: Slurm node names need not resolve)
    het: bool  # a heterogeneous job (srun --het-group) or one split allocation (srun --nodelist)
    job_id: str  # what scancel and `scontrol requeue` take: the het leader's id, or ARRAYID_TASK for an
    #              array task (its bare SLURM_JOB_ID may be the array's own id, which names every task)
    unique_id: int  # SLURM_JOB_ID: distinct for every job and array task (derives default ports)
    addresses: dict[str, str] = field(default_factory=dict)  # server node -> its NodeAddr: what its servers
    #              advertise, and name their discovery files by, when bound to every interface (missing: the
    #              node name itself). Not its hostname: a node may call itself by a fully qualified name that
    #              Slurm's NodeHostName and the launcher do not use.


QUERY_ATTEMPTS = 4  # tries of a read-only Slurm query that failed to reach the controller (1, 2, 4 s apart)
_UNREACHED = ("Unable to contact slurm controller", "Socket timed out", "Zero Bytes were transmitted",
              "Connection reset", "Connection refused")  # a query that never got its answer


def slurm_command(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """A Slurm client command; the caller judges its exit code.

    A read-only query (squeue, sacct, sinfo, scontrol show) that did not reach the controller is asked
    again: the clients do not ignore SIGPIPE, so one whose controller or munged drops the connection
    mid-request dies of it (seen under load), and a busy controller times out. Commands that act
    (scancel, requeue) run once: a retry could act twice."""
    query = argv[0] in ("squeue", "sacct", "sinfo") or argv[:2] == ("scontrol", "show")
    attempts = QUERY_ATTEMPTS if query else 1
    for attempt in range(1, attempts + 1):
        out = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60, env=env)
        unreached = out.returncode < 0 or (out.returncode > 0 and any(s in out.stderr for s in _UNREACHED))
        if not unreached or attempt == attempts:
            return out
        log.warning("`%s` did not reach Slurm (%s); asking again", " ".join(argv),
                    f"signal {-out.returncode}" if out.returncode < 0 else out.stderr.strip())
        time.sleep(2 ** (attempt - 1))


def hostnames(nodelist: str) -> list[str]:
    """Expand a Slurm node list (`n[1-3]`) the way Slurm does."""
    out = slurm_command("scontrol", "show", "hostnames", nodelist)
    if out.returncode != 0:
        raise RuntimeError(f"`scontrol show hostnames {nodelist}` failed: {out.stderr.strip()}")
    return out.stdout.split()


def node_field(node: str, name: str) -> str:
    """One field of `scontrol show node NODE` (NodeAddr, NodeHostName, ...)."""
    out = slurm_command("scontrol", "show", "node", node, "-o")
    found = re.search(rf"\b{name}=(\S+)", out.stdout)
    if out.returncode != 0 or not found:
        raise RuntimeError(f"`scontrol show node {node}` gave no {name}: {out.stderr.strip()}")
    return found.group(1)


def node_address(node: str) -> str:
    """The address Slurm itself reaches a node at (NodeAddr; the node name where they agree)."""
    return node_field(node, "NodeAddr")


def allocation_from_env(cfg: Config, env=os.environ) -> Allocation:
    """This job's hosts; their numbers must match launch.slurm.inference_nodes / training_nodes."""
    s = cfg.launch.slurm
    if "SLURM_JOB_ID" not in env:
        raise ValueError("not inside a Slurm job: submit with `sbatch slurm/run_*.sh` (or look with --dry-run)")
    het = "SLURM_JOB_NODELIST_HET_GROUP_1" in env
    if het:
        inference, training = (hostnames(env[f"SLURM_JOB_NODELIST_HET_GROUP_{k}"]) for k in (0, 1))
    else:
        hosts = hostnames(env["SLURM_JOB_NODELIST"])
        inference, training = hosts[:s.inference_nodes], hosts[s.inference_nodes:]
    for role, hosts, want in (("inference", inference, s.inference_nodes), ("training", training, s.training_nodes)):
        if len(hosts) != want:
            raise ValueError(f"the job has {len(hosts)} {role} node(s) but launch.slurm.{role}_nodes={want}: "
                             "make the #SBATCH --nodes lines (or sbatch options) and the config agree")
    if colocated(cfg):
        inference = training  # every node serves and trains
    job_id = env["SLURM_JOB_ID"]
    if "SLURM_ARRAY_TASK_ID" in env:
        job_id = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    addresses = {node: node_address(node) for node in inference}
    return Allocation(inference, training, node_address(training[0]), het, job_id, int(env["SLURM_JOB_ID"]),
                      addresses)


def check_config(cfg: Config) -> None:
    """Config choices only the Slurm launcher can check: trainer ranks vs training GPUs, reference, reward and eval
    server placement."""
    inf, ranks = cfg.inference, trainer_ranks(cfg)
    if cfg.trainer.num_gpus is not None and cfg.trainer.num_gpus != ranks:
        per_node = "launch.training_gpus" if colocated(cfg) else "gpus_per_node"
        raise ValueError(f"trainer.num_gpus={cfg.trainer.num_gpus} but launch.slurm.training_nodes x {per_node} "
                         f"gives {ranks} trainer ranks; set trainer.num_gpus={ranks} (or null)")
    side, slots = side_server_kinds(cfg), inf.num_servers * server_nodes(cfg)
    if len(side) > inf.num_servers:
        raise ValueError(f"{len(side)} reference, reward and eval servers ({', '.join(side)}) but they take server "
                         f"slots of the first inference node, which has inference.num_servers={inf.num_servers}; "
                         "lower inference.reference_servers / reward.servers / inference.eval_servers or raise "
                         "num_servers")
    if side and len(side) >= slots:
        raise ValueError(f"{len(side)} reference, reward and eval servers would take all {slots} server slots "
                         "(launch.slurm.inference_nodes x inference.num_servers) and leave no policy server; "
                         "raise inference.num_servers or add an inference node")


def bound_for_slurm(cfg: Config, alloc: Allocation) -> Config:
    """The config the job's roles run: servers bind to every interface unless inference.host says otherwise
    (the actor and trainer reach them from other nodes). A loopback inference.host is refused when a server
    node is not the first training node's host (its NodeAddr differs)."""
    host = cfg.inference.host
    if host is None:
        return dataclasses.replace(cfg, inference=dataclasses.replace(cfg.inference, host="0.0.0.0"))
    remote = sorted(node for node in alloc.inference if alloc.addresses.get(node, node) != alloc.master_addr)
    if ipaddress_is_loopback(host) and remote:
        raise ValueError(f"inference.host={host} is a loopback address, but the servers on {', '.join(remote)} are "
                         f"reached from {alloc.training[0]}: set inference.host=0.0.0.0 (or null)")
    return cfg


def ipaddress_is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def trainer_ranks(cfg: Config) -> int:
    """The job's trainer ranks: launch.slurm.training_nodes x each node's (slurm_node.node_placement)."""
    return cfg.launch.slurm.training_nodes * node_placement(cfg).trainer_ranks


def server_nodes(cfg: Config) -> int:
    """Nodes that run servers: the inference nodes, or every node when colocated."""
    s = cfg.launch.slurm
    return s.training_nodes if colocated(cfg) else s.inference_nodes


def dry_run_allocation(cfg: Config) -> Allocation:
    """Placeholder hosts for --dry-run, shaped like the config asks."""
    s = cfg.launch.slurm
    if colocated(cfg):
        nodes = [f"node{i}" for i in range(s.training_nodes)]
        return Allocation(nodes, nodes, nodes[0], False, "JOBID", 0)
    training = [f"training{i}" for i in range(s.training_nodes)]
    return Allocation([f"inference{i}" for i in range(s.inference_nodes)], training, training[0], True, "JOBID", 0)


def master_port(cfg: Config, alloc: Allocation) -> int:
    """The trainer's MASTER_PORT on the first training host: configured, else derived from the job id so that
    jobs sharing a host (array tasks, the one-host test cluster) do not collide."""
    if cfg.launch.slurm.master_port is not None:
        return cfg.launch.slurm.master_port
    return 20000 + alloc.unique_id % 10000


def _srun(alloc: Allocation, component: int, hosts: list[str], cfg: Config, gpus: bool,
          tasks_per_node: int = 1) -> list[str]:
    s = cfg.launch.slurm
    where = [f"--het-group={component}"] if alloc.het else []
    # Explicit counts: srun would otherwise take the batch step's SLURM_NTASKS / SLURM_NNODES.
    argv = ["srun", *where, f"--nodes={len(hosts)}", f"--nodelist={','.join(hosts)}",
            f"--ntasks={len(hosts) * tasks_per_node}", f"--ntasks-per-node={tasks_per_node}", "--kill-on-bad-exit=1"]
    if gpus and s.gpus_per_node is not None:
        argv.append(f"--gpus-per-node={s.gpus_per_node}")
    if s.cpus_per_task is not None:
        argv.append(f"--cpus-per-task={s.cpus_per_task}")
    return argv


def drain_seconds(cfg: Config) -> int:
    """How long the trainer may take to checkpoint after the signal: the warning period less the time
    to stop the other roles and requeue."""
    return max(10, cfg.launch.slurm.signal_seconds - 30)


def plan_roles(cfg: Config, alloc: Allocation, config_path: Path, python: str = sys.executable) -> dict[str, Role]:
    """One srun per role: `servers@NODE` for each server node (component 0), `trainer` and `actor`
    (component 1).

    The trainer is one srun task per rank (per GPU), not torchrun per node: Slurm then delivers USR1 to
    every rank itself. torchrun 2.13 dies of SIGUSR1 at once (seen: exit 138 with
    TORCHELASTIC_SIGNALS_TO_HANDLE set; it catches only SIGTERM), and the step would end with it,
    killing ranks in the middle of their checkpoint."""
    logs, pipelinerl, threads = Path(cfg.run_dir) / "logs", cli(python), threads_env(cfg)
    servers = [servers_role(cfg, alloc, node, config_path, python) for node in alloc.inference]
    placement = node_placement(cfg)
    # One log per rank (%t: the task's rank), appended across requeues; trainer.log keeps srun's own lines.
    trainer = _srun(alloc, 1, alloc.training, cfg, gpus=True, tasks_per_node=placement.trainer_ranks) + [
        f"--output={logs / TRAINER_RANK_LOG}", "--open-mode=append", "--overlap", "bash", "-c",
        rank_command(cfg, placement.trainer_gpus, [*pipelinerl, "train", str(config_path)])]
    threads = {**threads, **interface_env(cfg.launch.network_interface)}
    trainer_env = {**threads, "MASTER_ADDR": alloc.master_addr, "MASTER_PORT": str(master_port(cfg, alloc))}
    actor = _srun(alloc, 1, alloc.training[:1], cfg, gpus=False) + ["--overlap"] + pipelinerl + [
        "actor", str(config_path)]
    return {**{role.name: role for role in servers},
            "trainer": Role("trainer", trainer, logs / "trainer.log", trainer_env),
            "actor": Role("actor", actor, logs / "actor.log", threads)}


def servers_role(cfg: Config, alloc: Allocation, node: str, config_path: Path, python: str) -> Role:
    """The servers step of one node: its agent (`pipelinerl slurm servers`, slurm_node.py) serving the
    latest checkpoint at its version, computed again when the step is run again after it died (the
    agents of the other nodes keep serving meanwhile), then pinned: the trainer runs and may rotate it away."""
    name = f"servers@{node}"

    def argv(pin: str | None = None) -> list[str]:
        model, version = serving_weights(cfg, pin=pin)
        # Colocated, the trainer's step holds the node too: a servers step run again must overlap it.
        overlap = ["--overlap"] if colocated(cfg) else []
        command = _srun(alloc, 0, [node], cfg, gpus=True) + overlap + cli(python) + [
            "slurm", "servers", str(config_path), "--model", model, "--version", str(version)]
        return command + (["--side-node", alloc.inference[0]] if side_server_kinds(cfg) else [])

    env = {**threads_env(cfg), **interface_env(cfg.launch.network_interface),
           ADVERTISE_ENV: alloc.addresses.get(node, node)}
    return Role(name, argv(), Path(cfg.run_dir) / "logs" / f"{name}.log", env,
                restart_argv=lambda: argv(pin=name), discovery=node_discovery_files(cfg, alloc, node))


def node_discovery_files(cfg: Config, alloc: Allocation, node: str) -> DiscoveryFiles:
    """Where the servers of `node` announce themselves (commands.discovery_file, as seen from that node):
    reference, reward and eval servers in the first slots of the first server node, policy servers in the others,
    then the node's OpenEnv environment servers."""
    bind = bind_host(cfg.inference.host)
    host = alloc.addresses.get(node, node) if bind in WILDCARDS else bind
    servers = node_slots(cfg, node == alloc.inference[0])
    servers += [("openenv", index) for index in range(cfg.task.openenv_servers_started)]
    files = [server_file(cfg.run_dir, host, server_port(cfg, index, kind), SERVER_FOLDERS[kind])
             for kind, index in servers]
    return DiscoveryFiles(tuple(files))


def rank_command(cfg: Config, trainer_gpus: list[str] | None, train: list[str]) -> str:
    """The shell command of one trainer task. Rank, world size and local rank differ per task: each reads
    them from its Slurm variables. On a colocated node the ranks also select their GPUs (positions in
    the step's CUDA_VISIBLE_DEVICES, like slurm_node.visible_gpus); elsewhere they take the step's all."""
    ranks = 'RANK="$SLURM_PROCID" WORLD_SIZE="$SLURM_NTASKS" LOCAL_RANK="$SLURM_LOCALID"'
    if trainer_gpus is None or not colocated(cfg):
        return f"{ranks} exec {shlex.join(train)}"
    every = ",".join(str(i) for i in range(cfg.launch.slurm.gpus_per_node))
    picked = ",".join(f"${{gpus[{i}]}}" for i in trainer_gpus)
    return (f'IFS=, read -r -a gpus <<<"${{CUDA_VISIBLE_DEVICES:-{every}}}"; '
            f'CUDA_VISIBLE_DEVICES="{picked}" {ranks} exec {shlex.join(train)}')


def render(cfg: Config, alloc: Allocation) -> str:
    """The srun lines `launch` would run, one per role, as shell (what --dry-run prints), after where each
    node's servers and trainer ranks run (and the command of each OpenEnv server a node's agent runs)."""
    cfg = bound_for_slurm(cfg, alloc)
    config_path = Path(cfg.run_dir) / "config.yaml"
    roles = plan_roles(cfg, alloc, config_path)
    envs = [openenv_server(cfg, str(config_path), i) for i in range(cfg.task.openenv_servers_started)]
    lines = [f"# inference nodes: {' '.join(alloc.inference)}; training nodes: {' '.join(alloc.training)}",
             "# on each node of its role (GPU positions in the step's CUDA_VISIBLE_DEVICES; the first inference "
             "node's slots shown):",
             *(f"#   {line}" for line in node_placement(cfg).describe(slot_names(cfg, side=True))),
             *(f"#   {name}: on each server node, no GPU slot: {shlex.join(argv)}" for name, argv in envs)]
    for role in roles.values():
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in role.env.items())
        lines.append(f"# {role.name} (log {role.log_path})\n{env + ' ' if env else ''}{shlex.join(role.argv)}")
    return "\n".join(lines)


class _Signals:
    """USR1 (Slurm's warning before the time limit) asks for checkpoint + requeue; TERM stops the job."""

    def __init__(self) -> None:
        self.usr1 = False
        signal.signal(signal.SIGUSR1, self._usr1)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through launch's finally

    def _usr1(self, signum, frame) -> None:
        self.usr1 = True


def _follow_trainer(cfg: Config, sup: Supervisor, signals: _Signals) -> bool:
    """Wait for the trainer; True when it stopped for a requeue (USR1), False when it finished (exit 0). A
    step that dies meanwhile is run again by `sup.check` within launch.max_restarts, the trainer's too."""
    forwarded_at = None
    while sup.returncode("trainer") != 0:
        if signals.usr1 and forwarded_at is None:
            log.info("USR1: asking the trainer to checkpoint (up to %d s)", drain_seconds(cfg))
            sup.running["trainer"][1].send_signal(signal.SIGUSR1)  # srun forwards it to every rank
            forwarded_at = time.monotonic()
        if forwarded_at is not None and sup.finished("trainer"):
            return True  # whatever its exit code: it resumes from its last complete checkpoint
        if forwarded_at is not None and time.monotonic() - forwarded_at > drain_seconds(cfg):
            log.warning("the trainer did not exit within %d s of USR1; requeueing anyway (it resumes from "
                        "its last complete checkpoint)", drain_seconds(cfg))
            return True
        sup.check(allow_finished={"trainer"})
        time.sleep(0.5)
    return signals.usr1


def requeue(job_id: str) -> None:
    """Put this job back in the queue; Slurm then ends the running instance (this process included)."""
    out = slurm_command("scontrol", "requeue", job_id)
    if out.returncode != 0:
        raise RuntimeError(f"`scontrol requeue {job_id}` failed: {out.stderr.strip()} (submitted with --no-requeue?)")
    time.sleep(REQUEUE_WAIT_S)
    raise RuntimeError(f"job {job_id} was requeued but still runs after {REQUEUE_WAIT_S:.0f} s")


def stop_steps(job_id: str, sup: Supervisor, grace_s: float = 30.0) -> None:
    """Stop the roles gracefully: SIGTERM to the tasks of every step of the job (scancel signals steps,
    not the batch shell), then Supervisor.stop_all for whatever outlives `grace_s`. SIGTERM to srun
    itself would not do: srun answers it with SIGKILL to its tasks, and a vLLM server killed that way
    leaves its shared memory behind."""
    if any(not sup.finished(name) for name in sup.running):
        slurm_command("scancel", "--signal=TERM", job_id)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(not sup.finished(name) for name in sup.running):
            time.sleep(0.5)
    sup.stop_all()


def launch(cfg: Config, alloc: Allocation) -> None:
    """Run the pipeline on this allocation until the trainer finishes, or checkpoint and requeue."""
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    log.info("job %s (restart %s): inference on %s, training on %s", alloc.job_id, restarts,
             ",".join(alloc.inference), ",".join(alloc.training))
    cfg = bound_for_slurm(cfg, alloc)
    config_path = prepare_run_dir(cfg)
    ensure_model(cfg)
    check_before_start(cfg, trainer_ranks(cfg))  # every role's GPU memory, before any srun
    roles = plan_roles(cfg, alloc, config_path)
    # The job's steps (servers@NODE, trainer, actors); each node's agent watches and reports its own servers
    sup = Supervisor(Restarts.from_config(cfg), status=StatusFile(cfg.run_dir, "launch"))
    signals, requeue_now = _Signals(), False
    try:
        steps = [role for role in roles.values() if role.name.startswith("servers@")]
        side = {**side_server_counts(cfg), "openenv": cfg.task.openenv_servers_started * server_nodes(cfg)}
        policy = cfg.inference.num_servers * server_nodes(cfg) - len(side_server_kinds(cfg))
        start_servers(cfg, sup, steps, side, policy)
        sup.start(roles["trainer"])
        sup.start(roles["actor"])
        requeue_now = _follow_trainer(cfg, sup, signals)
    except RoleFailed as err:
        log.error("%s", err)
        raise SystemExit(1) from None
    finally:
        stop_steps(alloc.job_id, sup)
        if requeue_now:
            log.info("checkpointed; requeueing job %s", alloc.job_id)
        _print_summary(cfg)
    if requeue_now:
        requeue(alloc.job_id)


def _print_summary(cfg: Config) -> None:
    """The batch log's last line, however the run ended (a requeued job's log gets one per start)."""
    try:
        print(summary_line(summarize(cfg.run_dir)), flush=True)
    except Exception as err:  # noqa: BLE001 - a summary must not hide why the job ended
        log.warning("no run summary: %s", err)

"""Child processes of a launcher: start with a log file each, watch, and shut down in order.

Each role runs in its own process group (vLLM and DeepSpeed spawn grandchildren), so stopping a role
signals the whole group. Children also get PR_SET_PDEATHSIG: if the launcher itself is killed with
SIGKILL, the kernel sends them SIGTERM and nothing is orphaned. A role with CPU cores gets them as its CPU
affinity before it execs, so every thread and process it starts inherits them. With a restart policy
(launch/restarts.py) a role that died is started again in its place: same name, log, environment and
cores, its command recomputed by `restart_argv` (a server: from the latest checkpoint). With a health watch
(launch/health.py) an announced server that stopped answering is SIGKILLed and then dies the same way. With a
status file (rundir.StatusFile) every check rewrites the roles' state there: each role's pid, state (running,
starting: a server not announced yet; exited N; stopped), restarts and log, and a server's URL, kind, health
and /status: what `pipelinerl status` shows.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipelinerl.config import Config
    from pipelinerl.launch.health import HealthWatch
    from pipelinerl.launch.restarts import Restarts
    from pipelinerl.rundir import StatusFile

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
try:  # resolved here, in the parent: the child between fork and exec must not load libraries
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except OSError:  # not Linux: process groups still let the launcher stop the children it outlives
    _prctl = None


def die_with_parent() -> None:
    """Runs in the child between fork and exec: only two system calls, no locks, no imports."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _child_setup(cpus: list[int] | None):
    """The preexec_fn of a role: die_with_parent, then (if given) its cores, a system call as well. Set here,
    not on the pid after the start, where threads and children started meanwhile would keep the old mask."""
    def setup() -> None:
        die_with_parent()
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
    return setup


@dataclass(frozen=True)
class DiscoveryFiles:
    """The discovery files of a role that runs several servers (a Slurm node's servers step), used like one
    server's Path: removed together when the role dies, and it is up again once every one is back."""

    paths: tuple[Path, ...]

    def exists(self) -> bool:
        return all(path.exists() for path in self.paths)

    def unlink(self, missing_ok: bool = False) -> None:
        for path in self.paths:
            path.unlink(missing_ok=missing_ok)


@dataclass
class Role:
    """One child process: what to run and where its output goes."""

    name: str  # e.g. "server0", "actor", "trainer"
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # added to the launcher's environment
    cpus: list[int] | None = None  # CPU cores (affinity) of the role and all it starts; None: the launcher's
    restartable: bool = True  # False: its death stops the run whatever the restart policy
    restart_argv: Callable[[], list[str]] | None = None  # the command of a restart, computed then; None: argv
    discovery: Path | DiscoveryFiles | None = None  # a server's discovery file (RUN_DIR/servers/host_port), or
    #   the files of the servers a role runs: removed when it dies, it is up again once they are published anew


class RoleFailed(RuntimeError):
    """A child exited on its own: names the role, its exit code and its log."""

    def __init__(self, role: Role, returncode: int, restarts: int = 0):
        self.role, self.returncode = role, returncode
        after = f" after {restarts} restart(s) (launch.max_restarts within launch.restart_window_s)" if restarts else ""
        super().__init__(f"role `{role.name}` exited with code {returncode}{after}; its log: {role.log_path}")


class Supervisor:
    """Starts roles, restarts those that die while `restarts` allows (None: never), reports the first one
    that exits past it, and stops the rest in reverse start order. With `health`, a server (a role with one
    discovery file) that announced itself and then stopped answering counts as dead (`_kill_if_hung`)."""

    def __init__(self, restarts: Restarts | None = None, health: HealthWatch | None = None,
                 status: StatusFile | None = None) -> None:
        self.running: dict[str, tuple[Role, subprocess.Popen]] = {}
        self.restarts = restarts
        self.health = health
        self.status = status

    @classmethod
    def from_config(cls, cfg: Config, folder: str = "launch") -> Supervisor:
        """A supervisor of servers as `pipelinerl run` and a Slurm node's agent run them: cfg.launch's restart
        policy (TensorBoard under RUN_DIR/tb/<folder>), health watch (launch.server_health_timeout_s) and
        status file (RUN_DIR/status/<folder>.json)."""
        from pipelinerl.launch.health import HealthWatch
        from pipelinerl.launch.restarts import Restarts
        from pipelinerl.rundir import StatusFile

        return cls(Restarts.from_config(cfg, folder), HealthWatch.from_config(cfg), StatusFile(cfg.run_dir, folder))

    def start(self, role: Role) -> subprocess.Popen:
        assert role.name not in self.running, role.name
        return self._spawn(role)

    def _spawn(self, role: Role) -> subprocess.Popen:
        role.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(role.log_path, "ab") as out:
            proc = subprocess.Popen(role.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **role.env}, start_new_session=True,
                                    preexec_fn=_child_setup(role.cpus))  # noqa: PLW1509 (see die_with_parent)
        self.running[role.name] = (role, proc)
        log.info("started %s (pid %d), log %s", role.name, proc.pid, role.log_path)
        return proc

    def check(self, allow_finished: frozenset[str] | set[str] = frozenset()) -> None:
        """Restart each role that has exited while the restart policy allows, else raise RoleFailed for it;
        roles in `allow_finished` may exit 0."""
        self._watch_health()
        for role, proc in list(self.running.values()):
            code = proc.poll()
            if code is None:
                code = self._kill_if_hung(role, proc)
            if code is None or (code == 0 and role.name in allow_finished):
                continue
            if self.restarts is None or not role.restartable or not self.restarts.died(role.name, code, role.log_path):
                raise RoleFailed(role, code, self.restarts.count[role.name] if self.restarts else 0)
            self._restart(role, proc)
        if self.restarts is not None:
            self.restarts.check_up([role.name for role, _ in self.running.values() if _is_up(role)])
        self._report()

    def _report(self, stopped: bool = False) -> None:
        """The roles' state into the status file (when there is one)."""
        if self.status is None:
            return
        roles = {}
        for role, proc in self.running.values():
            code = proc.poll()
            if code is not None:
                state = f"exited {code}"
            else:
                state = "stopped" if stopped else "running" if _is_up(role) else "starting"
            entry = {"pid": proc.pid, "state": state, "log": str(role.log_path), "restarts": 0}
            if self.restarts is not None:
                entry.update(restarts=self.restarts.count.get(role.name, 0), down_s=self.restarts.down_s(role.name))
            if isinstance(role.discovery, Path):
                entry["kind"] = role.discovery.parent.name
                try:
                    entry["url"] = role.discovery.read_text().strip()
                except FileNotFoundError:  # not announced (yet, or again)
                    pass
                if self.health is not None and code is None:
                    entry.update(self.health.report(role.name, proc.pid))
            roles[role.name] = entry
        self.status.update(roles=roles, **({"state": "stopped"} if stopped else {}))
        if stopped:
            self.status.flush()
            self.status.close()

    def _watch_health(self) -> None:
        """Hand the health watch the servers announced now. Only a role with one discovery file is a server:
        a Slurm job's `servers@NODE` step (DiscoveryFiles) is watched by its node's agent, which can kill the
        one wedged server instead of the node's step."""
        if self.health is None:
            return
        announced = {}
        for role, proc in self.running.values():
            if isinstance(role.discovery, Path) and proc.poll() is None:
                try:
                    announced[role.name, proc.pid] = role.discovery.read_text().strip()
                except FileNotFoundError:  # not announced yet (starting, restarting) or stopping
                    pass
        self.health.watch(announced)

    def _kill_if_hung(self, role: Role, proc: subprocess.Popen) -> int | None:
        """SIGKILL the process group of a server silent past the health timeout (a SIGSTOPped process ignores
        SIGTERM); its exit code once it is gone, so that it dies as any other death. None: not hung, or not
        gone yet (the next check sees it)."""
        silent = None if self.health is None else self.health.silent(role.name, proc.pid)
        if silent is None:
            return None
        url, silent_s = silent
        log.warning("server `%s` (pid %d, %s) has not answered /health for %.0f s (launch.server_health_timeout_s="
                    "%g): killing its process group as dead; its log: %s", role.name, proc.pid, url, silent_s,
                    self.health.timeout_s, role.log_path)
        _signal_group(proc.pid, signal.SIGKILL)
        try:
            return proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:  # in the kernel (a device driver): dies when it leaves
            return None

    def _restart(self, role: Role, proc: subprocess.Popen, grace_s: float = 20.0) -> None:
        """Start a dead role again in its place (so the shutdown order stays), once what is left of its process
        group is gone (a vLLM engine core holding the GPU, trainer ranks)."""
        if role.discovery is not None:
            role.discovery.unlink(missing_ok=True)  # what a server does itself when it stops cleanly
        _signal_group(proc.pid, signal.SIGTERM)
        _reap_group(proc, time.monotonic() + grace_s)
        self._spawn(replace(role, argv=role.restart_argv()) if role.restart_argv else role)

    def finished(self, name: str) -> bool:
        return self.running[name][1].poll() is not None

    def returncode(self, name: str) -> int | None:
        return self.running[name][1].poll()

    def wait_for(self, name: str, timeout_s: float | None = None, poll_s: float = 0.5) -> int:
        """Wait for one role to exit by itself, failing fast if another role dies meanwhile."""
        role, proc = self.running[name]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while proc.poll() is None:
            for other, other_proc in self.running.values():
                if other.name != name and other_proc.poll() is not None:
                    raise RoleFailed(other, other_proc.returncode)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"role `{name}` still running after {timeout_s:.0f} s; log: {role.log_path}")
            time.sleep(poll_s)
        return proc.returncode

    def stop_all(self, grace_s: float = 20.0) -> None:
        """Stop roles newest first: SIGTERM the role's own process, which shuts its children down (vLLM's
        API server stops its engine and frees its shared memory; signalling the engine processes at the
        same time leaks /dev/shm segments), then SIGKILL whatever of the group outlives `grace_s`."""
        if self.running:
            self._report(stopped=True)
        for name in reversed(list(self.running)):
            proc = self.running[name][1]
            deadline = time.monotonic() + grace_s
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.warning("%s ignored SIGTERM for %.0f s; killing it", name, grace_s)
            _reap_group(proc, deadline)
        self.running.clear()
        if self.health is not None:
            self.health.close()


def _is_up(role: Role) -> bool:
    """A server is up once it has published its discovery file again (a restart removes the dead one's); other
    roles once started."""
    return role.discovery is None or role.discovery.exists()


def free_port(start: int | None = None) -> int:
    """A TCP port free on 127.0.0.1 now: the kernel's choice, or the first free one from `start` (for
    callers that keep their ports in a known range)."""
    candidates = [0] if start is None else range(start, start + 1000)
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return s.getsockname()[1]
            except OSError:
                continue
    raise RuntimeError(f"no free TCP port in {start}-{start + 999}")


def _group_alive(pgid: int) -> bool:
    """Does any live (non-zombie) process belong to process group `pgid`? Zombies are skipped: they
    are dead, and where PID 1 does not reap, orphaned zombies linger."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def _reap_group(proc: subprocess.Popen, deadline: float) -> None:
    """Wait until `deadline` for the rest of the role's process group to exit, then SIGKILL what is left."""
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass

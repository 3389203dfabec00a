"""The run directory's shared files that every role reads: the control token and server discovery.

No role owns this module (the servers write discovery files, the trainer, actor, launchers and tools read
them), so it imports nothing of the package but `atomic`.

RUN_DIR/auth_token            the run's secret bearer token for control endpoints (mode 0600)
RUN_DIR/servers/*             one file per healthy policy server, holding its base URL
RUN_DIR/reference_servers/*   the same for the frozen reference-model servers (`serve --reference`):
                              a folder of their own, so the trainer never broadcasts weights to them
                              and the actor never samples from them
RUN_DIR/reward_servers/*      the same for the reward-model servers (`serve --reward`, reward.kind=model)
RUN_DIR/eval_servers/*        the same for the evaluation servers (`serve --eval`): policy servers that
                              only evaluate (the actor's training requests never reach them) and take
                              weight updates over a group of their own
RUN_DIR/openenv_servers/*     the same for the OpenEnv environment servers the launcher starts
                              (`pipelinerl openenv-serve`, task.openenv.serve): the actor's openenv task
                              opens each episode's session on one of them
RUN_DIR/status/<name>.json    what one role is doing now (StatusFile), for `pipelinerl status`: the launchers
                              (roles, restarts, each server's health and /status), trainer rank 0, each actor

Files are published whole by rename/link: parallel filesystems (Lustre, GPFS, NFS) give no reliable locks,
inotify or append visibility, so writers publish whole files and readers poll.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import secrets
import socket
import stat
import threading
import time
from pathlib import Path

from pipelinerl.atomic import create_file, write_file

TOKEN_FILE = "auth_token"
SERVERS_DIR = "servers"
REFERENCE_SERVERS_DIR = "reference_servers"
REWARD_SERVERS_DIR = "reward_servers"
EVAL_SERVERS_DIR = "eval_servers"
OPENENV_SERVERS_DIR = "openenv_servers"
# Each kind of server (`pipelinerl serve`, `serve --reference` / `--reward` / `--eval`, `openenv-serve`) -> the
# folder it announces in.
SERVER_FOLDERS = {"policy": SERVERS_DIR, "reference": REFERENCE_SERVERS_DIR, "reward": REWARD_SERVERS_DIR,
                  "eval": EVAL_SERVERS_DIR, "openenv": OPENENV_SERVERS_DIR}
POLICY_KINDS = ("policy", "eval")  # the kinds that serve the policy: they take weight updates, report versions
STATUS_DIR = "status"

log = logging.getLogger(__name__)


def run_fingerprint(token: str) -> str:
    """A public id of the run whose token this is: a policy server reports it on GET /status, so that a client can
    tell its run's servers from another run's that took the same host and port (two runs on one machine, one
    base_port). A prefix of a hash: it reveals nothing of the token."""
    return hashlib.sha256(b"pipelinerl-run\0" + token.encode()).hexdigest()[:16]


def run_token(run_dir: str | Path | None, configured: str | None = None) -> str:
    """The configured token, else RUN_DIR/auth_token, created (mode 0600) by whoever comes first."""
    if configured:
        return configured
    if run_dir is None:
        raise ValueError("control endpoints need a token: set inference.auth_token or give a run directory")
    path = Path(run_dir) / TOKEN_FILE
    if not path.exists():
        _create_token(path)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise ValueError(f"{path} is readable by others (mode {mode:o}); run `chmod 600 {path}`")
    token = path.read_text().strip()
    if not token:
        raise ValueError(f"{path} is empty; delete it and a new token will be created")
    return token


def _create_token(path: Path) -> None:
    """Write to a private temporary file, then link: the token appears complete or not at all, and a
    concurrent creator loses the link race and reads the winner's token."""
    create_file(path, secrets.token_urlsafe(32), mode=0o600)


WILDCARDS = ("", "0.0.0.0", "::")
ADVERTISE_ENV = "PIPELINERL_ADVERTISE_HOST"  # set by the Slurm launcher: the node's address in Slurm (NodeAddr)


def bind_host(configured: str | None) -> str:
    """The address a server binds to: inference.host, or loopback (the Slurm launcher sets the wildcard)."""
    return configured or "127.0.0.1"


def advertised_host(bind_host: str) -> str:
    """The host others reach a server bound to `bind_host` at, which also names its discovery file: the bound
    address itself; for a wildcard, $PIPELINERL_ADVERTISE_HOST (on Slurm: the address Slurm reaches the node at,
    the same whether the node calls itself by a short or a fully qualified name), else this host's name."""
    if bind_host not in WILDCARDS:
        return bind_host
    return os.environ.get(ADVERTISE_ENV) or socket.gethostname()


def server_file(run_dir: str | Path, host: str, port: int, folder: str = SERVERS_DIR) -> Path:
    return Path(run_dir) / folder / f"{host}_{port}"


def publish_server(run_dir: str | Path, host: str, port: int, folder: str = SERVERS_DIR) -> Path:
    """Announce a healthy server: write its URL, then rename into RUN_DIR/<folder>/."""
    path = server_file(run_dir, host, port, folder)
    write_file(path, f"http://{host}:{port}\n")
    return path


def list_servers(run_dir: str | Path, folder: str = SERVERS_DIR) -> list[str]:
    """Base URLs of the servers announced in RUN_DIR/<folder>/ (sorted; hidden temporaries skipped)."""
    return sorted(server_roster(run_dir, folder))


def server_roster(run_dir: str | Path, folder: str = SERVERS_DIR) -> dict[str, int]:
    """Each announced server's base URL and the time its file was published (ns): a server that restarts
    on the same address announces itself again, so the roster changes."""
    path = Path(run_dir) / folder
    if not path.is_dir():
        return {}
    roster = {}
    for p in path.iterdir():
        if not p.name.startswith("."):
            try:
                roster[p.read_text().strip()] = p.stat().st_mtime_ns
            except FileNotFoundError:  # removed meanwhile: its server stopped
                pass
    return roster


class StatusFile:
    """RUN_DIR/status/<name>.json: what one role is doing, for `pipelinerl status`, which reads only the run
    directory (a login node over the parallel filesystem, a finished run). `update` merges fields and rewrites the
    file whole (atomically) when `every_s` has passed since the last write; a daemon thread rewrites it at least
    that often between updates (a trainer step may take minutes), so a file older than a few periods means its
    process is gone or frozen. `flush` writes now; `close` stops the thread. A wait is a field too: `waiting(what)`
    keeps the time it began while `what` stays the same, `done_waiting()` ends it. The file carries its writer's
    host and pid and the wall time of the write (`time`). A failed write (a full disk) is logged once and never
    stops the role."""

    def __init__(self, run_dir: str | Path, name: str, every_s: float = 2.0):
        self.path = Path(run_dir) / STATUS_DIR / f"{name.replace('/', '_')}.json"
        self.every_s = every_s
        self.fields: dict = {"role": name, "host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        self._lock = threading.Lock()
        self._written = -math.inf  # monotonic time of the last write
        self._failed = False
        self._stop = threading.Event()
        if every_s > 0:
            threading.Thread(target=self._beat, name=f"status-{name}", daemon=True).start()

    def update(self, **fields) -> None:
        with self._lock:
            self.fields.update(fields)
        if time.monotonic() - self._written >= self.every_s:
            self.flush()

    def waiting(self, what: str, **detail) -> None:
        """A wait for `what` began, or goes on (`detail`: what it has so far)."""
        current = self.fields.get("waiting")
        since = current["since"] if current and current["for"] == what else time.time()
        self.update(waiting={"for": what, "since": since, **detail})

    def done_waiting(self) -> None:
        if self.fields.get("waiting") is not None:
            self.update(waiting=None)

    def flush(self) -> None:
        # One write at a time: the heartbeat and an update in the same process share the temporary file's name.
        with self._lock:
            self._written = time.monotonic()
            try:
                write_file(self.path, json.dumps({**self.fields, "time": time.time()}, default=str) + "\n",
                           fsync=False)
            except OSError as err:
                if not self._failed:
                    log.warning("cannot write %s (%s): `pipelinerl status` will not show this role", self.path, err)
                self._failed = True

    def close(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            # only while the folder is there: a run directory removed under a finished object is not re-created
            if time.monotonic() - self._written >= self.every_s and self.path.parent.is_dir():
                self.flush()


def read_statuses(run_dir: str | Path) -> dict[str, dict]:
    """Every role's status file (name -> its fields); unreadable ones (being replaced, garbled) are left out."""
    found = {}
    for path in sorted((Path(run_dir) / STATUS_DIR).glob("*.json")):
        try:
            found[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    return found

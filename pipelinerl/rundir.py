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

Files are published whole by rename/link: parallel filesystems (Lustre, GPFS, NFS) give no reliable locks,
inotify or append visibility, so writers publish whole files and readers poll.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import stat
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

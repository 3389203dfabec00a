"""A server that stopped answering is a dead server (launch.server_health_timeout_s).

Exit codes miss a server that is alive but wedged (SIGSTOPped, a hung collective, a stuck engine): its
discovery file stays, the actor keeps sending it work and the trainer keeps it in its weight-update group.
So once a server has announced itself (its discovery file in RUN_DIR/servers, or its kind's folder:
rundir.SERVER_FOLDERS), `HealthWatch` polls its `GET /health` (vLLM's own route, and openenv-core's create_app's for
an OpenEnv environment server: every kind has it, no token)
on a daemon thread, every server of a round at once, and `procs.Supervisor.check` SIGKILLs the process group
of one that has not answered 200 for the timeout; the death path then removes its discovery file and
restarts it like any other death (launch/restarts.py). Both launchers go through it: `pipelinerl run`
(launch/local.py) and a Slurm node's servers agent (launch/slurm_node.py). A server not yet announced is
left to inference.startup_timeout_s. A server that answers is also asked `GET /status` (a policy server's version,
whether it is updating or held; a kind without the route answers 404 and reports nothing): what the launcher's
status file shows (`pipelinerl status`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipelinerl.config import Config

log = logging.getLogger(__name__)

HEALTH_PATH = "/health"
STATUS_PATH = "/status"
STATUS_TIMEOUT_S = 2.0  # for /status: a slow one must not delay the next round of health polls
STATUS_FIELDS = ("version", "updating", "held_s", "updates", "last_pause_s")  # of /status, kept for the report
POLL_S = 5.0  # at most this long between two polls of a server
REQUEST_TIMEOUT_S = 10.0  # at most this long for one answer (connect and read)
MAX_PARALLEL = 16  # polls in flight at once: one wedged server must not delay the others' polls


@dataclass
class _Server:
    url: str
    last_ok: float  # monotonic time of its last 200 (at first: when it was first seen announced, having
    #   answered its own /health just before it published)
    failing: bool = False  # its latest poll got no 200
    status: dict | None = None  # STATUS_FIELDS of its latest /status answer


class HealthWatch:
    """The announced servers' /health, polled every `poll_s` with `request_timeout_s` per request (both
    derived from `timeout_s`, the launch.server_health_timeout_s, so a small timeout is still polled
    several times within it)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.poll_s = min(POLL_S, timeout_s / 4)
        self.request_timeout_s = min(REQUEST_TIMEOUT_S, timeout_s / 2)
        self._servers: dict[tuple[str, int], _Server] = {}  # (role name, pid) -> its state
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, cfg: Config) -> HealthWatch | None:
        """The watch of launch.server_health_timeout_s; None when it is null (exit codes only)."""
        timeout_s = cfg.launch.server_health_timeout_s
        return None if timeout_s is None else cls(timeout_s)

    def watch(self, announced: dict[tuple[str, int], str]) -> None:
        """The servers announced now, (role name, pid) -> base URL: a new one's clock starts now; one no longer
        announced (stopped, died, restarted under a new pid) is forgotten."""
        now = time.monotonic()
        with self._lock:
            self._servers = {key: self._servers.get(key) or _Server(url, now) for key, url in announced.items()}
        if announced and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="server-health", daemon=True)
            self._thread.start()

    def silent(self, name: str, pid: int) -> tuple[str, float] | None:
        """(URL, seconds silent) of server `name` (process `pid`) once it has not answered past the timeout;
        else None. Only while its latest poll failed too: a launcher that was itself stalled (suspended,
        starved) and polls again finds a healthy server answering, and kills nothing."""
        with self._lock:
            server = self._servers.get((name, pid))
            if server is None or not server.failing:
                return None
            silent_s = time.monotonic() - server.last_ok
        return (server.url, silent_s) if silent_s >= self.timeout_s else None

    def report(self, name: str, pid: int) -> dict:
        """For the status file: `health` ("ok", "silent N s", or "not polled yet") and what its latest /status
        said."""
        with self._lock:
            server = self._servers.get((name, pid))
            if server is None:
                return {}
            silent_s = time.monotonic() - server.last_ok
            health = f"silent {silent_s:.0f} s" if server.failing else "ok"
            return {"health": health, **({"server": dict(server.status)} if server.status else {})}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.request_timeout_s + 5)
            self._thread = None
        self._stop.clear()

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=httpx.Timeout(self.request_timeout_s)) as http, \
                ThreadPoolExecutor(MAX_PARALLEL, thread_name_prefix="server-health") as pool:
            while not self._stop.wait(self.poll_s):
                with self._lock:
                    servers = list(self._servers.values())
                for server, (ok, status) in zip(servers, pool.map(lambda s: _poll(http, s.url), servers)):
                    with self._lock:  # a server forgotten meanwhile is updated in vain: harmless
                        server.failing = not ok
                        if ok:
                            server.last_ok, server.status = time.monotonic(), status


def _poll(http, url: str) -> tuple[bool, dict | None]:
    """(did `url` answer GET /health with 200 within the client's timeout, STATUS_FIELDS of its GET /status)."""
    import httpx

    try:
        if http.get(url + HEALTH_PATH).status_code != 200:
            return False, None
    except (httpx.HTTPError, httpx.InvalidURL):  # no answer in time, refused, reset; a garbled discovery file
        return False, None
    try:
        answer = http.get(url + STATUS_PATH, timeout=STATUS_TIMEOUT_S)
        body = answer.json() if answer.status_code == 200 else None
    except (httpx.HTTPError, ValueError):  # healthy but no /status in time, or not JSON: health is what counts
        body = None
    return True, ({k: body[k] for k in STATUS_FIELDS if k in body} if isinstance(body, dict) else None)

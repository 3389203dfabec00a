"""The one client of a policy server's control routes: `/status`, `/init_process_group`, `/request_weight_update`.

The actor, the trainer's weight delivery, the launchers and the tools all read a server through this module,
so the routes' JSON is parsed in one place (`ServerStatus`). No torch, no vLLM: any role may import it.
A transport error or a status other than 200 raises `ControlError`, which names the URL and keeps the reply's
status and JSON body (a server's errors carry {"error": ..., "group_ready": ..., "version": ...}).
"""

from __future__ import annotations

import functools
import ssl
from dataclasses import dataclass, field

import httpx

CONNECT_TIMEOUT_S = 10.0


class ControlError(RuntimeError):
    """A control request failed; the message names the server. `status`: the HTTP status (None: no reply);
    `body`: the reply's JSON object ({} when there was none)."""

    def __init__(self, message: str, status: int | None = None, body: dict | None = None):
        super().__init__(message)
        self.status, self.body = status, body or {}


@dataclass(frozen=True)
class ServerStatus:
    """A policy server's `GET /status` (inference/updates.py `WeightUpdater.status` writes it)."""

    url: str
    version: int  # policy version of the served weights
    num_ranks: int  # ranks it adds to a weight-update group (1 whatever its tensor parallelism)
    group_ready: bool  # it holds a weight-update group
    updating: bool  # a control operation (join or update) is running
    updates: int = 0  # updates completed since it started
    delta_base: int | None = None  # the version its workers keep as the base of delta updates
    dtype: str = ""  # dtype of the served weights
    tensors: dict[str, list[int]] = field(default_factory=dict, repr=False)  # HF name -> shape
    last_pause_s: float = 0.0
    pause_total_s: float = 0.0
    run: str = ""  # the run it serves (rundir.run_fingerprint); "" from a server that does not say

    @classmethod
    def parse(cls, url: str, body: object) -> ServerStatus:
        """ControlError when `body` is not a status reply (a proxy's page, another program on the port)."""
        try:
            return cls(url=url, version=int(body["version"]), num_ranks=int(body["num_ranks"]),
                       group_ready=bool(body["group_ready"]), updating=bool(body["updating"]),
                       updates=int(body.get("updates", 0)), delta_base=body.get("delta_base"),
                       dtype=str(body.get("dtype", "")), tensors=dict(body.get("tensors") or {}),
                       last_pause_s=float(body.get("last_pause_s", 0.0)),
                       pause_total_s=float(body.get("pause_total_s", 0.0)), run=str(body.get("run", "")))
        except (TypeError, KeyError, ValueError) as err:
            raise ControlError(f"GET {url}/status answered something that is not a server status "
                               f"({err!r}): {str(body)[:200]}") from err


class ControlClient:
    """Blocking calls to the control routes with the run's bearer token; every call is bounded by
    `timeout_s` (reads) and CONNECT_TIMEOUT_S (connects)."""

    def __init__(self, token: str | None, timeout_s: float = 30.0):
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout_s = timeout_s

    def status(self, url: str, timeout_s: float | None = None) -> ServerStatus:
        return ServerStatus.parse(url, self.request(url, "/status", None, timeout_s))

    def init_group(self, url: str, body: dict, timeout_s: float | None = None) -> dict:
        return self.request(url, "/init_process_group", body, timeout_s)

    def request_update(self, url: str, body: dict, timeout_s: float | None = None) -> dict:
        return self.request(url, "/request_weight_update", body, timeout_s)

    def request(self, url: str, path: str, body: dict | None, timeout_s: float | None = None) -> dict:
        """GET (body None) or POST (a JSON body) url + path; the JSON reply, or ControlError."""
        return http_json(url, path, body, self.headers, self.timeout_s if timeout_s is None else timeout_s)


async def read_status(http: httpx.AsyncClient, url: str, timeout_s: float = 10.0) -> ServerStatus:
    """`GET /status` from async code (the actor), on the caller's client; ControlError as `ControlClient`."""
    try:
        resp = await http.get(f"{url}/status", timeout=timeout_s)
    except httpx.HTTPError as err:
        raise ControlError(f"GET {url}/status failed: {err!r}") from err
    if resp.status_code != 200:
        raise ControlError(f"GET {url}/status -> HTTP {resp.status_code}: {resp.text[:300]}", resp.status_code)
    try:
        body = resp.json()
    except ValueError as err:
        raise ControlError(f"GET {url}/status answered no JSON: {resp.text[:200]}") from err
    return ServerStatus.parse(url, body)


def http_json(url: str, path: str, body: dict | None, headers: dict, read_timeout_s: float) -> dict:
    """GET (body None) or POST (JSON body); the JSON reply. ControlError names the URL on a transport error or
    a status other than 200."""
    method = "GET" if body is None else "POST"
    try:
        resp = httpx.request(method, url + path, json=body, headers=headers,
                             timeout=httpx.Timeout(read_timeout_s, connect=CONNECT_TIMEOUT_S), verify=_ssl_context())
    except httpx.HTTPError as err:
        raise ControlError(f"{method} {url}{path} failed: {err!r}") from err
    try:
        reply = resp.json()
    except ValueError:
        reply = None
    if resp.status_code != 200:
        raise ControlError(f"{method} {url}{path} -> HTTP {resp.status_code}: {resp.text[:500]}",
                           resp.status_code, reply if isinstance(reply, dict) else {})
    if not isinstance(reply, dict):
        raise ControlError(f"{method} {url}{path} answered no JSON object: {resp.text[:200]}", resp.status_code)
    return reply


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One SSL context for every request: without one, httpx builds a new one per request (loading the CA
    bundle: ~50 ms of CPU holding the GIL, measured on CPU), which delayed each weight update's first bucket."""
    return httpx.create_ssl_context()

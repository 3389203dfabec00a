"""The one client of a policy server's control routes: `/status`, `/init_process_group`, `/request_weight_update`,
`/hold`, `/release`.

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
    held_s: float = 0.0  # seconds its hold for an evaluation has left (updates answer 423 meanwhile); 0: not held

    @classmethod
    def parse(cls, url: str, body: object) -> ServerStatus:
        """ControlError when `body` is not a status reply (a proxy's page, another program on the port)."""
        try:
            return cls(url=url, version=int(body["version"]), num_ranks=int(body["num_ranks"]),
                       group_ready=bool(body["group_ready"]), updating=bool(body["updating"]),
                       updates=int(body.get("updates", 0)), delta_base=body.get("delta_base"),
                       dtype=str(body.get("dtype", "")), tensors=dict(body.get("tensors") or {}),
                       last_pause_s=float(body.get("last_pause_s", 0.0)),
                       pause_total_s=float(body.get("pause_total_s", 0.0)), run=str(body.get("run", "")),
                       held_s=float(body.get("held_s", 0.0)))
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

    def hold(self, url: str, seconds: float) -> dict:
        return self.request(url, "/hold", {"seconds": seconds})

    def release(self, url: str) -> dict:
        return self.request(url, "/release", {})

    def request(self, url: str, path: str, body: dict | None, timeout_s: float | None = None) -> dict:
        """GET (body None) or POST (a JSON body) url + path; the JSON reply, or ControlError."""
        return http_json(url, path, body, self.headers, self.timeout_s if timeout_s is None else timeout_s)


async def read_status(http: httpx.AsyncClient, url: str, timeout_s: float = 10.0) -> ServerStatus:
    """`GET /status` from async code (the actor), on the caller's client; ControlError as `ControlClient`."""
    return ServerStatus.parse(url, await _request_async(http, url, "/status", None, {}, timeout_s))


async def hold_server(http: httpx.AsyncClient, url: str, token: str, seconds: float, timeout_s: float = 30.0) -> dict:
    """`POST /hold` from async code: the server loads no update for `seconds` or until `release_server`, so an
    evaluation on it sees one policy; the reply's "version" is that policy. A server mid-update answers once the
    update is done. ControlError as `ControlClient` (a bad `seconds`: status 400)."""
    return await _request_async(http, url, "/hold", {"seconds": seconds}, _bearer(token), timeout_s)


async def release_server(http: httpx.AsyncClient, url: str, token: str, timeout_s: float = 30.0) -> dict:
    """`POST /release`: end the hold. The reply's "held" says whether one was still in force (False: it had
    expired, which an evaluation that outlasts its hold should report)."""
    return await _request_async(http, url, "/release", {}, _bearer(token), timeout_s)


def _bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


async def _request_async(http: httpx.AsyncClient, url: str, path: str, body: dict | None, headers: dict,
                         timeout_s: float) -> dict:
    """`http_json` on the caller's async client."""
    method = "GET" if body is None else "POST"
    try:
        resp = await http.request(method, url + path, json=body, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as err:
        raise ControlError(f"{method} {url}{path} failed: {err!r}") from err
    return _reply(method, url + path, resp)


def http_json(url: str, path: str, body: dict | None, headers: dict, read_timeout_s: float) -> dict:
    """GET (body None) or POST (JSON body); the JSON reply. ControlError names the URL on a transport error or
    a status other than 200."""
    method = "GET" if body is None else "POST"
    try:
        resp = httpx.request(method, url + path, json=body, headers=headers,
                             timeout=httpx.Timeout(read_timeout_s, connect=CONNECT_TIMEOUT_S), verify=_ssl_context())
    except httpx.HTTPError as err:
        raise ControlError(f"{method} {url}{path} failed: {err!r}") from err
    return _reply(method, url + path, resp)


def _reply(method: str, where: str, resp: httpx.Response) -> dict:
    """The JSON object of a 200 reply; ControlError (keeping the status and JSON body) otherwise."""
    try:
        reply = resp.json()
    except ValueError:
        reply = None
    if resp.status_code != 200:
        raise ControlError(f"{method} {where} -> HTTP {resp.status_code}: {resp.text[:500]}",
                           resp.status_code, reply if isinstance(reply, dict) else {})
    if not isinstance(reply, dict):
        raise ControlError(f"{method} {where} answered no JSON object: {resp.text[:200]}", resp.status_code)
    return reply


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One SSL context for every request: without one, httpx builds a new one per request (loading the CA
    bundle: ~50 ms of CPU holding the GIL, measured on CPU), which delayed each weight update's first bucket."""
    return httpx.create_ssl_context()

"""The servers of one kind announced in the run directory, as the completions client (client.py) sees them: their
load, the versions they reported, the ones set aside and why.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pipelinerl.rundir import SERVER_FOLDERS, SERVERS_DIR, list_servers

log = logging.getLogger(__name__)


class ServerPool:
    """The servers announced in RUN_DIR/<folder>/, least-loaded first. A server that fails is set aside
    (`aside`) and every request in flight on it is told to move (`track` gives each request an event that
    `set_aside` sets), also when its discovery file disappears (the launcher removes the file of a dead or
    hung server). It is announced again after `retry_after_s`; with `readmit_on_status` (the policy servers)
    it then takes requests only once it has answered GET /status again (`heard`), so a hung server is not
    handed new requests to hang.

    With a lag bound (`max_lag` not None) only eligible servers take requests: those whose last reported
    version (`versions`, filled by CompletionsClient.serving_version) is at least the newest one reported
    minus `max_lag`. A server with no report yet, e.g. just restarted on an old checkpoint or back from
    being set aside, is not eligible until it reports a recent version. None: every announced server.

    `only`: the one server of the folder it takes (an evaluation server held for one evaluation); None: all."""

    def __init__(self, run_dir: str, retry_after_s: float = 10.0, folder: str = SERVERS_DIR,
                 max_lag: int | None = None, readmit_on_status: bool = False, only: str | None = None):
        self.run_dir, self.retry_after_s, self.folder, self.max_lag = run_dir, retry_after_s, folder, max_lag
        self.only = only
        self.readmit_on_status = readmit_on_status
        self.load: dict[str, int] = {}
        self.aside: dict[str, tuple[float, str]] = {}  # url -> (when, why) it was set aside; gone once heard
        self.versions: dict[str, int] = {}  # url -> the policy version it last reported
        self.behind: set[str] = set()  # servers known to be too far behind (logged once each time)
        self.requests: dict[str, set[asyncio.Event]] = {}  # url -> one event per request in flight on it
        self.heard_at: dict[str, float] = {}  # url -> when it last answered (or got its first request)

    @property
    def kind(self) -> str:
        return next(kind for kind, folder in SERVER_FOLDERS.items() if folder == self.folder)

    def refresh(self) -> list[str]:
        listed = [u for u in list_servers(self.run_dir, self.folder) if self.only in (None, u)]
        for url in self.busy():
            if url not in listed:
                self.set_aside(url, "its discovery file is gone")
        now = time.monotonic()
        announced = [u for u in listed if now - self.aside.get(u, (-1e9, ""))[0] > self.retry_after_s]
        for url in announced:
            self.load.setdefault(url, 0)
        for url in list(self.load):
            if url not in announced and self.load[url] == 0:
                del self.load[url]
        for url in set(self.versions) - set(announced):  # gone or set aside: a restarted one reports anew
            del self.versions[url]
        return announced

    def eligible(self) -> list[str]:
        """The announced servers that may take requests (see the class)."""
        announced = self.refresh()
        if self.readmit_on_status:
            announced = [u for u in announced if u not in self.aside]
        if self.max_lag is None:
            return announced
        known = {u: self.versions[u] for u in announced if u in self.versions}
        newest = max(known.values(), default=0)
        self._log_behind({u for u, v in known.items() if v < newest - self.max_lag}, newest)
        return [u for u, v in known.items() if v >= newest - self.max_lag]

    def _log_behind(self, behind: set[str], newest: int) -> None:
        for url in sorted(behind - self.behind):
            log.warning("server %s serves version %d, more than max_lag=%d behind the newest (%d): no new "
                        "requests until it catches up", url, self.versions[url], self.max_lag, newest)
        for url in sorted(self.behind - behind):
            log.info("server %s is no longer too far behind (caught up, or gone)", url)
        self.behind = behind

    def acquire(self, avoid: set[str], min_version: int | None = None) -> str | None:
        """The least-loaded eligible server, not in `avoid` if another one is eligible; only servers that
        reported at least `min_version` (None: any) may take the request. None when no server may."""
        eligible = [u for u in self.eligible() if min_version is None or self.versions.get(u, -1) >= min_version]
        candidates = [u for u in eligible if u not in avoid] or eligible
        if not candidates:
            return None
        url = min(candidates, key=lambda u: self.load[u])
        self.load[url] += 1
        return url

    def track(self, url: str) -> asyncio.Event:
        """A request acquired on `url` is in flight: the event is set when it must move to another server."""
        if not self.busy_on(url):  # its silence counts from now, not from its last answer before an idle time
            self.heard_at[url] = time.monotonic()
        moved = asyncio.Event()
        self.requests.setdefault(url, set()).add(moved)
        return moved

    def release(self, url: str, failed: bool, moved: asyncio.Event | None = None) -> None:
        self.load[url] = max(0, self.load.get(url, 0) - 1)
        self.requests.get(url, set()).discard(moved)
        if failed:
            self.set_aside(url, "a request failed")

    def set_aside(self, url: str, why: str) -> None:
        """No requests for `url` until it is announced again (see the class); its requests in flight move."""
        self.aside[url] = (time.monotonic(), why)
        moving = [e for e in self.requests.pop(url, set()) if not e.is_set()]
        for moved in moving:
            moved.set()
        if moving:
            log.warning("server %s set aside (%s): cancelling its %d request(s) in flight, retried on other "
                        "servers", url, why, len(moving))

    def heard(self, url: str, version: int | None = None) -> None:
        """`url` answered (its /status with `version`, or a request): it is no longer set aside."""
        self.heard_at[url] = time.monotonic()
        self.aside.pop(url, None)
        if version is not None:
            self.versions[url] = version

    def busy_on(self, url: str) -> bool:
        return any(not e.is_set() for e in self.requests.get(url, ()))

    def busy(self) -> list[str]:
        """The servers with requests in flight."""
        return [u for u in list(self.requests) if self.busy_on(u)]

    def silent_s(self, url: str) -> float:
        return time.monotonic() - self.heard_at.get(url, time.monotonic())

    def describe(self, min_version: int | None) -> str:
        """What a request that no server may take waits for: the version it needs, each announced server's
        last reported version, the servers set aside and why."""
        now = time.monotonic()
        need = [] if min_version is None else [f"version >= {min_version}"]
        if self.max_lag is not None:
            need.append(f"within max_lag={self.max_lag} of the newest version reported "
                        f"({max(self.versions.values(), default='none')})")
        listed = list_servers(self.run_dir, self.folder)
        servers = [f"{u} set aside {now - self.aside[u][0]:.0f} s ago ({self.aside[u][1]})" if u in self.aside
                   else f"{u} at version {self.versions[u]}" if u in self.versions
                   else f"{u} (no version reported)" for u in listed]
        gone = [f"{u} ({why})" for u, (_, why) in self.aside.items() if u not in listed]
        return (f"needs {' and '.join(need) or 'any server'}; announced: {', '.join(servers) or 'none'}"
                + (f"; set aside and no longer announced: {', '.join(gone)}" if gone else ""))

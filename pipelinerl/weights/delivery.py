"""Weight delivery: brings every announced server to the newest published version, on a thread of its own.

The training loop publishes versions (weights/publish.py) and never waits for a server. `Delivery` owns
everything after that: the roster (RUN_DIR/servers), which version each server serves (its /status), the
weight-update group (weights/sender.py `WeightBroadcaster`: dense or delta, checksums), one retry policy,
and the escalation of a delivery that keeps failing.

Invariant (tests/test_delivery.py): while a version is published and no newer one comes (the trainer waits for
the data of its next step), every announced server that answers reaches that version within one round after
it is seen: a late joiner, a server restarted on an old checkpoint, a server that failed an update. No step,
no collective across trainer ranks is needed for that: only rank 0 delivers, from host memory.

Policy, in this module only:
- A server is *behind* when the version it reports is not the newest published one. Each round goes to the
  servers that are behind and not waiting out a retry; the group is kept while that set stays the same, else
  formed anew with it (a restarted server alone, then everyone again at the next version).
- A failed round (or /status) puts its culprits (the servers the error names, or every member) on a backoff
  of RETRY_FIRST_S doubling up to RETRY_MAX_S; the other members are retried at once.
- Stragglers (deadline.py): a round that misses its deadline sets aside the members still silent after it was
  abandoned (the same backoff) and goes on with the others at once: those that answered keep their version
  (or take the round's, if it reached them), with no backoff. A server's /status is asked on a thread of its
  own, never waited for, so a server that stopped answering costs nothing to the others while it is asked.
- While some server is behind, a warning every `wait_log_s` from the start of that wait names each server
  behind and the version it is at (a thread of its own, so a round that blocks never delays it).
- A server announced anew (a restart re-publishes its file) starts afresh: its version is asked again, and a
  group it was a member of is formed anew (the restarted server holds none).
- A server the `held` callback names (an evaluation server held at one version while it evaluates,
  inference/updates.py `WeightUpdater.hold`) is left alone, neither behind nor failing, until it is released.
- Escalation: when every announced server has failed every attempt for `fail_after_versions` consecutive
  published versions and for at least `fail_after_s`, the delivery stops with `DeliveryFailed` naming the
  servers and their last errors; the trainer then stops the run (trainer/step_data.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from pipelinerl.control import ControlClient, ControlError
from pipelinerl.weights.collective import map_on_threads, on_thread
from pipelinerl.weights.deadline import MembersLate
from pipelinerl.weights.publish import Publication, Snapshot
from pipelinerl.weights.sender import WeightBroadcaster

log = logging.getLogger(__name__)

RETRY_FIRST_S = 1.0  # backoff after a server's first failure; doubled per further failure
RETRY_MAX_S = 30.0
POLL_S = 0.5  # the roster (RUN_DIR/servers) is read at least this often while nothing is to be delivered
HELD_STATUS_S = 5.0  # held_servers: a stopped evaluation server costs the others this once, then it is set aside
WAIT_LOG_POLL_S = 0.1  # how often the wait-log thread looks (a line is at most this late on its period)


class DeliveryFailed(RuntimeError):
    """Every server failed every delivery for the configured number of versions; the message names them."""


@dataclass
class ServerState:
    url: str
    announced_at: int  # ns: the discovery file's time (a restart announces anew)
    version: int | None = None  # the version it serves, as last reported (None: to be asked)
    failures: int = 0  # consecutive failed attempts
    failed_versions: set[int] = field(default_factory=set)  # versions it failed since its last success
    failing_since: float | None = None  # monotonic time of the first failure of the streak
    last_error: str = ""
    retry_at: float = 0.0  # monotonic: no attempt before
    last_version: int | None = None  # the version it last reported, kept while `version` is to be asked again

    def describe(self, now: float) -> str:
        at = (f"at version {self.version}" if self.version is not None else "version unknown" if
              self.last_version is None else f"at version {self.last_version} when it last answered")
        retry = f", retry in {self.retry_at - now:.0f} s" if self.retry_at > now else ""
        err = f", {self.failures} failed attempt(s), last: {self.last_error[:200]}" if self.failures else ""
        return f"{self.url} {at}{retry}{err}"


@dataclass(frozen=True)
class DeliveryReport:
    """One delivery round (successful or not), for the trainer's TensorBoard scalars."""

    version: int
    servers: tuple[str, ...]
    ok: bool
    total_s: float = 0.0  # the round: group (re)formed if needed, sent, every reply in
    send_s: float = 0.0  # the broadcast itself
    bytes: int = 0  # sent on the wire
    dense_bytes: int = 0  # the version's full size
    paused_s: float = 0.0  # the longest server pause (stop, receive, load, resume)
    changed_fraction: float | None = None  # delta mode: of the elements compared
    error: str = ""


class Delivery:
    """The delivery thread of trainer rank 0 (see the module). `roster()` -> {url: announced_at ns}; `held(urls)`
    -> those of `urls` to leave alone this round (None: none ever is)."""

    def __init__(self, publication: Publication, roster: Callable[[], dict[str, int]], sender: WeightBroadcaster,
                 control: ControlClient, fail_after_versions: int = 5, fail_after_s: float = 120.0,
                 wait_log_s: float = 30.0, held: Callable[[list[str]], set[str]] | None = None):
        self.publication, self.roster, self.sender, self.control = publication, roster, sender, control
        self.held, self._held = held, set()  # _held: the servers the last round left alone
        self.fail_after_versions, self.fail_after_s, self.wait_log_s = fail_after_versions, fail_after_s, wait_log_s
        self.servers: dict[str, ServerState] = {}
        self.failure: DeliveryFailed | None = None
        self._lock = threading.Lock()  # servers, reports and failure, read by the loop's wait logs
        self._reports: list[DeliveryReport] = []
        self._group_roster: dict[str, int] = {}  # the members' announcement times when the group formed
        # url -> (the server's state when asked, its /status read under way); the delivery thread's only
        self._probes: dict[str, tuple[ServerState, Future]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Delivery:
        self._thread = threading.Thread(target=self._run, name="weights-delivery", daemon=True)
        self._thread.start()
        threading.Thread(target=self._log_waits, name="weights-delivery-log", daemon=True).start()
        return self

    def close(self, wait_s: float = 5.0) -> None:
        """Stop delivering and leave the group. Bounded: a round stuck on a hung server is abandoned (its
        members stop waiting, collective.py) and the thread is left to end with the process."""
        deadline = time.monotonic() + wait_s
        self._stop.set()
        self.publication.wake()
        self.sender.close(wait_s)
        if self._thread is not None:
            self._thread.join(timeout=max(deadline - time.monotonic(), 0.0))

    def wait_for(self, version: int, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until every announced server serves `version` (the run's last one, before the
        trainer exits: its servers keep serving, or evaluating, the final weights). False on a timeout or a
        failure, logged with every server's state."""
        deadline = time.monotonic() + timeout_s
        while self.failure is None and time.monotonic() < deadline:
            with self._lock:
                if all(s.version == version for s in self.servers.values()):  # none announced: nothing to wait for
                    return True
            time.sleep(0.1)
        log.warning("weight delivery: version %d not on every server after %.0f s: %s", version, timeout_s,
                    self.describe())
        return False

    def reports(self) -> list[DeliveryReport]:
        """The rounds since the last call."""
        with self._lock:
            out, self._reports = self._reports, []
        return out

    def describe(self) -> str:
        """What delivery is doing, for the wait logs: the newest version and every server's state."""
        now = time.monotonic()
        with self._lock:
            servers = [s.describe(now) + (" (held)" if u in self._held else "") for u, s in self.servers.items()]
        latest = self.publication.latest_version()
        head = "nothing published yet" if latest is None else f"version {latest} published"
        return f"{head}; servers: {'; '.join(servers) or 'none announced in RUN_DIR/servers'}"

    def server_states(self) -> list[ServerState]:
        """A copy of every announced server's state as delivery last knew it (read-only: the trainer's wait log)."""
        with self._lock:
            return [replace(s) for s in self.servers.values()]

    def _run(self) -> None:
        if self.sender.backend == "nccl":  # the CUDA device is per thread: NCCL buffers go to rank 0's GPU
            import torch

            torch.cuda.set_device(self.sender.device)
        seen = None
        while not self._stop.is_set():
            try:
                delivered = self.step()
            except Exception as err:  # a bug here must stop the run, never silently stop delivering
                log.exception("weight delivery stopped on an unexpected error")
                with self._lock:
                    self.failure = DeliveryFailed(f"weight delivery stopped on an unexpected error: {err!r}")
                return
            if self.failure is not None:
                return
            if not delivered:  # at once when a version is published, else after POLL_S: the roster
                seen = self.publication.wait_newer(seen, POLL_S)

    def _log_waits(self) -> None:
        """While some server (not held) is behind the newest version: a warning every wait_log_s, counted from
        the start of that wait, naming each one behind and the version it is at."""
        started = next_log = None
        while not self._stop.wait(WAIT_LOG_POLL_S):
            latest, now = self.publication.latest_version(), time.monotonic()
            with self._lock:
                behind = [s for u, s in self.servers.items() if s.version != latest and u not in self._held]
            if latest is None or not behind:
                started = None
                continue
            if started is None:
                started, next_log = now, now + self.wait_log_s
            if now >= next_log:
                log.warning("weight delivery: %d server(s) not at version %d for %.0f s: %s", len(behind), latest,
                            now - started, "; ".join(s.describe(now) for s in behind))
                while next_log <= now:  # once per period, even after a pause of this thread
                    next_log += self.wait_log_s

    def step(self) -> bool:
        """One pass: refresh the roster, ask new servers their version, deliver to those behind. True when
        a round ran."""
        if self.publication.latest_version() is None:
            return False
        self._refresh_roster()
        self._ask_versions()
        with self.publication.lease() as snap:
            if snap is None:
                return False
            now = time.monotonic()
            with self._lock:
                due = sorted(u for u, s in self.servers.items() if s.version is not None
                             and s.version != snap.version and s.retry_at <= now)
            # Only those due are asked: a server set aside (its version unknown) is never waited for here.
            held = self.held(due) if self.held is not None and due else set()
            with self._lock:
                self._held = held
            behind = [u for u in due if u not in held]
            if not behind or self._stop.is_set():
                return False
            self._deliver(snap, behind)
        return True

    def _refresh_roster(self) -> None:
        roster = self.roster()
        with self._lock:
            for url in set(self.servers) - set(roster):
                log.info("weight delivery: %s is no longer announced (stopped, or found dead by its launcher)", url)
                del self.servers[url]
            for url, at in roster.items():
                old = self.servers.get(url)
                if old is None or old.announced_at != at:
                    if old is not None:
                        log.info("weight delivery: %s announced itself again (restarted)", url)
                    self.servers[url] = ServerState(url, at)

    def _ask_versions(self) -> None:
        """Take the /status answers that came in; ask the servers of unknown version that are not waiting out a
        retry. Never waits: a server that does not answer holds up no round of the others."""
        for url, (asked, probe) in list(self._probes.items()):
            if not probe.done():
                continue
            del self._probes[url]
            if self.servers.get(url) is not asked:  # announced anew (restarted) since: ask the new one
                continue
            answer = probe.result()
            if isinstance(answer, Exception):
                self._failed([url], self.publication.latest_version(), answer)
            else:
                with self._lock:
                    asked.version = answer if asked.version is None else asked.version
        now = time.monotonic()
        with self._lock:
            unknown = [(u, s) for u, s in self.servers.items() if s.version is None and s.retry_at <= now]
        for url, state in unknown:
            if url not in self._probes:
                self._probes[url] = (state, on_thread(lambda url=url: self._status(url), "delivery-status"))

    def _status(self, url: str) -> int | Exception:
        try:
            return self.control.status(url).version
        except ControlError as err:
            return err

    def _deliver(self, snap: Snapshot, behind: list[str]) -> None:
        started, members = time.monotonic(), behind
        try:
            if not self._group_usable(behind):
                members = self.sender.connect(behind)
                with self._lock:
                    self._group_roster = {u: self.servers[u].announced_at for u in members if u in self.servers}
                for url, why in self.sender.left_out.items():
                    self._failed([url], snap.version, ControlError(f"could not join the group: {why}"))
            result = self.sender.broadcast(snap.version, snap.metas, snap.tensors)
        except MembersLate as err:
            if not self._stop.is_set():
                self._set_aside(snap, members, err, time.monotonic() - started)
            return
        except (ControlError, TimeoutError, OSError, RuntimeError) as err:
            if self._stop.is_set():
                return
            culprits = [u for u in members if u in str(err)] or members
            self._failed(culprits, snap.version, err)
            self._report(DeliveryReport(snap.version, tuple(members), False, time.monotonic() - started,
                                        error=str(err)[:500]))
            log.warning("weight delivery of version %d to %s failed (%s back off): %s", snap.version,
                        ", ".join(members), ", ".join(culprits), err)
            return
        self._delivered(snap, result, time.monotonic() - started)

    def _group_usable(self, behind: list[str]) -> bool:
        """The open group has exactly the servers behind, none of them announced anew since it formed (a server
        restarted on the same address holds no group: its update would be refused with 409)."""
        with self._lock:
            same = all(u in self.servers and self.servers[u].announced_at == self._group_roster.get(u)
                       for u in self.sender.server_urls)
        return self.sender.connected and sorted(self.sender.server_urls) == behind and same

    def _set_aside(self, snap: Snapshot, members: list[str], err: MembersLate, total_s: float) -> None:
        """A round missed its deadline: the late members back off like failed ones; the others go on at once,
        at the version they answered with (the round's, if it reached them before it was abandoned)."""
        took = {url: r for url, r in err.answered.items() if isinstance(r, dict) and r.get("version") == snap.version}
        aside = [url for url in err.late if url not in took]  # a late one whose bytes had all arrived took it
        self._failed(aside, snap.version, err)
        with self._lock:
            for url, reply in took.items():
                self._took(url, reply)
        self._report(DeliveryReport(snap.version, tuple(members), False, total_s, error=str(err)[:500]))
        log.warning("weight delivery of version %d: %s; %s%s", snap.version, err,
                    f"set aside {', '.join(aside)}, going on without" if aside else "retrying",
                    f" ({', '.join(took)} took the version all the same)" if took else "")

    def _took(self, url: str, reply: dict) -> None:
        """Under the lock: `url` acknowledged a version (its reply)."""
        if url in self.servers:
            s = self.servers[url]
            s.version, s.failures, s.failed_versions, s.failing_since = reply["version"], 0, set(), None
            s.retry_at, s.last_error = 0.0, ""

    def _delivered(self, snap: Snapshot, result: dict, total_s: float) -> None:
        replies = result["servers"]
        with self._lock:
            for url, reply in replies.items():
                self._took(url, reply)
        self._report(DeliveryReport(
            snap.version, tuple(sorted(replies)), True, total_s, result.get("broadcast_s", 0.0), result["bytes"],
            result.get("dense_bytes", result["bytes"]), max((r.get("paused_s", 0.0) for r in replies.values()),
                                                             default=0.0), result.get("changed_fraction")))
        log.info("weight delivery: version %d to %s in %.3f s (published %.3f s before)", snap.version,
                 ", ".join(sorted(replies)), total_s, time.monotonic() - snap.published_at)

    def _failed(self, urls: list[str], version: int | None, err: Exception) -> None:
        now = time.monotonic()
        with self._lock:
            for url in urls:
                s = self.servers.get(url)
                if s is None:
                    continue
                s.failures += 1
                s.last_version = s.version if s.version is not None else s.last_version
                s.version = None  # ask again before the next round: it may have resumed on any version
                if version is not None:
                    s.failed_versions.add(version)
                s.failing_since = s.failing_since if s.failing_since is not None else now
                s.last_error = str(err)
                s.retry_at = now + min(RETRY_FIRST_S * 2 ** (s.failures - 1), RETRY_MAX_S)
            self._escalate(now)

    def _escalate(self, now: float) -> None:
        """Under the lock: DeliveryFailed when every announced server keeps failing (see the module)."""
        states = list(self.servers.values())
        if states and all(len(s.failed_versions) >= self.fail_after_versions and s.failing_since is not None
                          and now - s.failing_since >= self.fail_after_s for s in states):
            self.failure = DeliveryFailed(
                f"weight delivery failed to every server for {self.fail_after_versions} consecutive versions and "
                f"{self.fail_after_s:.0f} s (trainer.delivery_fail_after_versions, trainer.delivery_fail_after_s): "
                + "; ".join(f"{s.url}: {s.last_error[:300]}" for s in states))
            log.error("%s", self.failure)

    def _report(self, report: DeliveryReport) -> None:
        with self._lock:
            self._reports.append(report)


def held_servers(control: ControlClient, urls: list[str]) -> set[str]:
    """Those of `urls` held for an evaluation (their /status says so); one that does not answer within
    HELD_STATUS_S is not held (its round then misses its deadline or fails, and it is set aside like any other).
    The `held` callback of the evaluation servers' Delivery."""

    def held(url: str) -> bool:
        try:
            return control.status(url, HELD_STATUS_S).held_s > 0
        except ControlError:
            return False

    return {u for u, h in zip(urls, map_on_threads(held, urls, "delivery-held")) if h}

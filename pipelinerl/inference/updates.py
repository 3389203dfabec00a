"""Server side of the weight-update contract: the state machine behind the two control routes.

An update is: pause (keeping running requests) -> receive into staging -> load -> set version ->
resume. The engine does each step behind `UpdatableEngine` (vLLM's: `vllm_glue/control.py`); this
module has no engine imports. `kv_on_update` picks what running sequences do afterwards: `keep`
continues on their stale KV cache (the prefix cache must be off, since vLLM cannot reset it while
those requests hold blocks), `recompute` re-prefills them under the new weights.

A hold (`POST /hold`, ended by its deadline or `POST /release`) keeps the served weights on one version
while the actor evaluates on the server: updates answer 423 meanwhile, so an evaluation never mixes
policies. Joining a group stays allowed: it changes no weights.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Protocol

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from pipelinerl.config.inference import InferenceConfig
from pipelinerl.weights import InitRequest, UpdateRequest, parse_init_request, parse_update_request

log = logging.getLogger(__name__)


class UpdatableEngine(Protocol):
    """The update steps an inference engine provides, in the order `WeightUpdater` calls them."""

    num_ranks: int  # ranks the engine adds to the weight-update group

    async def set_version(self, version: int) -> None: ...  # tag tokens generated from now on

    async def join_group(self, req: InitRequest, staging: str) -> None: ...  # staging: host | device

    async def pause(self, recompute: bool) -> None: ...  # keep running requests; recompute: drop their KV

    async def receive(self, req: UpdateRequest) -> None: ...  # into staging; the served model is untouched

    async def load(self, version: int) -> None: ...  # staged weights into the model, tagged `version`

    async def resume(self) -> None: ...

    async def worker_timings(self) -> list[dict[str, float]]: ...  # per rank, of the latest update

    async def in_group(self) -> bool: ...  # every rank still holds its group (after a failed update)


class UpdateError(Exception):
    """A control request that failed; `status` is the HTTP status the route answers with, `details` more
    fields of its JSON body."""

    def __init__(self, status: int, message: str, **details):
        super().__init__(message)
        self.status, self.details = status, details


class _Metrics:
    """On vLLM's /metrics: it serves prometheus_client's default registry, where these go by default."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.version = Gauge("pipelinerl_weight_version", "Policy version of the served weights.", registry=r)
        self.updates = Counter("pipelinerl_weight_updates", "Completed in-flight weight updates.", registry=r)
        self.pause_total = Counter("pipelinerl_pause_seconds", "Seconds generation was paused for updates.",
                                   registry=r)
        self.last_pause = Gauge("pipelinerl_last_pause_seconds", "Pause of the latest update, in seconds.",
                                registry=r)


class WeightUpdater:
    """One per server. `expected` maps HF tensor names to shapes (read from the checkpoint); `staging` is
    where the engine stages an update before loading it (inference.update_staging: host | device)."""

    def __init__(self, engine: UpdatableEngine, expected: dict[str, list[int]], dtype: str, kv_on_update: str,
                 version: int, registry: CollectorRegistry = REGISTRY, staging: str = "host",
                 on_broken: Callable[[], None] = lambda: None, run: str = "",
                 clock: Callable[[], float] = time.monotonic, max_hold_s: float = InferenceConfig.max_hold_s):
        self.engine, self.expected, self.dtype, self.staging = engine, expected, dtype, staging
        self.run = run  # the run's public id (rundir.run_fingerprint), reported on /status
        # A load that fails part-way leaves the model half-updated: the server must stop rather than serve
        # it (or stay paused for good); on_broken asks it to (server.py: a graceful stop, exit status 1).
        self.on_broken, self.broken = on_broken, False
        self.kv_on_update, self.num_ranks, self.version = kv_on_update, engine.num_ranks, version
        self.group_ready = False
        self.delta_base: int | None = None  # the version the workers keep as the base of delta updates
        self._idle = asyncio.Event()  # set while no control operation runs (see `busy`); a hold waits on it
        self._idle.set()
        self.clock = clock  # of hold deadlines (tests pass a fake one)
        self.held_until = -math.inf  # clock time the hold ends (past or -inf: not held)
        self.max_hold_s = max_hold_s  # inference.max_hold_s: a longer hold is refused
        self.updates = 0
        self.pause_total_s = 0.0
        self.last_pause_s = 0.0
        self.metrics = _Metrics(registry)

    @property
    def busy(self) -> bool:
        """A control operation (update or init) is running: one at a time, the routes answer 409 meanwhile."""
        return not self._idle.is_set()

    async def start(self) -> None:
        await self.engine.set_version(self.version)
        self.metrics.version.set(self.version)

    def status(self) -> dict:
        return {"version": self.version, "num_ranks": self.num_ranks, "group_ready": self.group_ready,
                "updating": self.busy, "updates": self.updates, "pause_total_s": self.pause_total_s,
                "last_pause_s": self.last_pause_s, "kv_on_update": self.kv_on_update, "delta_base": self.delta_base,
                "update_staging": self.staging, "dtype": self.dtype, "tensors": self.expected, "run": self.run,
                "held_s": self._held_s()}

    async def init_group(self, body: object) -> dict:
        """Join the group a trainer opens. A new group replaces the current one once joined (the trainer
        re-forms its group when servers come and go; a restarted trainer opens a new one): the old trainer
        is dead or has left it. A failed join keeps the current group."""
        req = _parsed(parse_init_request, body)
        self._claim("join a weight-update group")
        try:
            await self.engine.join_group(req, self.staging)
        except Exception as err:
            self.group_ready = await self.engine.in_group()
            raise UpdateError(504, f"joining the weight group of {req.master_addr}:{req.master_port} "
                                   f"failed: {err}", group_ready=self.group_ready) from err
        finally:
            self._idle.set()
        replaced, self.group_ready = self.group_ready, True
        log.info("joined weight-update group %s of %s:%d as rank(s) %d..%d%s", req.group, req.master_addr,
                 req.master_port, req.rank_offset, req.rank_offset + self.num_ranks - 1,
                 " (it replaces the previous group)" if replaced else "")
        return {"status": "joined", "ranks": list(range(req.rank_offset, req.rank_offset + self.num_ranks))}

    async def update(self, body: object) -> dict:
        """Load the weights the trainer broadcasts over the group as a new version: pause (running requests are
        kept), receive into staging, load, set the version, resume. Refused during another operation or without a
        group (409), while held (423), for a delta against another base (412) or for tensors not the model's (422)."""
        req = _parsed(parse_update_request, body)
        self._check_tensors(req)
        if req.base_version is not None and req.base_version != self.delta_base:
            raise UpdateError(412, f"the update is a delta against version {req.base_version}, but this server's "
                                   f"delta base is {self.delta_base}: send it dense")
        if not self.group_ready:
            raise UpdateError(409, "no weight-update group: POST /init_process_group first")
        held_s = self._held_s()
        if held_s > 0:  # checked before claiming: a held server's weights never change
            raise UpdateError(423, f"cannot update: this server is held for evaluation at version {self.version} "
                                   f"for {held_s:.1f} more s (POST /release ends it)",
                              version=self.version, held_s=held_s)
        self._claim("start a weight update")
        try:
            return await self._run(req)
        finally:
            self._idle.set()

    async def hold(self, body: object) -> dict:
        """Keep the served version for `body["seconds"]` (or until `release`): updates answer 423 meanwhile. A
        running update or join is waited for, not refused (it is bounded by the group's timeout), so the
        version returned is the one served throughout. A hold while held replaces the deadline."""
        seconds = _hold_seconds(body, self.max_hold_s)
        while self.busy:
            await self._idle.wait()
        self.held_until = self.clock() + seconds
        log.info("held at version %d for %.1f s", self.version, seconds)
        return {"version": self.version, "held_s": seconds}

    async def release(self) -> dict:
        """End the hold; "held": whether one was still in force (not an error when none was)."""
        held = self._held_s() > 0
        self.held_until = -math.inf
        if held:
            log.info("released at version %d", self.version)
        return {"version": self.version, "held": held}

    def _held_s(self) -> float:
        return max(0.0, self.held_until - self.clock())

    def _claim(self, what: str) -> None:
        if self.busy:
            raise UpdateError(409, f"cannot {what}: another control operation (update or init) is running")
        self._idle.clear()

    def _check_tensors(self, req: UpdateRequest) -> None:
        names = {m.name for m in req.tensors}
        unknown = sorted(names - self.expected.keys())
        missing = sorted(self.expected.keys() - names)
        wrong = [f"{m.name}: got {m.dtype} {m.shape}, expected {self.dtype} {self.expected[m.name]}"
                 for m in req.tensors if m.name in self.expected
                 and (m.dtype != self.dtype or m.shape != self.expected[m.name])]
        problems = []
        if unknown:
            problems.append(f"unknown tensor names {unknown[:5]}")
        if missing:
            problems.append(f"{len(missing)} tensor(s) missing, e.g. {missing[:5]}")
        if wrong:
            problems.append(f"wrong dtype/shape: {wrong[:5]}")
        if problems:
            raise UpdateError(422, "; ".join(problems))

    async def _run(self, req: UpdateRequest) -> dict:
        t0 = time.monotonic()
        await self.engine.pause(recompute=self.kv_on_update == "recompute")
        t_paused = time.monotonic()
        try:
            await self.engine.receive(req)
        except Exception as err:
            self.delta_base = None  # the workers drop their base on any failure
            await self._resume_after_failure(t0)
            again = "" if self.group_ready else "; POST /init_process_group again before the next update"
            log.warning("weight update to version %d failed, resumed on version %d: %s", req.version, self.version,
                        err)
            raise UpdateError(504, f"weight update to version {req.version} failed: {err}. Resumed on the "
                                   f"old weights (version {self.version}){again}",
                              group_ready=self.group_ready, version=self.version) from err
        t_received = time.monotonic()
        try:
            await self.engine.load(req.version)
        except Exception as err:
            self.broken = True
            log.critical("loading weight version %d failed after it was received: %r. The model may be half "
                         "loaded: the server stops instead of serving it", req.version, err)
            self.on_broken()
            raise UpdateError(500, f"loading weight version {req.version} failed: {err}. The model may be half "
                                   "loaded, so this server stops; restart it (it starts from the latest "
                                   "checkpoint)") from err
        t_loaded = time.monotonic()
        self.delta_base = req.version if req.keep_base else None
        await self.engine.resume()
        t_resumed = time.monotonic()
        self._account(req.version, t_resumed - t0)
        workers = await self.engine.worker_timings()
        return {"version": self.version, "delta_base": self.delta_base, "pause_s": t_paused - t0,
                "receive_s": t_received - t_paused, "load_s": t_loaded - t_received, "resume_s": t_resumed - t_loaded,
                "paused_s": t_resumed - t0, "workers": workers}

    async def _resume_after_failure(self, t0: float) -> None:
        # The worker engine drops a group whose collective failed; ask rather than assume.
        self.group_ready = await self.engine.in_group()
        await self.engine.resume()
        paused_s = time.monotonic() - t0
        self.pause_total_s += paused_s
        self.metrics.pause_total.inc(paused_s)

    def _account(self, version: int, paused_s: float) -> None:
        self.version = version
        self.updates += 1
        self.pause_total_s += paused_s
        self.last_pause_s = paused_s
        self.metrics.version.set(version)
        self.metrics.updates.inc()
        self.metrics.pause_total.inc(paused_s)
        self.metrics.last_pause.set(paused_s)
        log.info("weight update: serving version %d (paused %.3f s)", version, paused_s)


def _hold_seconds(body: object, max_s: float) -> float:
    seconds = body.get("seconds") if isinstance(body, dict) else None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= max_s:
        raise UpdateError(400, f'bad request body: a hold takes {{"seconds": <a number > 0, at most {max_s:g} '
                               f'(inference.max_hold_s)>}}, got {str(body)[:200]}')
    return float(seconds)


def _parsed(parse, body: object):
    try:
        return parse(body)
    except (ValueError, TypeError) as err:
        raise UpdateError(400, f"bad request body: {err}") from err

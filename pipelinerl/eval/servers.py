"""Evaluation on the evaluation servers (inference.eval_servers): every score is one policy version's.

An evaluation server is a policy server that takes no training request (it announces itself in
RUN_DIR/eval_servers/); the trainer delivers each new version to it over a weight group of its own. The actor
runs one evaluation at a time (scheduler.py): it takes an evaluation server that serves a version due for one and
holds it (`POST /hold`, renewed every HOLD_S / 3 while it runs): a held server loads no weight update, and
the trainer's delivery leaves it alone until `POST /release`. Every suite is sampled there; then the scores are
kept only if every token came from the held version and the server was still held at the release (a server
that restarted meanwhile, or a hold that ran out, fails the check: the evaluation is dropped with a warning,
never logged as one version's). Evaluation thus never takes a training server's time or delays an update.

A hold lapses HOLD_S after its last renewal: an actor that dies mid-evaluation frees its server by then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import httpx

from pipelinerl import rundir
from pipelinerl.actor.client import CompletionsClient
from pipelinerl.config import Config
from pipelinerl.control import ControlError, hold_server, read_status, release_server
from pipelinerl.eval.sets import SampledItem, token_versions

log = logging.getLogger(__name__)

HOLD_S = 60.0  # a hold's length; renewed every HOLD_S / 3 while the evaluation runs
LOOK_EVERY_S = 1.0  # how often the actor reads the evaluation servers' versions while an evaluation is due
STATUS_TIMEOUT_S = 10.0

Sample = Callable[[httpx.AsyncClient, CompletionsClient], Awaitable[list[list[SampledItem]]]]


class EvalServers:
    """The actor's evaluation servers: `pick` finds one for a due evaluation, `evaluate` runs it there."""

    def __init__(self, cfg: Config, run: str):
        self.cfg, self.run = cfg, run  # run: the run's public id (rundir.run_fingerprint), checked per request
        self.token = rundir.run_token(cfg.run_dir, cfg.inference.auth_token)
        self.looked_at = 0.0

    async def pick(self, http: httpx.AsyncClient, due: int) -> tuple[str, int] | None:
        """An evaluation server that serves version `due` or newer, and its version; None when there is none (read
        at most every LOOK_EVERY_S: the trainer's delivery brings them up to date)."""
        if time.monotonic() - self.looked_at < LOOK_EVERY_S:
            return None
        self.looked_at = time.monotonic()
        for url in rundir.list_servers(self.cfg.run_dir, rundir.EVAL_SERVERS_DIR):
            try:
                status = await read_status(http, url, timeout_s=STATUS_TIMEOUT_S)
            except ControlError as err:
                log.info("evaluation server %s: no status (%s); trying the others", url, err)
                continue
            if status.version >= due and status.run in ("", self.run):
                return url, status.version
        return None

    async def evaluate(self, http: httpx.AsyncClient, url: str, sample: Sample
                       ) -> tuple[int, list[list[SampledItem]]] | None:
        """Hold `url`, sample every suite there (`sample(http, client)`), release it: (the held version, the
        suites' items), or None when the evaluation failed (a server error after the client's retries) or the check
        of the module's docstring did (both logged): training goes on either way."""
        try:
            version, results, released = await self._held(http, url, sample)
        except (ControlError, RuntimeError, httpx.HTTPError) as err:
            log.warning("evaluation on %s failed, dropped: %s", url, err)
            return None
        seen = sorted({v for suite in results for item in suite for v in token_versions(item)})
        if seen not in ([], [version]) or not released.get("held") or released.get("version") != version:
            log.warning("evaluation on %s dropped: it held version %d, but its tokens came from versions %s and at "
                        "the release it %s (a restart or a lapsed hold)", url, version, seen,
                        f"was held at version {released.get('version')}" if released.get("held") else "was not held")
            return None
        return version, results

    async def _held(self, http: httpx.AsyncClient, url: str, sample: Sample
                    ) -> tuple[int, list[list[SampledItem]], dict]:
        """(the version held, the suites sampled, the release's reply). A renewal that fails (the server died or
        hangs) ends the evaluation with its ControlError: the client would otherwise wait for the server's return."""
        version = int((await hold_server(http, url, self.token, HOLD_S))["version"])
        client = CompletionsClient(self.cfg.actor, self.cfg.run_dir, reference=False, run=self.run, only=url)
        work, renew = asyncio.ensure_future(sample(http, client)), asyncio.ensure_future(self._renew(http, url))
        try:
            await asyncio.wait({work, renew}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, renew):
                task.cancel()
            await asyncio.gather(work, renew, return_exceptions=True)
        error = renew.exception() if work.cancelled() else work.exception()
        if error is not None:
            with contextlib.suppress(ControlError):
                await release_server(http, url, self.token)  # free it now, not when the hold lapses
            raise error
        return version, work.result(), await release_server(http, url, self.token)

    async def _renew(self, http: httpx.AsyncClient, url: str) -> None:
        """Extend the hold every HOLD_S / 3 until cancelled; ControlError when the server refuses or does not answer."""
        while True:
            await asyncio.sleep(HOLD_S / 3)
            await hold_server(http, url, self.token, HOLD_S, timeout_s=HOLD_S / 3)

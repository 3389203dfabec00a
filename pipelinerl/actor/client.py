"""The completions client: token ids in, completions out, from the servers announced in the run directory.

It knows the servers' HTTP API (vLLM's `/v1/completions` plus `policy_versions`, `/status`, and a reward
server's `/classify`), picks the least-loaded server, retries a failed request on another one, and parses
choices into `Completion`s and classifications into scores. It knows nothing of tasks or the stream.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import numpy as np

from pipelinerl.actor.pool import ServerPool
from pipelinerl.actor.transport import request_slot
from pipelinerl.config import ActorConfig
from pipelinerl.control import ControlError, read_status
from pipelinerl.rundir import EVAL_SERVERS_DIR, REFERENCE_SERVERS_DIR, REWARD_SERVERS_DIR
from pipelinerl.waits import WaitLog

log = logging.getLogger(__name__)

STATUS_TIMEOUT_S = 10.0  # serving_version's read of one server's /status; a server that misses it is set aside
PEER_GRACE_S = 3.0  # ... and how long after another server answered (see serving_version)
PROBE_EVERY_S = 5.0  # the watcher's period (at most; see CompletionsClient), also its probe's timeout
# The client drops a connection idle for KEEPALIVE_S, well below the servers' keep-alive (vLLM's
# VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s). With httpx's default, also 5 s, a request could go out on a connection
# the server was closing: it failed with ReadError and set a healthy server aside (seen a few times per run).
KEEPALIVE_S = 2.0
ACQUIRE_EVERY_S = 1.0  # a request that no server may take looks again this often


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str
    finished: bool  # ended by EOS (or a stop string), not by the length limit
    reference_logprobs: list[float] = field(default_factory=list)  # per token; empty: no reference model
    teacher_top_ids: list[int] = field(default_factory=list)  # rl.teacher_top_k: k per token, flattened; else empty
    teacher_top_logprobs: list[float] = field(default_factory=list)  # their log-probs under the teacher, aligned
    routed_experts: np.ndarray | None = None  # inference.return_routed_experts: [tokens, MoE layers, k] ids


class _Moved(Exception):
    """A request's server was set aside while the request was in flight."""


async def _unless_set(work, moved: asyncio.Event):
    """The result of the awaitable `work`, or _Moved once `moved` is set first (`work` is then cancelled)."""
    task, waiter = asyncio.ensure_future(work), asyncio.ensure_future(moved.wait())
    try:
        done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    await asyncio.wait({task})  # the cancelled request closes its connection
    raise _Moved


class CompletionsClient:
    """Requests to the run's policy servers and, when `reference` is set, to its reference servers
    (RUN_DIR/reference_servers/), when `reward` is set, to its reward servers (RUN_DIR/reward_servers/).
    Every call takes the caller's `httpx.AsyncClient`. With `max_lag` (in
    versions; None: no bound) only servers within max_lag of the newest version take requests (ServerPool):
    call `serving_version` before the first request, and then often, to learn their versions.

    While requests are in flight a watcher task re-lists the servers (a removed discovery file moves that
    server's requests) and probes every policy server with requests in flight (GET /status); one silent for
    `actor.server_silence_s` is set aside and its requests move to other servers. Reference and reward servers
    have no /status: they are not probed (a failed or timed-out request moves to another one)."""

    def __init__(self, cfg: ActorConfig, run_dir: str, reference: bool, max_lag: int | None = None,
                 reward: bool = False, run: str = "", only: str | None = None):
        self.cfg, self.run = cfg, run  # run: this run's public id (rundir.run_fingerprint); "": not checked
        # only: a client of that one evaluation server (RUN_DIR/eval_servers) instead of the policy servers
        self.pool = (ServerPool(run_dir, max_lag=max_lag, readmit_on_status=True) if only is None else
                     ServerPool(run_dir, folder=EVAL_SERVERS_DIR, readmit_on_status=True, only=only))
        self.reference_pool = ServerPool(run_dir, folder=REFERENCE_SERVERS_DIR) if reference else None
        self.reward_pool = ServerPool(run_dir, folder=REWARD_SERVERS_DIR) if reward else None
        # One wait line per pool for all its waiting requests (_acquire), not one per request.
        self.waits = {pool: WaitLog(cfg.wait_log_s, log, functools.partial(_wait_line, pool))
                      for pool in self._pools()}
        # The probe's period, and its timeout: a few probes fit in the silence that sets a server aside.
        self.probe_every_s = min(PROBE_EVERY_S, cfg.server_silence_s / 2)
        self._watcher: asyncio.Task | None = None

    async def complete(self, http: httpx.AsyncClient, prompt_ids: list[int], greedy: bool, n: int = 1,
                       temperature: float | None = None, min_version: int | None = None,
                       max_tokens: int | None = None, priority: int = 0,
                       stop: Sequence[str] = ()) -> list[Completion]:
        """n completions of one prompt in one request (the server shares the prompt's prefill), sampled at
        `temperature` (None: actor.sampling.temperature) unless greedy. The log-probs are those of the
        distribution sampled (the servers' processed log-probs: tempered, EOS suppressed below min_tokens).
        `min_version`: only a server that reported at least this version takes the request, retries included
        (the lag bound of the group: a retry must not land on a server restarted on an older checkpoint).
        `max_tokens`: the length limit (None: actor.sampling.max_new_tokens). `priority`: vLLM's request priority
        (lower is scheduled first; training 0, evaluation actor.eval_priority). `stop`: strings that end a
        completion besides EOS (its token ids run to the token that completes one)."""
        s = self.cfg.sampling
        temperature = s.temperature if temperature is None else temperature
        # No "model": servers of one run may serve different folders (a resumed run serves the latest
        # checkpoint's), and vLLM then uses the one model it serves.
        body = {"prompt": prompt_ids, "max_tokens": s.max_new_tokens if max_tokens is None else max_tokens, "n": n,
                "temperature": 0.0 if greedy else temperature, "top_p": 1.0 if greedy else s.top_p,
                "min_tokens": 0 if greedy else s.min_new_tokens,
                "logprobs": 0, "return_token_ids": True, "skip_special_tokens": True, "priority": priority,
                **({"stop": list(stop)} if stop else {})}
        return [_parse_choice(c) for c in await self._post_completions(http, self.pool, body, min_version)]

    async def score_rewards(self, http: httpx.AsyncClient, inputs: list[list[int]] | list[str]) -> list[float]:
        """The reward model's probability for each input (token ids or text: a prompt and its completion), in
        one request to a reward server (vLLM's `POST /classify`: sigmoid of the one-logit classifier), retried on
        another one like a completion. The same inputs score the same on any server: a retry changes nothing."""
        assert self.reward_pool is not None, "score_rewards needs a client built with reward=True"
        reply = await self._post(http, self.reward_pool, "/classify", {"input": inputs})
        data = sorted(reply.get("data") or [], key=lambda d: d["index"])
        if [d["index"] for d in data] != list(range(len(inputs))) or any(len(d["probs"]) != 1 for d in data):
            raise ValueError(f"a reward server answered {json.dumps(reply)[:300]} to {len(inputs)} inputs: expected "
                             "one probability each (reward.model_path must be a classifier with one logit)")
        return [float(d["probs"][0]) for d in data]

    async def chat(self, http: httpx.AsyncClient, body: dict) -> dict:
        """A judge server's chat completion of `body` (`POST /v1/chat/completions` to a reward server of
        reward.kind=judge, retried on another one like a completion): its JSON reply."""
        assert self.reward_pool is not None, "chat needs a client built with reward=True"
        return await self._post(http, self.reward_pool, "/v1/chat/completions", body)

    async def judge(self, http: httpx.AsyncClient, messages: list[dict], max_tokens: int) -> str:
        """A judge's greedy answer to one chat (`chat`)."""
        reply = await self.chat(http, {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0})
        try:
            return reply["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"a judge answered {json.dumps(reply)[:300]}: expected one chat choice") from None

    async def score_reference(self, http: httpx.AsyncClient, prompt_ids: list[int], completions: list[Completion],
                              top_k: int = 0) -> None:
        """Fill each completion's `reference_logprobs`: one request of G prompts (prompt + completion) to a
        reference server, asking for the log-prob of every prompt token given those before it
        (`prompt_logprobs: 0` returns just the token's own); the one generated token is discarded. top_k > 0
        (rl.teacher_top_k) also fills `teacher_top_ids` / `teacher_top_logprobs` with the k likeliest tokens at
        each completion position (vLLM returns them with `prompt_logprobs: k`, beside the token's own)."""
        assert self.reference_pool is not None, "score_reference needs a client built with reference=True"
        body = {"prompt": [prompt_ids + c.token_ids for c in completions], "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": top_k}
        choices = await self._post_completions(http, self.reference_pool, body)
        if len(choices) != len(completions):
            raise ValueError(f"a reference server answered {len(choices)} choices to {len(completions)} prompts")
        for c, choice in zip(completions, choices):
            c.reference_logprobs = _completion_logprobs(choice, len(prompt_ids), c.token_ids)
            if top_k:
                c.teacher_top_ids, c.teacher_top_logprobs = _top_k(choice["prompt_logprobs"][len(prompt_ids):], top_k)

    def has_servers(self) -> bool:
        """Whether any policy server is announced (and not set aside after a failure)."""
        return bool(self.pool.refresh())

    async def serving_version(self, http: httpx.AsyncClient) -> int:
        """The policy version every eligible policy server serves: the oldest one they report on /status
        (-1: none answered). A request goes to any of them, so only this version bounds the lag of its
        tokens; a server further behind takes no request and does not count. A server that does not answer
        is set aside like one that failed a request (its requests in flight move to other servers): within
        STATUS_TIMEOUT_S, or PEER_GRACE_S after another server answered (a stopped server among healthy ones
        would otherwise hold the version, and so the actor's lag bound, for the whole STATUS_TIMEOUT_S)."""
        reads = {asyncio.ensure_future(read_status(http, url, timeout_s=STATUS_TIMEOUT_S)): url
                 for url in self.pool.refresh()}
        pending, grace_ends = set(reads), None
        while pending:
            left = None if grace_ends is None else max(0.0, grace_ends - time.monotonic())
            done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                break
            for read in done:
                self._status_read(reads[read], read)
            if grace_ends is None and any(not r.exception() for r in done):
                grace_ends = time.monotonic() + PEER_GRACE_S
        for read in pending:
            read.cancel()
            log.warning("%s did not answer GET /status %.0f s after another server did (set aside)", reads[read],
                        PEER_GRACE_S)
            self.pool.set_aside(reads[read], f"no answer to GET /status {PEER_GRACE_S:g} s after another server's")
        return min((self.pool.versions[u] for u in self.pool.eligible() if u in self.pool.versions), default=-1)

    def _status_read(self, url: str, read: asyncio.Future) -> None:
        """One server's /status read, done: its version heard, or the server set aside."""
        err = read.exception()
        if err is not None:
            if not isinstance(err, ControlError):
                raise err
            log.warning("could not read the version of %s (set aside): %s", url, err)
            self.pool.set_aside(url, f"GET /status failed: {err}")
            return
        status = read.result()
        if not self.foreign(url, status.run):
            self.pool.heard(url, status.version)

    def foreign(self, url: str, run: str) -> bool:
        """Whether the server at `url` reports another run than ours (then set aside, with an error: another run
        took its host and port, e.g. two runs on one machine with one inference.base_port). A server that
        reports no run is taken at its word."""
        if not (self.run and run and run != self.run):
            return False
        log.error("server %s serves another run (its /status says run %s, ours is %s): another run is on its port "
                  "(give each run on a machine its own inference.base_port); it takes no request of ours", url,
                  run, self.run)
        self.pool.set_aside(url, f"it serves another run ({run})")
        return True

    async def _post_completions(self, http: httpx.AsyncClient, pool: ServerPool, body: dict,
                                min_version: int | None = None) -> list[dict]:
        """POST /v1/completions (see `_post`) and return the choices in index order."""
        reply = await self._post(http, pool, "/v1/completions", body, min_version)
        return sorted(reply["choices"], key=lambda c: c["index"])

    async def _post(self, http: httpx.AsyncClient, pool: ServerPool, route: str, body: dict,
                    min_version: int | None = None) -> dict:
        """POST `route` to the pool's least-loaded server (of at least `min_version`) and return its JSON reply;
        retried on another server (bounded) when the request fails, times out, or its server is set aside
        meanwhile (ServerPool.set_aside). Each attempt first takes one of the client's request slots
        (transport.request_slot), then picks its server."""
        a = self.cfg
        tried: set[str] = set()
        for attempt in range(a.max_retries + 1):
            async with request_slot(http):  # beyond the slots (transport.py) it waits here, in no timeout
                url = await self._acquire(http, pool, tried, min_version)
                tried.add(url)
                moved = pool.track(url)
                self._watch(http)
                try:
                    resp = await _unless_set(http.post(f"{url}{route}", json=body, timeout=a.request_timeout_s),
                                             moved)
                    resp.raise_for_status()
                except _Moved:
                    pool.release(url, failed=False, moved=moved)  # set aside already
                    detail = f"moved off {url}: {pool.aside.get(url, (0, 'set aside'))[1]}"
                    log.info("a request on %s moves to another server (attempt %d/%d)", url, attempt + 1,
                             a.max_retries + 1)
                    continue
                except httpx.HTTPError as err:
                    pool.release(url, failed=not await self._dropped_by_live(http, pool, url, err), moved=moved)
                    detail = (f"{err!r}: {err.response.text[:500]}" if isinstance(err, httpx.HTTPStatusError)
                              else repr(err))
                    log.warning("%s on %s failed (attempt %d/%d): %s", route, url, attempt + 1, a.max_retries + 1,
                                detail)
                    continue
                pool.release(url, failed=False, moved=moved)
                pool.heard(url)
                return resp.json()
        raise RuntimeError(f"POST {route} failed on the {pool.kind} servers {sorted(tried)} after "
                           f"{a.max_retries + 1} attempts: {detail}")

    async def _dropped_by_live(self, http: httpx.AsyncClient, pool: ServerPool, url: str, err: httpx.HTTPError) -> bool:
        """Whether `err` is a connection a policy server closed under the request (no response) while the server
        still answers GET /status: then it is not set aside (that would idle a one-server run for retry_after_s)
        and the request is retried at once. A dead server's closed connection fails that probe."""
        if pool.folder in (REFERENCE_SERVERS_DIR, REWARD_SERVERS_DIR):  # they have no /status to ask
            return False
        if not isinstance(err, (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError)):
            return False
        try:
            await read_status(http, url, timeout_s=self.probe_every_s)
        except ControlError:
            return False
        return True

    async def _acquire(self, http: httpx.AsyncClient, pool: ServerPool, avoid: set[str],
                       min_version: int | None) -> str:
        """A server for the next attempt (ServerPool.acquire), waiting while none may take it: none announced
        (yet, or any more: the launcher restarts them), none eligible, or none of `min_version`. Every
        `actor.wait_log_s` of waiting the pool's WaitLog logs what its waiting requests wait for, in one line."""
        url = pool.acquire(avoid=avoid, min_version=min_version)
        if url is not None:
            return url
        waits = self.waits[pool]
        with waits.waiting(time.monotonic(), min_version):
            while url is None:
                if pool is self.pool and pool.refresh():  # versions to read, servers back from being set aside
                    await self.serving_version(http)
                    url = pool.acquire(avoid=avoid, min_version=min_version)
                    if url is not None:
                        break
                waits.poll(time.monotonic())
                await asyncio.sleep(ACQUIRE_EVERY_S)
                url = pool.acquire(avoid=avoid, min_version=min_version)
        return url

    def _watch(self, http: httpx.AsyncClient) -> None:
        """Start the watcher (see the class) unless it runs; it ends once no request is in flight."""
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.ensure_future(self._watch_servers(http))

    def _pools(self) -> list[ServerPool]:
        return [pool for pool in (self.pool, self.reference_pool, self.reward_pool) if pool is not None]

    async def _watch_servers(self, http: httpx.AsyncClient) -> None:
        took = 0.0
        while True:
            await asyncio.sleep(self.probe_every_s - took)  # one round per period, a silent server's included
            if http.is_closed or not any(p.busy() for p in self._pools()):
                return
            started = time.monotonic()
            for pool in self._pools():
                pool.refresh()  # a removed discovery file moves that server's requests
            await asyncio.gather(*map(functools.partial(self._probe, http), self.pool.busy()))
            took = min(time.monotonic() - started, self.probe_every_s)

    async def _probe(self, http: httpx.AsyncClient, url: str) -> None:
        """GET /status of a policy server with requests in flight; set it aside once silent too long."""
        try:
            status = await read_status(http, url, timeout_s=self.probe_every_s)
        except ControlError as err:
            silent = self.pool.silent_s(url)
            if silent >= self.cfg.server_silence_s and self.pool.busy_on(url):
                self.pool.set_aside(url, f"no answer for {silent:.0f} s, actor.server_silence_s="
                                         f"{self.cfg.server_silence_s:g}: {err}")
            return
        if not self.foreign(url, status.run):
            self.pool.heard(url, status.version)


def _wait_line(pool: ServerPool, oldest_s: float, count: int, min_version: int | None) -> str:
    """The line of a pool's WaitLog: the pool as it is now (ServerPool.describe), for the oldest request's need."""
    return (f"{count} request(s) wait for a {pool.kind} server, the oldest for {oldest_s:.0f} s: it "
            f"{pool.describe(min_version)}")


def _parse_choice(choice: dict) -> Completion:
    token_ids = list(choice["token_ids"])
    logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
    versions = list(choice["policy_versions"])
    if not (len(token_ids) == len(logprobs) == len(versions)):
        raise ValueError(f"server returned {len(token_ids)} tokens, {len(logprobs)} log-probs and "
                         f"{len(versions)} versions: {json.dumps(choice)[:300]}")
    routed = choice.get("routed_experts")
    routed = None if routed is None else decode_routed_experts(routed)
    if routed is not None and len(routed) != len(token_ids):
        raise ValueError(f"server returned {len(token_ids)} tokens and routed experts for {len(routed)}: "
                         f"{json.dumps(choice)[:300]}")
    return Completion(token_ids, logprobs, versions, choice.get("text") or "",
                      finished=choice.get("finish_reason") == "stop", routed_experts=routed)


def decode_routed_experts(field: dict) -> np.ndarray:
    """A choice's `routed_experts` ({"dtype", "shape", "data": base64 of the ids' little-endian bytes}, the
    policy servers' field with inference.return_routed_experts) as a [tokens, layers, k] array."""
    ids = np.frombuffer(base64.b64decode(field["data"]), dtype=np.dtype(field["dtype"]))
    return ids.reshape(field["shape"])


def _completion_logprobs(choice: dict, prompt_len: int, token_ids: list[int]) -> list[float]:
    """The log-probs of `token_ids` (the completion, from position `prompt_len` on) in a choice's
    `prompt_logprobs`: one {token id (a JSON string): {"logprob": ...}} per position (None first)."""
    positions = choice.get("prompt_logprobs") or []
    if len(positions) != prompt_len + len(token_ids):
        raise ValueError(f"a reference server returned {len(positions)} prompt log-probs for a sequence of "
                         f"{prompt_len + len(token_ids)} tokens")
    return [float(positions[prompt_len + i][str(t)]["logprob"]) for i, t in enumerate(token_ids)]


def _top_k(positions: list[dict], k: int) -> tuple[list[int], list[float]]:
    """The k likeliest tokens of each of `positions` (a choice's `prompt_logprobs` entries: {token id: {"logprob",
    "rank"}}; vLLM's ranks 1..k, the sampled token's own entry left out when it is not among them), flattened
    position by position, with their log-probs."""
    ids, logprobs = [], []
    for i, pos in enumerate(positions):
        top = sorted((v["rank"], int(t), float(v["logprob"])) for t, v in pos.items() if v.get("rank", k + 1) <= k)
        if len(top) != k:
            raise ValueError(f"a reference server returned {len(top)} top tokens at completion position {i}, "
                             f"expected rl.teacher_top_k={k} (above its --max-logprobs, or the vocabulary's size?)")
        ids += [t for _, t, _ in top]
        logprobs += [lp for _, _, lp in top]
    return ids, logprobs

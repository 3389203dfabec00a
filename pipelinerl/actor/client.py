"""The completions client: token ids in, completions out, from the servers announced in the run directory.

It knows the servers' HTTP API (vLLM's `/v1/completions` plus `policy_versions`, and `/status`), picks the
least-loaded server, retries a failed request on another one, and parses choices into `Completion`s. It
knows nothing of tasks, rewards or the stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

import httpx

from pipelinerl.config import ActorConfig
from pipelinerl.inference.rundir import REFERENCE_SERVERS_DIR, SERVERS_DIR, list_servers

log = logging.getLogger(__name__)


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str
    finished: bool  # ended by EOS (or a stop string), not by the length limit
    reference_logprobs: list[float] = field(default_factory=list)  # per token; empty: no reference model


class ServerPool:
    """The servers announced in RUN_DIR/<folder>/, least-loaded first. A server that fails is set aside
    until it is announced again after `retry_after_s` (a restarted server re-publishes its file).

    With a lag bound (`max_lag` not None) only eligible servers take requests: those whose last reported
    version (`versions`, filled by CompletionsClient.serving_version) is at least the newest one reported
    minus `max_lag`. A server with no report yet, e.g. just restarted on an old checkpoint or back from
    being set aside, is not eligible until it reports a recent version. None: every announced server."""

    def __init__(self, run_dir: str, retry_after_s: float = 10.0, folder: str = SERVERS_DIR,
                 max_lag: int | None = None):
        self.run_dir, self.retry_after_s, self.folder, self.max_lag = run_dir, retry_after_s, folder, max_lag
        self.load: dict[str, int] = {}
        self.failed_at: dict[str, float] = {}
        self.versions: dict[str, int] = {}  # url -> the policy version it last reported
        self.behind: set[str] = set()  # servers known to be too far behind (logged once each time)

    def refresh(self) -> list[str]:
        now = time.monotonic()
        announced = [u for u in list_servers(self.run_dir, self.folder)
                     if now - self.failed_at.get(u, -1e9) > self.retry_after_s]
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

    def release(self, url: str, failed: bool) -> None:
        self.load[url] = max(0, self.load.get(url, 0) - 1)
        if failed:
            self.set_aside(url)

    def set_aside(self, url: str) -> None:
        self.failed_at[url] = time.monotonic()


class CompletionsClient:
    """Requests to the run's policy servers and, when `reference` is set, to its reference servers
    (RUN_DIR/reference_servers/). Every call takes the caller's `httpx.AsyncClient`. With `max_lag` (in
    versions; None: no bound) only servers within max_lag of the newest version take requests (ServerPool):
    call `serving_version` before the first request, and then often, to learn their versions."""

    def __init__(self, cfg: ActorConfig, run_dir: str, reference: bool, max_lag: int | None = None):
        self.cfg = cfg
        self.pool = ServerPool(run_dir, max_lag=max_lag)
        self.reference_pool = ServerPool(run_dir, folder=REFERENCE_SERVERS_DIR) if reference else None

    async def complete(self, http: httpx.AsyncClient, prompt_ids: list[int], greedy: bool, n: int = 1,
                       temperature: float | None = None, min_version: int | None = None) -> list[Completion]:
        """n completions of one prompt in one request (the server shares the prompt's prefill), sampled at
        `temperature` (None: actor.sampling.temperature) unless greedy. The log-probs are those of the
        distribution sampled (the servers' processed log-probs: tempered, EOS suppressed below min_tokens).
        `min_version`: only a server that reported at least this version takes the request, retries included
        (the lag bound of the group: a retry must not land on a server restarted on an older checkpoint)."""
        s = self.cfg.sampling
        temperature = s.temperature if temperature is None else temperature
        # No "model": servers of one run may serve different folders (a resumed run serves the latest
        # checkpoint's), and vLLM then uses the one model it serves.
        body = {"prompt": prompt_ids, "max_tokens": s.max_new_tokens, "n": n,
                "temperature": 0.0 if greedy else temperature, "top_p": 1.0 if greedy else s.top_p,
                "min_tokens": 0 if greedy else s.min_new_tokens,
                "logprobs": 0, "return_token_ids": True, "skip_special_tokens": True}
        return [_parse_choice(c) for c in await self._post_completions(http, self.pool, body, min_version)]

    async def score_reference(self, http: httpx.AsyncClient, prompt_ids: list[int],
                              completions: list[Completion]) -> None:
        """Fill each completion's `reference_logprobs`: one request of G prompts (prompt + completion) to a
        reference server, asking for the log-prob of every prompt token given those before it
        (`prompt_logprobs: 0` returns just the token's own); the one generated token is discarded."""
        assert self.reference_pool is not None, "score_reference needs a client built with reference=True"
        body = {"prompt": [prompt_ids + c.token_ids for c in completions], "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": 0}
        choices = await self._post_completions(http, self.reference_pool, body)
        if len(choices) != len(completions):
            raise ValueError(f"a reference server answered {len(choices)} choices to {len(completions)} prompts")
        for c, choice in zip(completions, choices):
            c.reference_logprobs = _completion_logprobs(choice, len(prompt_ids), c.token_ids)

    def has_servers(self) -> bool:
        """Whether any policy server is announced (and not set aside after a failure)."""
        return bool(self.pool.refresh())

    async def serving_version(self, http: httpx.AsyncClient) -> int:
        """The policy version every eligible policy server serves: the oldest one they report on /status
        (-1: none answered). A request goes to any of them, so only this version bounds the lag of its
        tokens; a server further behind takes no request and does not count. A server that does not answer
        is set aside like one that failed a request."""
        async def one(url: str) -> int | None:
            try:
                resp = await http.get(f"{url}/status", timeout=10.0)
                resp.raise_for_status()
                return int(resp.json()["version"])
            except (httpx.HTTPError, KeyError, ValueError) as err:
                log.warning("could not read the version of %s (set aside): %r", url, err)
                self.pool.set_aside(url)
                return None

        urls = self.pool.refresh()
        for url, version in zip(urls, await asyncio.gather(*map(one, urls))):
            if version is not None:
                self.pool.versions[url] = version
        return min((self.pool.versions[u] for u in self.pool.eligible() if u in self.pool.versions), default=-1)

    async def _post_completions(self, http: httpx.AsyncClient, pool: ServerPool, body: dict,
                                min_version: int | None = None) -> list[dict]:
        """POST /v1/completions to the pool's least-loaded server (of at least `min_version`) and return the
        choices in index order; retried on another server (bounded) when the request fails or times out."""
        a = self.cfg
        tried: set[str] = set()
        for attempt in range(a.max_retries + 1):
            url = pool.acquire(avoid=tried, min_version=min_version)
            waited = 0
            while url is None:  # none announced (yet, or any more: the launcher restarts them), or none eligible
                if (pool.max_lag is not None or min_version is not None) and pool.refresh():  # versions to read
                    await self.serving_version(http)
                    url = pool.acquire(avoid=tried, min_version=min_version)
                    if url is not None:
                        break
                waited += 1
                if waited % 60 == 0:
                    log.warning("no %s server%s to take a request for %d s (announced: %s)", pool.folder,
                                "" if min_version is None else f" at version >= {min_version}", waited,
                                ", ".join(pool.refresh()) or "none")
                await asyncio.sleep(1.0)
                url = pool.acquire(avoid=tried, min_version=min_version)
            tried.add(url)
            try:
                resp = await http.post(f"{url}/v1/completions", json=body, timeout=a.request_timeout_s)
                resp.raise_for_status()
            except httpx.HTTPError as err:
                pool.release(url, failed=True)
                detail = f"{err!r}: {err.response.text[:500]}" if isinstance(err, httpx.HTTPStatusError) else repr(err)
                log.warning("completion on %s failed (attempt %d/%d): %s", url, attempt + 1, a.max_retries + 1, detail)
                continue
            pool.release(url, failed=False)
            return sorted(resp.json()["choices"], key=lambda c: c["index"])
        raise RuntimeError(f"a completion failed on {sorted(tried)} after {a.max_retries + 1} attempts: {detail}")


def _parse_choice(choice: dict) -> Completion:
    token_ids = list(choice["token_ids"])
    logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
    versions = list(choice["policy_versions"])
    if not (len(token_ids) == len(logprobs) == len(versions)):
        raise ValueError(f"server returned {len(token_ids)} tokens, {len(logprobs)} log-probs and "
                         f"{len(versions)} versions: {json.dumps(choice)[:300]}")
    return Completion(token_ids, logprobs, versions, choice.get("text") or "",
                      finished=choice.get("finish_reason") == "stop")


def _completion_logprobs(choice: dict, prompt_len: int, token_ids: list[int]) -> list[float]:
    """The log-probs of `token_ids` (the completion, from position `prompt_len` on) in a choice's
    `prompt_logprobs`: one {token id (a JSON string): {"logprob": ...}} per position (None first)."""
    positions = choice.get("prompt_logprobs") or []
    if len(positions) != prompt_len + len(token_ids):
        raise ValueError(f"a reference server returned {len(positions)} prompt log-probs for a sequence of "
                         f"{prompt_len + len(token_ids)} tokens")
    return [float(positions[prompt_len + i][str(t)]["logprob"]) for i, t in enumerate(token_ids)]

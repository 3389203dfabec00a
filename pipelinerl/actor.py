"""`pipelinerl actor`: prompts in, G attempts each, rewards, whole groups out to the rollout stream.

Token in, token out: the actor tokenizes each prompt once with the model's chat template and sends the
ids to `/v1/completions`; the servers return completion token ids, their log-probs and the policy
version of every token (`policy_versions`), which go to the stream unchanged: no re-tokenisation
between generation and training.

Lag throttle. The trainer takes samples in stream order, `samples_per_step` (S) per optimizer step, so
the i-th sample written is trained at step floor(i / S). Starting sample i only once the servers serve
version v >= floor(i / S) - max_lag bounds the lag of every token by max_lag (its version is >= v).
With max_lag = 0 the actor generates step k's batch only with version-k weights: synchronous
on-policy RL. The bound is exact when groups finish in the order they started; the trainer's
`rl.max_token_lag` drops any token that still exceeds it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass

import httpx

from pipelinerl.config import Config
from pipelinerl.inference.rundir import list_servers
from pipelinerl.streams import ROLLOUT_TOPIC
from pipelinerl.tasks import PromptItem, get_task

log = logging.getLogger(__name__)

EVAL_TOPIC = "eval"  # held-out evaluation completions, for analysis


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str
    finished: bool  # ended by EOS (or a stop string), not by the length limit


class ServerPool:
    """The servers announced in RUN_DIR/servers/, least-loaded first. A server that fails is set aside
    until it is announced again after `retry_after_s` (a restarted server re-publishes its file)."""

    def __init__(self, run_dir: str, retry_after_s: float = 10.0):
        self.run_dir, self.retry_after_s = run_dir, retry_after_s
        self.load: dict[str, int] = {}
        self.failed_at: dict[str, float] = {}

    def refresh(self) -> list[str]:
        now = time.monotonic()
        announced = [u for u in list_servers(self.run_dir) if now - self.failed_at.get(u, -1e9) > self.retry_after_s]
        for url in announced:
            self.load.setdefault(url, 0)
        for url in list(self.load):
            if url not in announced and self.load[url] == 0:
                del self.load[url]
        return announced

    def acquire(self, avoid: set[str]) -> str | None:
        candidates = [u for u in self.refresh() if u not in avoid] or self.refresh()
        if not candidates:
            return None
        url = min(candidates, key=lambda u: self.load[u])
        self.load[url] += 1
        return url

    def release(self, url: str, failed: bool) -> None:
        self.load[url] = max(0, self.load.get(url, 0) - 1)
        if failed:
            self.failed_at[url] = time.monotonic()


class Actor:
    def __init__(self, cfg: Config, actor_id: str = "actor0"):
        from transformers import AutoTokenizer

        from pipelinerl.metrics import Scalars
        from pipelinerl.streams import StreamWriter

        self.cfg, self.actor_id = cfg, actor_id
        self.task = get_task(cfg.task)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.pool = ServerPool(cfg.run_dir)
        self.writer = StreamWriter(cfg.run_dir, ROLLOUT_TOPIC, actor_id, cfg.streams)
        self.eval_writer = StreamWriter(cfg.run_dir, EVAL_TOPIC, actor_id, cfg.streams)
        self.tb = Scalars(cfg.run_dir, actor_id)
        self.version = 0  # the newest policy version any server reports
        self.started_samples, self.next_prompt = self._resume_position()
        self.in_flight: dict[asyncio.Task, int] = {}  # group task -> version it started at
        self.window = {"rewards": [], "tokens": 0, "samples": 0, "t0": time.monotonic()}

    def _resume_position(self) -> tuple[int, int]:
        """(samples in the stream from every actor, groups this actor wrote): the throttle's count and
        the next prompt number of a restarted actor. Only segments still on disk count, so with
        `streams.retention: delete` a restarted actor's throttle is looser until the trainer catches up."""
        import pyarrow as pa

        from pipelinerl.streams.segments import list_segments, list_writers, topic_dir

        tdir = topic_dir(self.cfg.run_dir, ROLLOUT_TOPIC)
        samples = groups = 0
        for writer in list_writers(tdir):
            for segment in list_segments(tdir / writer):
                try:
                    with pa.memory_map(str(segment.path)) as mapped:  # reads footers, not the token data
                        reader = pa.ipc.open_file(mapped)
                        samples += sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
                        groups += reader.num_record_batches if writer == self.actor_id else 0
                except (pa.ArrowException, OSError):  # damaged: the trainer's reader quarantines it
                    continue
        return samples, groups

    def prompt_ids(self, item: PromptItem) -> list[int]:
        encoded = self.tokenizer.apply_chat_template(item.messages, add_generation_prompt=True, tokenize=True)
        return list(encoded["input_ids"])

    async def complete(self, http: httpx.AsyncClient, prompt_ids: list[int], greedy: bool,
                       n: int = 1) -> list[Completion]:
        """n completions of one prompt in one request (the server shares the prompt's prefill), retried
        on another server (bounded) when the request fails or times out."""
        a = self.cfg.actor
        # No "model": servers of one run may serve different folders (a resumed run serves the latest
        # checkpoint's), and vLLM then uses the one model it serves.
        body = {"prompt": prompt_ids, "max_tokens": a.sampling.max_new_tokens, "n": n,
                "temperature": 0.0 if greedy else a.sampling.temperature, "top_p": 1.0 if greedy else a.sampling.top_p,
                "logprobs": 0, "return_token_ids": True, "skip_special_tokens": True}
        tried: set[str] = set()
        for attempt in range(a.max_retries + 1):
            url = self.pool.acquire(avoid=tried)
            while url is None:  # no server announced (yet, or any more): wait for one
                await asyncio.sleep(1.0)
                url = self.pool.acquire(avoid=tried)
            tried.add(url)
            try:
                resp = await http.post(f"{url}/v1/completions", json=body, timeout=a.request_timeout_s)
                resp.raise_for_status()
            except httpx.HTTPError as err:
                self.pool.release(url, failed=True)
                log.warning("completion on %s failed (attempt %d/%d): %r", url, attempt + 1, a.max_retries + 1, err)
                last = err
                continue
            self.pool.release(url, failed=False)
            choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
            return [_parse_choice(c) for c in choices]
        raise RuntimeError(f"a completion failed on {sorted(tried)} after {a.max_retries + 1} attempts: {last!r}")

    async def run_group(self, http: httpx.AsyncClient, index: int, item: PromptItem) -> None:
        prompt_ids = self.prompt_ids(item)
        completions = await self.complete(http, prompt_ids, greedy=False, n=self.cfg.actor.attempts)
        rows = await self.score(f"{self.actor_id}/{index}", item, prompt_ids, completions, {"prompt_index": index})
        self.writer.write_group(rows)
        self.window["rewards"] += [r["reward"] for r in rows]
        self.window["tokens"] += sum(len(c.token_ids) for c in completions)
        self.window["samples"] += len(rows)

    async def score(self, group_id: str, item: PromptItem, prompt_ids: list[int], completions: list[Completion],
                    metadata: dict) -> list[dict]:
        """Stream rows of one group, with rewards. Rewards run off the event loop: the math task's
        math-verify may take up to task.reward_timeout_s."""
        rewards = await asyncio.to_thread(lambda: [self.task.reward(item, c.text, c.finished) for c in completions])
        return [{"run_id": self.cfg.run_dir, "group_id": group_id,
                 "sample_id": f"{group_id}/{k}/{uuid.uuid4().hex[:12]}", "prompt_token_ids": prompt_ids,
                 "completion_token_ids": c.token_ids, "behaviour_logprobs": c.logprobs, "versions": c.versions,
                 "reward": reward, "finished": c.finished, "truncated": not c.finished, "task": self.task.name,
                 "actor_id": self.actor_id, "metadata": {"prompt_id": item.id, **metadata}}
                for k, (c, reward) in enumerate(zip(completions, rewards))]

    def may_start(self) -> bool:
        """The lag throttle, the in-flight bound, and the end of training."""
        a, S = self.cfg.actor, self.cfg.trainer.samples_per_step
        if len(self.in_flight) >= a.max_groups_in_flight:
            return False
        if self.cfg.trainer.max_steps is not None and self.started_samples >= self.cfg.trainer.max_steps * S:
            return False
        return a.max_lag is None or self.started_samples // S <= self.version + a.max_lag

    async def refresh_version(self, http: httpx.AsyncClient) -> None:
        for url in self.pool.refresh():
            try:
                resp = await http.get(f"{url}/status", timeout=10.0)
                self.version = max(self.version, int(resp.json()["version"]))
            except (httpx.HTTPError, KeyError, ValueError) as err:
                log.warning("could not read the version of %s: %r", url, err)

    async def evaluate(self, http: httpx.AsyncClient, version: int) -> float:
        """pass@1 on the first eval_samples held-out prompts; every completion goes to the `eval` topic."""
        items = self.task.eval_items[: self.cfg.actor.eval_samples]
        greedy = self.cfg.actor.eval_greedy
        prompts = [self.prompt_ids(i) for i in items]
        results = [c for cs in await asyncio.gather(*[self.complete(http, p, greedy) for p in prompts]) for c in cs]
        rows = []
        for item, prompt_ids, completion in zip(items, prompts, results):
            rows += await self.score(f"{self.actor_id}/eval{version}/{item.id}", item, prompt_ids, [completion],
                                     {"eval_version": version, "greedy": greedy})
        for row in rows:
            self.eval_writer.write_group([row])
        self.eval_writer.flush()
        success = sum(r["reward"] >= 1.0 for r in rows) / len(rows)
        self.tb.log(version, {"eval/success": success})
        log.info("version %d: held-out %s success %.3f", version, "greedy" if greedy else "sampled", success)
        return success

    def log_window(self) -> None:
        w = self.window
        dt = time.monotonic() - w["t0"]
        if w["samples"] and dt > 0:
            rewards = w["rewards"]
            self.tb.log(self.version, {"actor/reward": sum(rewards) / len(rewards),
                                       "actor/success": sum(r >= 1.0 for r in rewards) / len(rewards),
                                       "actor/tokens_per_s": w["tokens"] / dt, "actor/samples_per_s": w["samples"] / dt,
                                       "actor/groups_in_flight": len(self.in_flight)})
        self.window = {"rewards": [], "tokens": 0, "samples": 0, "t0": time.monotonic()}

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(limits=limits) as http:
            prompts = self.task.iter_train(self.next_prompt)
            evaluated, last_log = -1, time.monotonic()
            while True:
                await self.refresh_version(http)
                every = self.cfg.actor.eval_every_steps
                if every and self.version // every > evaluated and self.pool.refresh():
                    evaluated = self.version // every
                    self.in_flight[asyncio.create_task(self.evaluate(http, self.version))] = self.version
                while self.may_start():
                    index, self.next_prompt = self.next_prompt, self.next_prompt + 1
                    task = asyncio.create_task(self.run_group(http, index, next(prompts)))
                    self.in_flight[task] = self.version
                    self.started_samples += self.cfg.actor.attempts
                await self._reap(timeout=self.cfg.streams.poll_interval_s)
                if time.monotonic() - last_log > 5.0:
                    self.log_window()
                    last_log = time.monotonic()

    async def _reap(self, timeout: float) -> None:
        if not self.in_flight:
            await asyncio.sleep(timeout)
            return
        done, _ = await asyncio.wait(list(self.in_flight), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            del self.in_flight[task]
            task.result()  # a group that failed after its retries stops the actor with that error

    def close(self) -> None:
        self.writer.close()
        self.eval_writer.close()
        self.tb.close()
        self.task.close()


def _parse_choice(choice: dict) -> Completion:
    token_ids = list(choice["token_ids"])
    logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
    versions = list(choice["policy_versions"])
    if not (len(token_ids) == len(logprobs) == len(versions)):
        raise ValueError(f"server returned {len(token_ids)} tokens, {len(logprobs)} log-probs and "
                         f"{len(versions)} versions: {json.dumps(choice)[:300]}")
    return Completion(token_ids, logprobs, versions, choice.get("text") or "",
                      finished=choice.get("finish_reason") == "stop")


def run_actor(cfg: Config, actor_id: str = "actor0") -> None:
    """Entry point of `pipelinerl actor`: runs until SIGTERM/SIGINT, then publishes what it buffered."""
    import signal

    actor = Actor(cfg, actor_id)
    loop = asyncio.new_event_loop()
    main = loop.create_task(actor.run())
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, main.cancel)
    try:
        loop.run_until_complete(main)
    except asyncio.CancelledError:
        log.info("actor %s stopping", actor_id)
    finally:
        actor.close()
        loop.close()

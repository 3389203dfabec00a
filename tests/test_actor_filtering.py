"""Dynamic sampling (rl.filter_zero_variance): the actor keeps groups of equal rewards from the trainer, records
them in the `filtered` topic, and generates on until the rollouts hold the samples the lag bound allows; a
restarted actor counts filtered groups as published, not lost. Against a scripted server (no vLLM): the answer to
each prompt is known from the task, so which groups are informative is fixed by construction."""

import asyncio
import json
import logging
import re
from pathlib import Path

import httpx
import pytest
from test_actor import G, _announce, _choice, _config, _scalars, _status, mock_actor_client

from pipelinerl.actor.scheduler import Actor, informative
from pipelinerl.config import load_config
from pipelinerl.streams import FILTERED_TOPIC, ROLLOUT_TOPIC, StreamReader, StreamTimeout

REPO = Path(__file__).resolve().parent.parent


class _ScriptedServer:
    """Version 0; a prompt whose answer has an even last digit gets one right completion among G (an
    informative group), any other prompt G wrong ones (equal rewards: filtered). `solves=False`: every prompt
    gets G wrong ones."""

    def __init__(self, answers: dict[tuple[int, ...], str], solves: bool = True):
        self.answers, self.solves = answers, solves
        self.priorities: set[int] = set()  # of the completion requests

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/status":
            return httpx.Response(200, json=_status(0))
        body = json.loads(request.content)
        self.priorities.add(body["priority"])
        answer = self.answers[tuple(body["prompt"])]
        right = self.solves and int(answer[-1]) % 2 == 0
        texts = [answer if right and k == 0 else "x" for k in range(G)]
        return httpx.Response(200, json={"choices": [_choice(k, t, 2, True) for k, t in enumerate(texts)]})


def _groups(run_dir: Path, topic: str, cfg) -> list[list[dict]]:
    reader, out = StreamReader(run_dir, topic, cfg.streams), []
    try:
        while True:
            out += [g.to_pylist() for g in reader.read_groups(max_groups=64, timeout_s=0.5)]
    except StreamTimeout:
        return out


def _run_until_held(actor: Actor, server: _ScriptedServer, monkeypatch) -> None:
    """The actor's loop until the lag bound holds it with nothing in flight, then closed (publishing all)."""
    _run_until(actor, server, monkeypatch, lambda: not actor.in_flight and actor.held_by() == "lag")


def _run_until(actor: Actor, server: _ScriptedServer, monkeypatch, done) -> None:
    """The actor's loop until `done()` (within 60 s), then closed (publishing all)."""
    mock_actor_client(monkeypatch, server)

    async def run() -> None:
        loop = asyncio.create_task(actor.run())
        async with asyncio.timeout(60):
            while not done():
                assert not loop.done(), "the actor stopped"
                await asyncio.sleep(0.01)
        loop.cancel()

    asyncio.run(run())
    actor.log_window()  # the loop logs one every 5 s
    actor.close()


def test_filtered_groups_leave_the_rollouts_and_the_throttle_count_and_are_not_lost(tmp_path, tiny_model_dir,
                                                                                    monkeypatch):
    run_dir = tmp_path / "run"
    cfg = _config(run_dir, tiny_model_dir, tmp_path / "actor.yaml", "actor.max_lag=0", "rl.filter_zero_variance=true",
                  "actor.max_groups_in_flight=3")
    S = cfg.trainer.samples_per_step
    _announce(run_dir, 1)
    actor = Actor(cfg, "a0")
    items = actor.task.iter_train(0)
    answers = {tuple(actor.prompt_ids(item)): item.answer for item in (next(items) for _ in range(400))}
    server = _ScriptedServer(answers)
    _run_until_held(actor, server, monkeypatch)
    assert server.priorities == {0}  # training requests: vLLM's highest priority, before queued evaluation

    kept, filtered = _groups(run_dir, ROLLOUT_TOPIC, cfg), _groups(run_dir, FILTERED_TOPIC, cfg)
    # max_lag 0 at version 0: step 0's S samples, all informative, then the bound holds the actor
    assert sum(map(len, kept)) == S and filtered, (len(kept), len(filtered))
    assert all(len({r["reward"] for r in g}) == 2 for g in kept)
    assert all({r["reward"] for r in g} == {0.0} for g in filtered)
    numbers = sorted(json.loads(g[0]["metadata"])["prompt_index"] for g in kept + filtered)
    assert numbers == list(range(actor.next_prompt))  # every started prompt is in one topic, once
    assert _scalars(run_dir / "tb" / "a0")["actor/filtered_frac"] == pytest.approx(len(filtered) / len(numbers))

    again = Actor(cfg, "a0")  # a restart: the filtered groups were published, not lost in flight
    try:
        assert (again.next_prompt, again.started_samples, again.lost) == (actor.next_prompt, S, 0)
        assert again.held_by() == "lag"
    finally:
        again.close()


def test_a_run_of_only_filtered_groups_is_warned_about(tmp_path, tiny_model_dir, monkeypatch, caplog):
    """A model that solves none of its prompts: every group goes to the `filtered` topic, the trainer would get
    nothing, and the actor says so every actor.wait_log_s instead of generating on in silence."""
    run_dir = tmp_path / "run"
    cfg = _config(run_dir, tiny_model_dir, tmp_path / "actor.yaml", "actor.max_lag=null",
                  "rl.filter_zero_variance=true", "actor.max_groups_in_flight=3", "actor.wait_log_s=0.01")
    _announce(run_dir, 1)
    actor = Actor(cfg, "a0")
    items = actor.task.iter_train(0)
    answers = {tuple(actor.prompt_ids(item)): item.answer for item in (next(items) for _ in range(2000))}
    warned = re.compile(r"the last (\d+) groups \(\d+ s\) all had equal rewards \(the last: all 0\) and went to "
                        r"the 'filtered' topic \(rl.filter_zero_variance\): the trainer gets no sample")
    with caplog.at_level(logging.WARNING, logger="pipelinerl.actor.scheduler"):
        _run_until(actor, _ScriptedServer(answers, solves=False), monkeypatch,
                   lambda: any(warned.search(r.getMessage()) for r in caplog.records))
    counts = [int(m[1]) for r in caplog.records if (m := warned.search(r.getMessage()))]
    assert counts[0] >= 2 and counts == sorted(counts)  # the first group starts the run; the count only grows
    assert not _groups(run_dir, ROLLOUT_TOPIC, cfg) and _groups(run_dir, FILTERED_TOPIC, cfg)


def test_the_rule_and_its_config():
    from pipelinerl.streams import Rollout

    def group(*rewards):
        return [Rollout(run_id="r", group_id="g", sample_id=str(k), prompt_token_ids=[1], completion_token_ids=[2],
                        behaviour_logprobs=[-1.0], versions=[0], reward=r, finished=True, truncated=False, task="t",
                        actor_id="a") for k, r in enumerate(rewards)]

    assert not informative(group(1.0, 1.0, 1.0)) and not informative(group(0.25, 0.25))
    assert informative(group(0.0, 0.0, 1.0)) and informative(group(0.5, 0.25))
    with pytest.raises(ValueError, match="rl.filter_zero_variance"):
        load_config(REPO / "configs" / "tiny_cpu.yaml", ["rl.filter_zero_variance=true", "rl.value_function=true"])

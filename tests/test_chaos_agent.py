"""A black-box agent's episodes survive an actor crash (issue 45): one short `pipelinerl run` of tiny_agent.yaml
(tests/agent_programs/calculator_agent.py on the real `openai` client, through the actor's agent gateway) on the
tool-calling tiny model, through tools/chaos.py: the actor, which runs the gateway and every agent program, is
SIGKILLed while its episodes run, and restarted. Every episode it consumed is trained exactly once, every row is a
whole conversation of one agent (its tool answers in it untrained, its turns in order), and the lag throttle at
episode start bounds the lag of every trained model token, though episodes straddle weight updates.

No timing luck: the kill comes right after a trainer step, when the throttle has just let the actor start new
groups; the exactly-once verdict holds whatever was in flight. Every wait is bounded.
"""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import consumed_rows, worker_port

from pipelinerl.envs.tool_calls import ToolCall, ToolSpec, call_format

pytestmark = pytest.mark.slow  # a 56-step warm start and one `pipelinerl run` with a restart: ~4 min

REPO = Path(__file__).resolve().parent.parent
PORT = worker_port(19740)
MAX_LAG = 1
SAMPLES = 64
COMPACT = call_format("compact")
CALCULATOR = ToolSpec("calculator", "", {"type": "object", "properties": {"expression": {"type": "string"}}})
spec = importlib.util.spec_from_file_location("chaos", REPO / "tools" / "chaos.py")
chaos = sys.modules["chaos"] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
spec.loader.exec_module(chaos)


@pytest.fixture(scope="module")
def result(tmp_path_factory, tools_model_dir):
    overrides = [f"model.path={tools_model_dir}", "model.build_tiny_if_missing=false", "trainer.max_steps=100000",
                 f"trainer.samples_per_step={SAMPLES}", "trainer.warmup_steps=0", f"actor.max_lag={MAX_LAG}",
                 "actor.max_groups_in_flight=16", "actor.eval_every_steps=0", "checkpoints.every_steps=2",
                 "checkpoints.keep_last=2", "streams.segment_max_seconds=0.5", f"inference.base_port={PORT}",
                 f"trainer.broadcast_port={PORT + 50}"]
    out = tmp_path_factory.mktemp("chaos_agent") / "run"
    # max_steps out of reach: chaos stops the run (SIGTERM, the trainer checkpoints) 2 steps after the kill healed
    res = chaos.run_chaos(str(REPO / "configs" / "tiny_agent.yaml"), [chaos.Planned("actor")], out, overrides,
                          timeout_s=1500, stop_after_steps=2)
    print(res.table)
    return res, out


def _sum(expression: str) -> str:
    """calculator_agent's calculator: the sum of a+b+..., or `*`."""
    terms = expression.split("+")
    return str(sum(map(int, terms))) if all(t.isdigit() for t in terms) else "*"


def test_the_agent_run_survives_an_actor_kill_training_every_episode_once(result):
    res, out = result
    assert res.code == chaos.STOPPED, res.table + (out / "logs" / "launcher.log").read_text()[-3000:]
    assert [k.role for k in res.kills] == ["actor"] and res.kills[0].down_s is not None, res.table
    assert res.exactly_once, res.table
    assert chaos.stream_gaps(out) == sum(k.lost_groups or 0 for k in res.kills), res.table


def test_consumed_rows_are_agent_conversations_within_the_lag_bound(result):
    from pipelinerl.metrics import read_token_stats
    from pipelinerl.tiny.model import build_tokenizer

    res, out = result
    assert res.code == chaos.STOPPED, res.table
    rows, steps = consumed_rows(out)
    assert steps > res.kills[-1].step and len(rows) == steps * SAMPLES
    tok = build_tokenizer()
    multi_turn = [r for r in rows if r["turns"] >= 2]
    assert len(multi_turn) > len(rows) / 4, f"{len(multi_turn)} of {len(rows)} episodes called the calculator"
    for r in rows:
        assert r["task"] == "agent" and r["end_reason"] != "env_error", r["metadata"]
        assert "drift_tokens" not in r["metadata"]  # this agent's history is linear: nothing cut off
        mask = np.asarray(r["loss_mask"], bool)
        versions = np.asarray(r["versions"])[mask]
        assert mask.any() and np.all(np.diff(versions) >= 0), versions  # later turns never on older weights
    for r in multi_turn:  # the agent's own calculator answers follow its calls, untrained
        ids, mask = r["completion_token_ids"], r["loss_mask"]
        first_env = mask.index(0)
        call = tok.decode(ids[:first_env - 1])  # the turn before its EOS
        calls = [c for c in COMPACT.parse(call, [CALCULATOR]) if isinstance(c, ToolCall)]
        answers = tok.decode(ids[first_env:mask.index(1, first_env)])
        assert calls and answers == "".join(_sum(c.arguments["expression"]) for c in calls), call
    stats = read_token_stats(out)
    assert len(stats["lag"]) == sum(int(np.sum(r["loss_mask"])) for r in rows)
    assert 0 <= stats["lag"].min() and stats["lag"].max() <= MAX_LAG, np.bincount(stats["lag"])
    straddled = sum(len(set(np.asarray(r["versions"])[np.asarray(r["loss_mask"], bool)])) > 1 for r in rows)
    print(f"{len(rows)} episodes, {len(multi_turn)} multi-turn, {straddled} straddled a weight update, "
          f"token lags {np.bincount(stats['lag']).tolist()}")

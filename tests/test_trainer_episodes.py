"""Multi-turn episodes in the trainer (issue #28): one stream row whose completion holds model tokens (loss mask
1) and environment tokens (loss mask 0, version -1) in turn. Through the trainer's own path (stream rows ->
Samples -> packed micro-batch -> the tiny model's forward -> `_loss_fn` -> the step's statistics), the loss
equals a float64 reference written over the model tokens alone; the environment tokens stay in the model's
input; their behaviour and reference log-probs change nothing; lag statistics, the lag filter, GAE and the
per-token log see model tokens only."""

import copy
import math

import pytest
import torch

from pipelinerl.config import load_config
from pipelinerl.streams.schema import group_batch
from pipelinerl.trainer.dist import DistInfo
from pipelinerl.trainer.loop import LoopState, _loss_fn, _trained, rows_to_samples, train_step
from pipelinerl.trainer.model import completion_forward
from pipelinerl.trainer.packing import pack

CPU = torch.device("cpu")
VERSION = 3  # the trainer step that trains the group
PROMPT = [1, 5, 7]
TURN1, ENV, TURN2 = [8, 9, 10], [14, 15], [11, 12]  # model turn at version 1, tool result, model turn at version 2
SINGLE = [8, 13, 4]  # the group's other attempt: a single-turn completion at version 2, written without a mask
# Written by hand, not read from the rows: each row's model tokens (completion positions), their lags, advantage.
MODEL_TOKENS = [[0, 1, 2, 5, 6], [0, 1, 2]]
LAGS = [[2, 2, 2, 1, 1], [1, 1, 1]]
ADVANTAGES = [0.5, -0.5]  # rewards 1 and 0, group mean baseline


def _rows(env=ENV, env_behaviour=0.0, env_reference=-1.0) -> list[dict]:
    n = len(env)
    episode = {"run_id": "r", "group_id": "g", "sample_id": "g-episode", "prompt_token_ids": PROMPT,
               "completion_token_ids": TURN1 + env + TURN2,
               "behaviour_logprobs": [-2.0, -1.5, -2.5] + [env_behaviour] * n + [-1.0, -3.0],
               "versions": [1, 1, 1] + [-1] * n + [2, 2], "loss_mask": [1, 1, 1] + [0] * n + [1, 1],
               "reference_logprobs": [-2.25, -1.0, -2.0] + [env_reference] * n + [-1.25, -2.5],
               "reward": 1.0, "finished": True, "truncated": False, "turns": 2, "tool_calls": 1,
               "end_reason": "finished", "task": "t", "actor_id": "a"}
    single = {"run_id": "r", "group_id": "g", "sample_id": "g-single", "prompt_token_ids": PROMPT,
              "completion_token_ids": SINGLE, "behaviour_logprobs": [-1.75, -2.25, -0.75], "versions": [2, 2, 2],
              "reference_logprobs": [-2.0, -2.0, -1.0], "reward": 0.0, "finished": True, "truncated": False,
              "task": "t", "actor_id": "a"}
    return [episode, single]


def _cfg(*extra):
    return load_config(None, ["run_dir=x", "model.path=m", "actor.attempts=2", "trainer.samples_per_step=2", *extra])


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    """The tiny model with perturbed weights: log-probs that depend on the context (-2 to -3.6 here)."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return lm


class ModelTrainer:
    """Stands in for the DeepSpeed backend in `train_step`: the model's forward (`completion_forward`), the loop's
    loss function and backward, per micro-batch."""

    device = CPU
    router_tap = None  # a dense model

    def __init__(self, lm):
        self.lm, self.losses = lm, []

    def accumulate(self, micro_batches, loss_fn):
        stats = []
        for mb in micro_batches:
            new_N, values_N = completion_forward(self.lm, mb, CPU)
            loss, mb_stats = loss_fn(mb, new_N, values_N)
            loss.backward()
            self.losses.append(loss.item())
            stats.append(mb_stats)
        return stats

    def optimizer_step(self):
        return {}


def _step(lm, cfg, rows):
    """One train_step on the group: (its statistics, its loss, every parameter's gradient, the token log)."""
    lm.zero_grad()
    trainer, token_log = ModelTrainer(lm), []
    samples = rows_to_samples([group_batch(rows)], VERSION, 0, cfg)
    stats = train_step(trainer, samples, cfg, DistInfo(0, 1, 0, "gloo"), LoopState(), token_log)
    grads = {n: p.grad.clone() for n, p in lm.named_parameters()}
    return stats, sum(trainer.losses), grads, token_log


@torch.no_grad()
def _model_logprobs64(lm, row, i) -> list[float]:
    """float64 log-probs of row i's model tokens (MODEL_TOKENS[i]), the sequence scored alone and whole."""
    lm64 = copy.deepcopy(lm).double()
    ids = row["prompt_token_ids"] + row["completion_token_ids"]
    logp = lm64(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)
    p = len(row["prompt_token_ids"])
    return [logp[p + t - 1, ids[p + t]].item() for t in MODEL_TOKENS[i]]


def _reference_loss(lm, rows, kl_coef, ppo_clip=None, max_token_lag=None) -> float:
    """The step's loss in float64 over the model tokens: -ratio * A (PPO: the clipped minimum) + kl_coef * k3
    KL to the reference, summed, over the step's 2 sequences."""
    total = 0.0
    for i, row in enumerate(rows):
        for t, lag, new in zip(MODEL_TOKENS[i], LAGS[i], _model_logprobs64(lm, row, i)):
            if max_token_lag is not None and lag > max_token_lag:
                continue
            ratio, adv = math.exp(new - row["behaviour_logprobs"][t]), ADVANTAGES[i]
            surrogate = ratio * adv
            if ppo_clip is not None:
                surrogate = min(surrogate, min(max(ratio, 1 - ppo_clip), 1 + ppo_clip) * adv)
            log_r = row["reference_logprobs"][t] - new
            total += -surrogate + kl_coef * (math.exp(log_r) - log_r - 1)
    return total / 2


CASES = {"grpo_kl": ([], {}), "ppo_lag_filter": (["rl.ppo_clip=0.2", "rl.max_token_lag=1"],
                                                 {"ppo_clip": 0.2, "max_token_lag": 1})}


@pytest.mark.parametrize("case", list(CASES))
def test_a_two_turn_episode_is_trained_on_its_model_tokens_only(model, case):
    extra, reference_args = CASES[case]
    cfg = _cfg("rl.kl_coef=0.1", *extra)
    rows = _rows()
    stats, loss, _, token_log = _step(model, cfg, rows)
    want = _reference_loss(model, rows, kl_coef=0.1, **reference_args)
    assert loss == pytest.approx(want, rel=2e-5, abs=1e-6)
    assert stats["grpo_loss"] + stats["kl_loss"] == pytest.approx(want, rel=2e-5, abs=1e-6)
    # Statistics: 8 model tokens of lags 2, 2, 2, 1, 1 | 1, 1, 1; the 2 environment tokens (version -1) nowhere.
    assert stats["tokens"] == 8 and stats["sequences"] == 2
    assert stats["lag_max"] == 2 and stats["lag_mean"] == pytest.approx(11 / 8)
    lags, behaviour, _ = (torch.cat(parts) for parts in zip(*token_log))
    assert sorted(lags.tolist()) == sorted(LAGS[0] + LAGS[1])
    assert sorted(behaviour.tolist()) == sorted(rows[0]["behaviour_logprobs"][:3] + rows[0]["behaviour_logprobs"][5:]
                                                + rows[1]["behaviour_logprobs"])
    if case == "ppo_lag_filter":  # lag 2 > 1: the first turn's 3 tokens are dropped; the environment's are not
        assert stats["kept_tokens"] == 5 and stats["lag_drop_frac"] == pytest.approx(3 / 8)
        assert "ppo_clipped_frac" in stats
    else:
        assert stats["kept_tokens"] == 8 and stats["lag_drop_frac"] == 0.0


def test_environment_tokens_are_model_input_but_their_logprobs_change_nothing(model):
    cfg = _cfg("rl.kl_coef=0.1", "rl.ppo_clip=0.2")
    _, loss, grads, _ = _step(model, cfg, _rows())
    # A behaviour log-prob of -100 would overflow float32's exp in the ratio (0 * inf = NaN) were it not masked.
    for env_behaviour, env_reference in ((-100.0, -50.0), (0.0, 0.0), (-0.5, -30.0)):
        _, other, other_grads, _ = _step(model, cfg, _rows(env_behaviour=env_behaviour, env_reference=env_reference))
        assert other == loss
        assert all(torch.equal(other_grads[n], g) for n, g in grads.items())
    # Other environment tokens: the second turn is scored in another context, so the loss moves; the reference
    # agrees, as it scores the whole sequence.
    other_env = [16, 3]
    _, moved, _, _ = _step(model, cfg, _rows(env=other_env))
    want = _reference_loss(model, _rows(env=other_env), kl_coef=0.1, ppo_clip=0.2)
    assert abs(moved - loss) > 1e-4 and moved == pytest.approx(want, rel=2e-5, abs=1e-6)


def test_gae_runs_over_the_model_tokens_only():
    """gamma 0.5, lambda 1, reward R on the last model token: the return of a model token is
    gamma^(model tokens after it) * R, environment tokens not counted; advantage = return - value."""
    cfg = _cfg("rl.value_function=true", "rl.value_coef=0.5", "rl.gamma=0.5", "rl.gae_lambda=1.0")
    samples = rows_to_samples([group_batch(_rows())], VERSION, 0, cfg)
    trained, together = _trained(samples, cfg)
    (mb,) = pack(trained, 10_000, together)
    n = mb.target_pos_N.numel()
    values = torch.linspace(-0.5, 0.5, n, dtype=torch.float64).requires_grad_()
    new = mb.fields_N["behaviour"].clone()  # ratio 1 on the model tokens
    new[mb.fields_N["loss_mask"] == 0] = -3.0  # the environment tokens' own scores take no part
    loss, stats = _loss_fn(cfg, 2, 0, CPU, [])(mb, new, values)
    expected, v = 0.0, values.tolist()
    for k, sample in enumerate(trained):
        rows_N = [t for t in range(n) if mb.row_seq_N[t] == k and mb.fields_N["loss_mask"][t] == 1]
        assert len(rows_N) == len(MODEL_TOKENS[sample.index])
        reward = [1.0, 0.0][sample.index]
        for j, t in enumerate(rows_N):
            ret = 0.5 ** (len(rows_N) - 1 - j) * reward
            expected += -(ret - v[t]) + 0.5 * (v[t] - ret) ** 2
    assert loss.item() == pytest.approx(expected / 2, rel=1e-12)
    loss.backward()
    env_N = mb.fields_N["loss_mask"] == 0
    assert env_N.sum() == 2 and values.grad[env_N].abs().sum() == 0  # no value loss on environment tokens
    assert stats["tokens"] == 8

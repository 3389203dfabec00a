"""Stream rows -> trainer samples: advantages, lags and indices against hand-computed values."""

import pytest
import torch

from pipelinerl.config import ConfigError, load_config
from pipelinerl.streams.schema import group_batch
from pipelinerl.trainer.dist import DistInfo
from pipelinerl.trainer.loop import _field_names, _loss_fn, _trained, check_supported, rows_to_samples
from pipelinerl.trainer.packing import pack, padding_micro_batch


def _group(gid, rewards, versions, reference=None):
    return group_batch([
        {"run_id": "r", "group_id": gid, "sample_id": f"{gid}-{i}", "prompt_token_ids": [1, 5],
         "completion_token_ids": [4 + i] * len(v), "behaviour_logprobs": [-0.5 * (i + 1)] * len(v), "versions": v,
         "reward": r, "finished": True, "truncated": False, "task": "t", "actor_id": "a",
         **({"reference_logprobs": reference[i]} if reference else {})}
        for i, (r, v) in enumerate(zip(rewards, versions))])


def test_rows_become_samples_with_group_advantages_and_lags():
    cfg = load_config(None, ["run_dir=x", "model.path=m", "actor.attempts=2", "trainer.samples_per_step=4"])
    batches = [_group("a", [1.0, 0.0], [[3, 4], [4]]), _group("b", [0.5, 0.5], [[2], [2, 2, 4]])]
    samples = rows_to_samples(batches, version=5, first_index=10, cfg=cfg)
    assert [s.index for s in samples] == [10, 11, 12, 13]
    assert [s.token_fields["advantage"] for s in samples] == [[0.5, 0.5], [-0.5], [0.0], [0.0, 0.0, 0.0]]
    assert [s.token_fields["lag"] for s in samples] == [[2, 1], [1], [3], [3, 3, 1]]
    assert samples[1].token_fields["behaviour"] == [-1.0]
    assert [s.token_fields["group"][0] for s in samples] == [0, 0, 1, 1]
    assert samples[0].prompt_ids == [1, 5] and samples[3].completion_ids == [5, 5, 5]


def test_dpo_roles_mark_the_best_and_worst_attempt():
    cfg = load_config(None, ["run_dir=x", "model.path=m", "actor.attempts=3", "trainer.samples_per_step=3",
                             "rl.algorithm=dpo"])
    samples = rows_to_samples([_group("a", [0.2, 0.9, 0.1], [[0], [0], [0]])], version=0, first_index=0, cfg=cfg)
    assert [s.token_fields["advantage"][0] for s in samples] == [0.0, 1.0, -1.0]


def test_unsupported_configs_fail_before_loading_anything():
    two = DistInfo(rank=0, world_size=2, local_rank=0, backend="gloo")
    cfg = load_config(None, ["run_dir=x", "model.path=m", "actor.attempts=4", "trainer.samples_per_step=12"])
    with pytest.raises(ConfigError, match="multiple of the rank count"):
        check_supported(cfg, two)  # 3 groups over 2 ranks


def test_reference_logprobs_and_rewards_travel_when_the_objective_needs_them():
    cfg = load_config(None, ["run_dir=x", "model.path=m", "actor.attempts=2", "rl.kl_coef=0.1",
                             "rl.value_function=true"])
    batch = _group("a", [1.0, 0.0], [[3, 4], [4]], reference=[[-0.25, -2.0], [-1.5]])
    samples = rows_to_samples([batch], version=4, first_index=0, cfg=cfg)
    assert [s.token_fields["reference"] for s in samples] == [[-0.25, -2.0], [-1.5]]
    assert [s.token_fields["reward"] for s in samples] == [[1.0, 1.0], [0.0]]
    plain = rows_to_samples([batch], version=4, first_index=0, cfg=load_config(None, ["run_dir=x", "model.path=m"]))
    assert "reference" not in plain[0].token_fields and "reward" not in plain[0].token_fields


def test_rows_without_reference_logprobs_are_refused_when_the_kl_needs_them():
    cfg = load_config(None, ["run_dir=x", "model.path=m", "actor.attempts=2", "rl.kl_coef=0.1"])
    with pytest.raises(ValueError, match="a-0 has 0 reference log-probs for 2 completion tokens.*reference servers"):
        rows_to_samples([_group("a", [1.0, 0.0], [[3, 4], [4]])], version=4, first_index=0, cfg=cfg)


def _dpo_samples(extra=()):
    cfg = load_config(None, ["run_dir=x", "model.path=m", "actor.attempts=3", "trainer.samples_per_step=6",
                             "rl.algorithm=dpo", *extra])
    batches = [_group("a", [0.2, 0.9, 0.1], [[0], [0, 0], [0]], reference=[[-0.1], [-0.1, -0.1], [-0.1]]),
               _group("b", [1.0, 1.0, 1.0], [[0], [0], [0]], reference=[[-0.1]] * 3)]
    return cfg, rows_to_samples(batches, version=0, first_index=0, cfg=cfg)


def test_dpo_trains_each_pair_together_and_skips_unpaired_attempts_without_a_kl():
    cfg, samples = _dpo_samples()
    trained, together = _trained(samples, cfg)
    assert [s.index for s in trained] == [1, 2]  # group a's best and worst; group b is a tie: no pair
    assert together == [0.0, 0.0]
    cfg, samples = _dpo_samples(["rl.kl_coef=0.1", "rl.dpo_reference=behaviour"])
    trained, together = _trained(samples, cfg)
    assert [s.index for s in trained] == list(range(6))  # the KL term weighs every attempt
    assert together == [None, 0.0, 0.0, None, None, None]


def _micro_batch(samples, cfg):
    trained, together = _trained(samples, cfg)
    (mb,) = pack(trained, 10_000, together)
    return mb


def test_loss_fn_feeds_gae_advantages_and_returns_to_the_loss():
    """gamma = lambda = 1 with a terminal reward R: A_t = R - V_t, return_t = R (hand computed)."""
    cfg = load_config(None, ["run_dir=x", "model.path=m", "actor.attempts=2", "rl.value_function=true",
                             "rl.value_coef=0.5"])
    samples = rows_to_samples([_group("a", [1.0, 0.0], [[0, 0], [0]])], version=0, first_index=0, cfg=cfg)
    mb = _micro_batch(samples, cfg)
    values = torch.tensor([0.25, 0.5, -0.5], dtype=torch.float64, requires_grad=True)
    new = torch.tensor([-0.5, -0.5, -1.0], dtype=torch.float64, requires_grad=True)  # = behaviour: ratio 1
    token_log = []
    loss, stats = _loss_fn(cfg, 2, torch.device("cpu"), token_log)(mb, new, values)
    rewards, v = {0: 1.0, 1: 0.0}, values.tolist()
    seq = mb.seq_index_N.tolist()
    expected = sum(-(rewards[q] - v[t]) + 0.5 * (v[t] - rewards[q]) ** 2 for t, q in enumerate(seq)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    expected_grad = [0.5 * (v[t] - rewards[q]) for t, q in enumerate(seq)]  # d/dV of value_coef * (V - R)^2 / 2
    assert values.grad.tolist() == pytest.approx(expected_grad, rel=1e-12)
    assert stats["sequences"].item() == 2 and len(token_log) == 1


def test_padding_micro_batch_adds_zero_loss_and_the_same_statistics_keys():
    cfg, samples = _dpo_samples(["rl.kl_coef=0.1", "rl.dpo_reference=reference"])
    mb = _micro_batch(samples, cfg)
    assert list(mb.fields_N) == _field_names(cfg)
    pad = padding_micro_batch(_field_names(cfg))
    loss_fn = _loss_fn(cfg, 6, torch.device("cpu"), [])
    new = torch.full((pad.target_pos_N.numel(),), -0.3, dtype=torch.float64, requires_grad=True)
    pad_loss, pad_stats = loss_fn(pad, new, None)
    real_loss, real_stats = loss_fn(mb, torch.full((mb.target_pos_N.numel(),), -0.3, dtype=torch.float64), None)
    assert pad_loss.item() == 0.0 and real_loss.item() != 0.0
    assert pad_stats.keys() == real_stats.keys()
    assert all(float(v.abs().sum()) == 0.0 for v in pad_stats.values())
    pad_loss.backward()
    assert new.grad is not None  # the padding pass still reaches every parameter

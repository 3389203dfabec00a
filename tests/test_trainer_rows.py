"""Stream rows -> trainer samples: advantages, lags and indices against hand-computed values; the
step's loss normalisation over real gloo ranks."""

import math
import os

import pytest
import torch
import torch.multiprocessing as mp
from helpers import worker_port

from pipelinerl.config import ConfigError, load_config
from pipelinerl.launch.procs import free_port
from pipelinerl.streams.schema import group_batch
from pipelinerl.trainer.dist import DistInfo
from pipelinerl.trainer.loop import (
    LoopState,
    _field_names,
    _loss_fn,
    _trained,
    check_supported,
    rows_to_samples,
    train_step,
)
from pipelinerl.trainer.packing import pack, padding_micro_batch


def _group(gid, rewards, versions, reference=None, truncated=None):
    truncated = truncated or [False] * len(rewards)
    return group_batch([
        {"run_id": "r", "group_id": gid, "sample_id": f"{gid}-{i}", "prompt_token_ids": [1, 5],
         "completion_token_ids": [4 + i] * len(v), "behaviour_logprobs": [-0.5 * (i + 1)] * len(v), "versions": v,
         "reward": r, "finished": not cut, "truncated": cut, "task": "t", "actor_id": "a",
         **({"reference_logprobs": reference[i]} if reference else {})}
        for i, (r, v, cut) in enumerate(zip(rewards, versions, truncated))])


def test_rows_become_samples_with_group_advantages_and_lags():
    cfg = load_config(None, ["run_dir=x", "model.path=m", "actor.attempts=2", "trainer.samples_per_step=4"])
    batches = [_group("a", [1.0, 0.0], [[3, 4], [4]]), _group("b", [0.5, 0.5], [[2], [2, 2, 4]])]
    samples = rows_to_samples(batches, version=5, first_index=10, cfg=cfg)
    assert [s.index for s in samples] == [10, 11, 12, 13]
    assert [s.seq_fields["advantage"] for s in samples] == [0.5, -0.5, 0.0, 0.0]  # once per sequence
    assert [s.token_fields["lag"] for s in samples] == [[2, 1], [1], [3], [3, 3, 1]]
    assert samples[1].token_fields["behaviour"] == [-1.0]
    assert [s.seq_fields["group"] for s in samples] == [0, 0, 1, 1]
    assert samples[0].prompt_ids == [1, 5] and samples[3].completion_ids == [5, 5, 5]


def test_dpo_roles_mark_the_best_and_worst_attempt_and_the_reference_logprobs_travel():
    cfg = load_config(None, ["run_dir=x", "model.path=m", "actor.attempts=3", "trainer.samples_per_step=3",
                             "rl.algorithm=dpo"])  # seed 004's default: margins against the reference model
    batch = _group("a", [0.2, 0.9, 0.1], [[0], [0], [0]], reference=[[-0.5], [-0.25], [-2.0]])
    samples = rows_to_samples([batch], version=0, first_index=0, cfg=cfg)
    assert [s.seq_fields["advantage"] for s in samples] == [0.0, 1.0, -1.0]
    assert [s.token_fields["reference"] for s in samples] == [[-0.5], [-0.25], [-2.0]]
    with pytest.raises(ValueError, match="reference log-probs"):
        rows_to_samples([_group("a", [0.2, 0.9, 0.1], [[0], [0], [0]])], version=0, first_index=0, cfg=cfg)
    behaviour = load_config(None, ["run_dir=x", "model.path=m", "actor.attempts=3", "trainer.samples_per_step=3",
                                   "rl.algorithm=dpo", "rl.dpo_reference=behaviour"])
    plain = rows_to_samples([_group("a", [0.2, 0.9, 0.1], [[0], [0], [0]])], version=0, first_index=0, cfg=behaviour)
    assert "reference" not in plain[0].token_fields


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
    assert [s.seq_fields["reward"] for s in samples] == [1.0, 0.0]
    plain = rows_to_samples([batch], version=4, first_index=0, cfg=load_config(None, ["run_dir=x", "model.path=m"]))
    assert "reference" not in plain[0].token_fields and "reward" not in plain[0].seq_fields


def test_distillation_rows_carry_the_teachers_logprobs_and_their_groups_mean_gap():
    """rl.teacher: the teacher's log-probs travel as the reference, and every sequence of a group gets the group's
    mean of teacher - behaviour over its tokens (here (-0.25+0.5) + (-2.0+0.5) + (-1.5+1.0), over 3 tokens)."""
    cfg = load_config(None, ["run_dir=x", "model.path=m", "actor.attempts=2", "rl.teacher=t"])
    batch = _group("a", [1.0, 0.0], [[3, 4], [4]], reference=[[-0.25, -2.0], [-1.5]])
    samples = rows_to_samples([batch], version=4, first_index=0, cfg=cfg)
    assert [s.token_fields["reference"] for s in samples] == [[-0.25, -2.0], [-1.5]]
    assert [s.seq_fields["distill_baseline"] for s in samples] == [pytest.approx((0.25 - 1.5 - 0.5) / 3)] * 2
    plain = rows_to_samples([batch], version=4, first_index=0, cfg=load_config(None, ["run_dir=x", "model.path=m"]))
    assert "distill_baseline" not in plain[0].seq_fields


def test_teacher_top_k_rows_become_k_values_per_token_packed_as_columns():
    """rl.teacher_top_k=2: each token's 2 teacher ids and log-probs (flattened in the row) become [N, 2] fields of
    the micro-batch; the loss reads the student's log-probs of those ids from columns 1.. of the forward's output;
    a padding micro-batch has the same shapes; rows without the top-k are refused, naming the sample."""
    cfg = load_config(None, ["run_dir=x", "model.path=m", "actor.attempts=2", "rl.teacher=t", "rl.teacher_top_k=2"])
    rows = [{"run_id": "r", "group_id": "a", "sample_id": f"a-{i}", "prompt_token_ids": [1, 5],
             "completion_token_ids": [4] * n, "behaviour_logprobs": [-0.5] * n, "versions": [0] * n,
             "reference_logprobs": [-0.5] * n, "teacher_top_ids": [3, 7] * n,
             "teacher_top_logprobs": [-0.25, -1.5] * n, "reward": 0.0, "finished": True, "truncated": False,
             "task": "t", "actor_id": "a"} for i, n in enumerate([2, 1])]
    samples = rows_to_samples([group_batch(rows)], version=0, first_index=0, cfg=cfg)
    assert samples[0].token_fields["teacher_top_ids"] == [[3, 7], [3, 7]]
    mb = _micro_batch(samples, cfg)
    assert mb.fields_N["teacher_top_logprobs"].tolist() == [[-0.25, -1.5]] * 3
    new = torch.tensor([[-0.5, -0.25, -1.5]] * 3, dtype=torch.float64)  # student = teacher at every position
    loss, stats = _loss_fn(cfg, 2, 0, torch.device("cpu"), [])(mb, new, None)
    assert loss.item() == 0.0 and float(stats["distill_top_k_kl_sum"]) == 0.0
    apart = torch.tensor([[-0.5, -1.0, -1.0]] * 3, dtype=torch.float64)  # columns 1.. are the student's top-k
    loss, _ = _loss_fn(cfg, 2, 0, torch.device("cpu"), [])(mb, apart, None)
    per_token = math.exp(-0.25) * (-0.25 + 1.0) + math.exp(-1.5) * (-1.5 + 1.0)
    assert loss.item() == pytest.approx(3 * per_token / 2, rel=1e-12)  # 3 tokens over the step's 2 sequences
    pad = padding_micro_batch(*_field_names(cfg))
    assert pad.fields_N["teacher_top_ids"].shape == (1, 2)
    assert padding_micro_batch(mb.fields_N, mb.seq_fields_S).fields_N["teacher_top_logprobs"].shape == (1, 2)
    bare = [{k: v for k, v in r.items() if not k.startswith("teacher_top")} for r in rows]
    with pytest.raises(ValueError, match="a-0 has 0 teacher top-k entries for 2 completion tokens"):
        rows_to_samples([group_batch(bare)], version=0, first_index=0, cfg=cfg)


def test_routed_experts_become_l_times_k_ids_per_token_and_r3_refuses_rows_without_them():
    """A mixture of experts' routing (inference.return_routed_experts, rl.routing_replay): 2 layers x top-2 per
    token in the row, split token by token for the trainer (moe.py replays or compares them)."""
    routed = [[(t * 4 + j) % 8 for t in range(n) for j in range(4)] for n in (2, 1)]
    rows = group_batch([
        {"run_id": "r", "group_id": "a", "sample_id": f"a-{i}", "prompt_token_ids": [1, 5],
         "completion_token_ids": [4] * len(v), "behaviour_logprobs": [-0.5] * len(v), "versions": v, "reward": 1.0 - i,
         "finished": True, "truncated": False, "task": "t", "actor_id": "a", "routed_experts": routed[i]}
        for i, v in enumerate([[0, 0], [0]])])
    base = ["run_dir=x", "model.path=m", "actor.attempts=2", "trainer.samples_per_step=2"]
    for option in ("inference.return_routed_experts=true", "rl.routing_replay=r3"):
        samples = rows_to_samples([rows], version=1, first_index=0, cfg=load_config(None, base + [option]))
        assert samples[0].token_fields["routed_experts"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert samples[1].token_fields["routed_experts"] == [[0, 1, 2, 3]]
        mb = pack(samples, 64)[0]
        assert mb.fields_N["routed_experts"].shape == (3, 4)
    plain = rows_to_samples([rows], version=1, first_index=0, cfg=load_config(None, base))
    assert "routed_experts" not in plain[0].token_fields  # not asked for: not carried
    with pytest.raises(ValueError, match="routed-expert ids"):
        rows_to_samples([_group("a", [1.0, 0.0], [[0], [0]])], version=1, first_index=0,
                        cfg=load_config(None, base + ["rl.routing_replay=r3"]))
    multi_turn = base + ["task.name=tool_sums", "rl.routing_replay=r3"]
    with pytest.raises(ConfigError, match="rl.routing_replay"):
        load_config(None, multi_turn)


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
    loss, stats = _loss_fn(cfg, 2, 0, torch.device("cpu"), token_log)(mb, new, values)
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
    token_fields, seq_fields = _field_names(cfg)
    assert (list(mb.fields_N), list(mb.seq_fields_S)) == (list(token_fields), seq_fields)
    pad = padding_micro_batch(*_field_names(cfg))
    loss_fn = _loss_fn(cfg, 6, 1, torch.device("cpu"), [])
    new = torch.full((pad.target_pos_N.numel(),), -0.3, dtype=torch.float64, requires_grad=True)
    pad_loss, pad_stats = loss_fn(pad, new, None)
    real_loss, real_stats = loss_fn(mb, torch.full((mb.target_pos_N.numel(),), -0.3, dtype=torch.float64), None)
    assert pad_loss.item() == 0.0 and real_loss.item() != 0.0
    assert pad_stats.keys() == real_stats.keys()
    assert all(float(v.abs().sum()) == 0.0 for v in pad_stats.values())
    pad_loss.backward()
    assert new.grad is not None  # the padding pass still reaches every parameter


class ShiftedScores:
    """Stands in for DeepSpeedTrainer in `train_step` (the loop's arithmetic is under test, not the model):
    the current log-prob of each token is its reference log-prob + SHIFT * its DPO role, so a pair's
    margin is SHIFT * (chosen tokens + rejected tokens)."""

    SHIFT = 0.25
    device = torch.device("cpu")
    router_tap = None  # a dense model

    def __init__(self):
        self.losses = []

    def accumulate(self, micro_batches, loss_fn):
        stats = []
        for mb in micro_batches:
            role_N = mb.seq_fields_S["advantage"][mb.row_seq_N]
            new = (mb.fields_N["reference"] + self.SHIFT * role_N).requires_grad_()
            loss, mb_stats = loss_fn(mb, new, None)
            loss.backward()
            self.losses.append(loss.item())
            stats.append(mb_stats)
        return stats

    def optimizer_step(self):
        return {}


def _dpo_step(share: int, rank: int = 0, world: int = 1) -> dict:
    """One DPO train_step on the given rank of share `share`'s samples: share 0 holds two pairs (chosen 3 /
    rejected 1 tokens, then chosen 2 / rejected 3 tokens), share 1 only a tied group (no pair: the padding
    pass gives its statistics). Returns the step's statistics and this rank's micro-batch losses."""
    cfg = load_config(None, ["run_dir=x", "model.path=m", "actor.attempts=3", "trainer.samples_per_step=9",
                             "rl.algorithm=dpo"])
    ref = [[-0.1, -0.2], [-0.3, -0.4, -0.5], [-0.6]]
    if share == 0:
        batches = [_group("a", [0.2, 0.9, 0.1], [[0, 0], [0, 0, 0], [0]], reference=ref),
                   _group("b", [1.0, 0.0, 0.5], [[0, 0], [0, 0, 0], [0]], reference=ref)]
    else:
        batches = [_group("c", [1.0, 1.0, 1.0], [[0, 0], [0, 0, 0], [0]], reference=ref)]
    trainer = ShiftedScores()
    samples = rows_to_samples(batches, version=0, first_index=0, cfg=cfg)
    stats = train_step(trainer, samples, cfg, DistInfo(rank, world, rank, "gloo"), LoopState(), [])
    return {"stats": stats, "losses": trainer.losses}


MARGINS = [ShiftedScores.SHIFT * (3 + 1), ShiftedScores.SHIFT * (2 + 3)]  # share 0's two pairs
PAIR_LOSSES = [math.log1p(math.exp(-0.1 * m)) for m in MARGINS]  # -log sigmoid(beta m), beta 0.1


def test_dpo_step_loss_is_the_mean_over_its_pairs_and_a_step_without_pairs_is_zero():
    """Seed 004 on one rank: the step's DPO loss is the mean pair loss (not pairs / sequences); a step
    with no pair at all trains nothing, pads, and logs 0 instead of dividing by zero."""
    out = _dpo_step(share=0)
    stats = out["stats"]
    assert stats["dpo_pairs"] == 2 and stats["sequences"] == 6
    assert stats["dpo_loss"] == pytest.approx(sum(PAIR_LOSSES) / 2, rel=1e-12)
    assert sum(out["losses"]) == pytest.approx(sum(PAIR_LOSSES) / 2, rel=1e-12)
    assert stats["dpo_accuracy"] == 1.0 and stats["dpo_margin"] == pytest.approx(sum(MARGINS) / 2)
    out = _dpo_step(share=1)
    assert out["losses"] == [] and out["stats"]["dpo_pairs"] == 0 and out["stats"]["dpo_loss"] == 0.0


def _dpo_step_worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.save(_dpo_step(rank, rank, world), out_dir / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.slow  # two spawned gloo processes (no model): about 20 s on a loaded 2-core machine
def test_dpo_step_loss_is_the_mean_over_the_pairs_of_every_rank(tmp_path):
    """Two real ranks: the pair count is all-reduced, so both log the mean over rank 0's two pairs; rank
    1, with none, still joins the step (padding pass) and adds 0."""
    mp.spawn(_dpo_step_worker, args=(2, free_port(worker_port(18790)), tmp_path), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for out in ranks:
        stats = out["stats"]
        assert stats["dpo_pairs"] == 2 and stats["sequences"] == 9
        assert stats["dpo_loss"] == pytest.approx(sum(PAIR_LOSSES) / 2, rel=1e-12)
        assert stats["dpo_accuracy"] == 1.0 and stats["dpo_margin"] == pytest.approx(sum(MARGINS) / 2)
    assert sum(ranks[0]["losses"]) == pytest.approx(sum(PAIR_LOSSES) / 2, rel=1e-12) and ranks[1]["losses"] == []


def test_a_rank_with_nothing_to_train_logs_the_teacher_top_k_keys_as_zeros():
    """rl.teacher_top_k: a rank whose share holds only empty completions trains nothing, yet its statistics have
    the same keys as the other ranks' (the all-reduce needs them), from a padding pass shaped [1, 1 + k]; its
    per-token mean is NaN (no token), as every per-token mean of an empty step."""
    cfg = load_config(None, ["run_dir=x", "model.path=m", "actor.attempts=2", "rl.teacher=t", "rl.teacher_top_k=3"])
    batches = [_group("a", [1.0, 0.0], [[], []])]
    samples = rows_to_samples(batches, version=0, first_index=0, cfg=cfg)
    trainer = ShiftedScores()
    stats = train_step(trainer, samples, cfg, DistInfo(0, 1, 0, "gloo"), LoopState(), [])
    assert trainer.losses == [] and stats["distill_top_k_loss"] == 0.0 and stats["kept_tokens"] == 0.0
    assert math.isnan(stats["distill_top_k_kl"]) and math.isnan(stats["distill_reverse_kl"])


def test_tokens_of_a_discarded_lineage_lag_from_the_resume_point_never_negative():
    """The trainer reached version 6, died, resumed from step 3 and now trains version 4: tokens sampled by
    the dead lineage's versions 5 and 6 share its weights up to 3, so they lag 4 - 3; the others as usual."""
    from pipelinerl.trainer.loop import token_lags

    assert token_lags(4, [2, 3, 4, 5, 6], resumed=3) == [2, 1, 0, 1, 1]
    assert token_lags(4, [1, 4], resumed=0) == [3, 0]
    cfg = load_config(None, ["run_dir=x", "model.path=m", "actor.attempts=2", "trainer.samples_per_step=2"])
    samples = rows_to_samples([_group("a", [1.0, 0.0], [[6, 6], [3]])], version=4, first_index=0, cfg=cfg,
                              resumed=3)
    assert [s.token_fields["lag"] for s in samples] == [[1, 1], [1]]

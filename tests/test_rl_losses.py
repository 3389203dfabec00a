"""compute_loss against a float64 per-sequence loop, hand-computed numbers and the packing invariance."""

import math
import random

import pytest
import torch

from pipelinerl.config import ConfigError, RLConfig
from pipelinerl.rl import LossInputs, compute_loss, merge_stats, summarize_stats


def make_sequences(seed, num_groups=3, group_size=4, max_len=7):
    """Random sequences: prompt tokens (mask 0) then completion tokens, with lags and log-probs."""
    rng = random.Random(seed)
    seqs = []
    for g in range(num_groups):
        for k in range(group_size):
            n = rng.randint(2, max_len)
            prompt = rng.randint(0, 2)
            seqs.append({
                "id": 100 * g + k, "group": 7 * g + 3, "adv": rng.uniform(-1.5, 1.5), "base": rng.uniform(-2, 0),
                "role": 1 if k == 0 else (-1 if k == 1 else 0),
                "new": [rng.uniform(-3.0, -0.05) for _ in range(n)],
                "beh": [rng.uniform(-3.0, -0.05) for _ in range(n)],
                "ref": [rng.uniform(-3.0, -0.05) for _ in range(n)],
                "val": [rng.uniform(-1, 1) for _ in range(n)],
                "ret": [rng.uniform(-1, 1) for _ in range(n)],
                "mask": [t >= prompt for t in range(n)],
                "lag": [rng.randint(0, 5) for _ in range(n)],
            })
    return seqs


def reference_loss(seqs, num_sequences, cfg, num_pairs=None):
    """The objective written token by token in float64, one sequence at a time: per-token terms over
    num_sequences, DPO's pair terms over num_pairs (the mean pair loss). The KL is not clamped."""
    total = 0.0
    margins = {}
    for s in seqs:
        for t in range(len(s["new"])):
            if not s["mask"][t] or (cfg.max_token_lag is not None and s["lag"][t] > cfg.max_token_lag):
                continue
            new, beh, ref, adv = s["new"][t], s["beh"][t], s["ref"][t], s["adv"]
            if cfg.teacher is not None:  # on-policy distillation: the reference is the teacher
                adv = cfg.teacher_coef * (ref - beh - s["base"]) + cfg.teacher_task_weight * adv
            r = math.exp(new - beh)
            if cfg.algorithm == "dpo":
                anchor = ref if cfg.dpo_reference == "reference" else beh
                margins[s["group"]] = margins.get(s["group"], 0.0) + s["role"] * (new - anchor)
            elif cfg.ppo_clip is not None:
                total -= min(r * adv, min(max(r, 1 - cfg.ppo_clip), 1 + cfg.ppo_clip) * adv)
            elif cfg.tis_cap is not None:
                total -= min(r, cfg.tis_cap) * adv
            else:
                total -= r * adv
            total += cfg.kl_coef * (math.exp(ref - new) - (ref - new) - 1)
            if cfg.value_function:
                total += cfg.value_coef * (s["val"][t] - s["ret"][t]) ** 2
    pair_total = sum(math.log1p(math.exp(-cfg.dpo_beta * margin)) for margin in margins.values())
    return total / num_sequences + (pair_total / num_pairs if margins else 0.0)


def pack(seqs, dtype=torch.float64):
    """Concatenate sequences into one micro-batch; 'new' and 'val' are leaves that collect gradients."""
    def cat(key, dt=dtype):
        return torch.cat([torch.tensor(s[key], dtype=dt) for s in seqs])
    new_leaves = [torch.tensor(s["new"], dtype=dtype, requires_grad=True) for s in seqs]
    val_leaves = [torch.tensor(s["val"], dtype=dtype, requires_grad=True) for s in seqs]
    def per_token(key):
        return torch.cat([torch.full((len(s["new"]),), s[key]) for s in seqs])
    batch = {"new_logprobs_T": torch.cat(new_leaves), "behaviour_logprobs_T": cat("beh"),
             "mask_T": cat("mask", torch.bool), "lag_T": cat("lag", torch.long), "seq_index_T": per_token("id"),
             "ref_logprobs_T": cat("ref"), "values_T": torch.cat(val_leaves), "returns_T": cat("ret"),
             "group_index_T": per_token("group"),
             "distill_baseline_T": torch.cat([torch.full((len(s["new"]),), s["base"], dtype=dtype) for s in seqs])}
    return batch, new_leaves, val_leaves


def run_loss(seqs, num_sequences, cfg, num_pairs=None):
    batch, new_leaves, val_leaves = pack(seqs)
    key = "role" if cfg.algorithm == "dpo" else "adv"
    adv_T = torch.cat([torch.full((len(s["new"]),), float(s[key]), dtype=torch.float64) for s in seqs])
    inputs = LossInputs(advantages_T=adv_T, num_sequences=num_sequences, num_pairs=num_pairs, **batch)
    loss, stats = compute_loss(inputs, cfg)
    return loss, stats, new_leaves, val_leaves


CONFIGS = {
    "default": RLConfig(),
    "ppo_clip": RLConfig(ppo_clip=0.2),
    "tis_cap": RLConfig(tis_cap=1.5),
    "lag_drop": RLConfig(max_token_lag=2),
    "kl": RLConfig(kl_coef=0.3),
    "value": RLConfig(value_function=True, value_coef=0.7),
    "dpo_behaviour": RLConfig(algorithm="dpo", dpo_beta=0.5, dpo_reference="behaviour"),
    "dpo_reference": RLConfig(algorithm="dpo", dpo_beta=0.5),
    "dpo_kl": RLConfig(algorithm="dpo", dpo_beta=0.5, kl_coef=0.2, max_token_lag=3),
    "all_pg": RLConfig(ppo_clip=0.1, max_token_lag=3, kl_coef=0.1, value_function=True, baseline="leave_one_out"),
    "distill": RLConfig(teacher="teacher", teacher_coef=0.7, teacher_task_weight=0.3, max_token_lag=3),
    "distill_clip_kl": RLConfig(teacher="teacher", ppo_clip=0.2, kl_coef=0.1),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_equals_float64_per_sequence_loop(name):
    cfg = CONFIGS[name]
    for seed in range(3):
        seqs = make_sequences(seed)  # 3 groups of 4, each with one pair; the step has 24 sequences, 5 pairs
        loss, _, _, _ = run_loss(seqs, num_sequences=24, cfg=cfg, num_pairs=5)
        assert loss.item() == pytest.approx(reference_loss(seqs, 24, cfg, num_pairs=5), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_and_gradient_do_not_depend_on_packing(name):
    cfg = CONFIGS[name]
    seqs = make_sequences(seed=5, num_groups=4)
    whole, _, new_w, val_w = run_loss(seqs, len(seqs), cfg, num_pairs=4)
    whole.backward()
    # Split the step's groups (DPO pairs must stay together) into micro-batches in a shuffled order.
    order = list(range(4))
    random.Random(1).shuffle(order)
    total, grads_new, grads_val, parts = 0.0, {}, {}, []
    for chunk in ([order[0]], order[1:3], [order[3]]):
        part = [s for g in chunk for s in seqs[4 * g: 4 * g + 4]]
        loss, stats, new_p, val_p = run_loss(part, len(seqs), cfg, num_pairs=4)
        loss.backward()
        total += loss.item()
        parts.append(stats)
        for s, leaf_n, leaf_v in zip(part, new_p, val_p):
            grads_new[s["id"]], grads_val[s["id"]] = leaf_n.grad, leaf_v.grad
    assert total == pytest.approx(whole.item(), rel=1e-12, abs=1e-14)
    for s, leaf_n, leaf_v in zip(seqs, new_w, val_w):
        torch.testing.assert_close(grads_new[s["id"]], leaf_n.grad, rtol=1e-12, atol=1e-15)
        if cfg.value_function:
            torch.testing.assert_close(grads_val[s["id"]], leaf_v.grad, rtol=1e-12, atol=1e-15)
    _, whole_stats, _, _ = run_loss(seqs, len(seqs), cfg, num_pairs=4)
    merged, reference = summarize_stats(merge_stats(parts)), summarize_stats(whole_stats)
    assert merged.keys() == reference.keys()
    for key in reference:
        assert merged[key] == pytest.approx(reference[key], rel=1e-9, nan_ok=True), key


def test_default_gradient_is_advantage_times_ratio():
    """d loss / d new_t = -A * exp(new_t - beh_t) / num_sequences on completion tokens, 0 elsewhere."""
    seqs = make_sequences(seed=2)
    loss, _, new_leaves, _ = run_loss(seqs, 10, RLConfig())
    loss.backward()
    for s, leaf in zip(seqs, new_leaves):
        expected = [-s["adv"] * math.exp(n - b) / 10 if m else 0.0
                    for n, b, m in zip(s["new"], s["beh"], s["mask"])]
        torch.testing.assert_close(leaf.grad, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)


def test_tis_gradient_is_capped_weight_and_ppo_zeroes_clipped_tokens():
    new = torch.tensor([math.log(0.5), math.log(0.9), math.log(0.2)], dtype=torch.float64, requires_grad=True)
    beh = torch.log(torch.tensor([0.25, 0.9, 0.4], dtype=torch.float64))  # ratios 2, 1, 0.5
    adv, mask, lag, seq = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64), torch.ones(3, dtype=torch.bool), \
        torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long)
    loss, stats = compute_loss(LossInputs(new, beh, adv, mask, lag, seq, 2), RLConfig(tis_cap=1.5))
    loss.backward()
    assert loss.item() == pytest.approx(-(1.5 + 1.0 - 0.5) / 2)
    torch.testing.assert_close(new.grad, torch.tensor([-1.5, -1.0, 0.5], dtype=torch.float64) / 2)
    assert summarize_stats(stats)["tis_capped_frac"] == pytest.approx(1 / 3)
    new.grad = None
    loss, stats = compute_loss(LossInputs(new, beh, adv, mask, lag, seq, 2), RLConfig(ppo_clip=0.2))
    loss.backward()
    # ratio 2 with A>0 is clipped at 1.2 (no gradient); ratio 0.5 with A<0 is clipped at 0.8 (no gradient).
    assert loss.item() == pytest.approx(-(1.2 + 1.0 - 0.8) / 2)
    torch.testing.assert_close(new.grad, torch.tensor([0.0, -0.5, 0.0], dtype=torch.float64))
    assert summarize_stats(stats)["ppo_clipped_frac"] == pytest.approx(2 / 3)


def test_lag_filter_drops_exactly_the_stale_tokens():
    new = torch.full((6,), -1.0, dtype=torch.float64, requires_grad=True)
    beh = torch.full((6,), -1.0, dtype=torch.float64)
    mask = torch.tensor([0, 1, 1, 1, 1, 1], dtype=torch.bool)
    lag = torch.tensor([9, 0, 3, 4, 5, 1])
    loss, stats = compute_loss(LossInputs(new, beh, torch.ones(6, dtype=torch.float64), mask, lag, torch.zeros(6), 1),
                               RLConfig(max_token_lag=3))
    loss.backward()
    assert loss.item() == pytest.approx(-3.0)
    assert new.grad.tolist() == [0.0, -1.0, -1.0, 0.0, 0.0, -1.0]
    summary = summarize_stats(stats)
    assert summary["kept_tokens"] == 3 and summary["lag_drop_frac"] == pytest.approx(2 / 5)
    assert summary["lag_max"] == 5 and summary["lag_mean"] == pytest.approx(13 / 5)  # the prompt token's lag is ignored


def test_dpo_loss_hand_computed():
    # Group 0: chosen (2 tokens), rejected (1 token), an unpaired attempt; group 1 has no pair.
    new = torch.tensor([-0.5, -1.0, -2.0, -0.1, -0.3, -0.4], dtype=torch.float64, requires_grad=True)
    beh = torch.tensor([-1.0, -1.0, -1.5, -3.0, -0.3, -0.4], dtype=torch.float64)
    roles = torch.tensor([1, 1, -1, 0, 0, 0], dtype=torch.float64)
    seq, group = torch.tensor([0, 0, 1, 2, 3, 4]), torch.tensor([0, 0, 0, 0, 1, 1])
    mask, lag = torch.ones(6, dtype=torch.bool), torch.zeros(6, dtype=torch.long)
    # The step has 5 sequences and 2 pairs (the other on another rank): the loss is a mean over pairs.
    cfg = RLConfig(algorithm="dpo", dpo_beta=2.0, dpo_reference="behaviour")
    loss, stats = compute_loss(LossInputs(new, beh, roles, mask, lag, seq, 5, group_index_T=group, num_pairs=2), cfg)
    margin = (0.5 + 0.0) - (-0.5)  # chosen's log-ratio sum minus rejected's
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-2.0 * margin))) / 2)
    summary = summarize_stats(stats)
    assert summary["dpo_pairs"] == 1 and summary["dpo_accuracy"] == 1 and summary["dpo_margin"] == pytest.approx(1.0)
    loss.backward()
    g = 2.0 * (1 - 1 / (1 + math.exp(-2.0))) / 2  # -d/dm log sigmoid(beta m) * beta / pairs
    torch.testing.assert_close(new.grad, torch.tensor([-g, -g, g, 0, 0, 0], dtype=torch.float64))


def test_dpo_rejects_a_pair_split_across_micro_batches():
    new = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(AssertionError, match="whole inside one micro-batch"):
        compute_loss(LossInputs(new, new, torch.tensor([1.0, 0.0]), torch.ones(2, dtype=torch.bool), torch.zeros(2),
                                torch.tensor([0, 1]), 4, group_index_T=torch.tensor([3, 3]), num_pairs=1),
                     RLConfig(algorithm="dpo", dpo_reference="behaviour"))


def test_dpo_anchors_at_the_reference_by_default_and_a_step_without_pairs_is_zero():
    """Seed 004: margins against the frozen initial model. No pair in the whole step: 0, not 0 / 0."""
    new = torch.tensor([-0.5, -2.0, -0.7], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.0, -1.5, -0.7], dtype=torch.float64)
    roles, seq, group = torch.tensor([1.0, -1.0, 0.0]), torch.tensor([0, 1, 2]), torch.tensor([0, 0, 1])
    mask, lag = torch.ones(3, dtype=torch.bool), torch.zeros(3, dtype=torch.long)
    assert RLConfig(algorithm="dpo").dpo_reference == "reference"
    loss, _ = compute_loss(LossInputs(new, new.detach(), roles, mask, lag, seq, 3, ref_logprobs_T=ref,
                                      group_index_T=group, num_pairs=1), RLConfig(algorithm="dpo"))
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.1 * (0.5 - (-0.5)))))  # beta 0.1, margin 1
    cfg = RLConfig(algorithm="dpo", kl_coef=0.5)
    loss, stats = compute_loss(LossInputs(new[2:], new[2:].detach(), roles[2:], mask[2:], lag[2:], seq[2:], 3,
                                          ref_logprobs_T=ref[2:], group_index_T=group[2:], num_pairs=0), cfg)
    loss.backward()
    assert loss.item() == 0.0 and stats["dpo_loss"].item() == 0.0 and stats["dpo_pairs"].item() == 0
    assert new.grad.tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(AssertionError, match="whole step's pairs"):
        compute_loss(LossInputs(new, new.detach(), roles, mask, lag, seq, 3, ref_logprobs_T=ref, group_index_T=group,
                                num_pairs=0), RLConfig(algorithm="dpo"))


def test_kl_term_hand_computed():
    new = torch.tensor([math.log(0.5)], dtype=torch.float64)
    ref = torch.tensor([math.log(0.25)], dtype=torch.float64)
    inputs = LossInputs(new, new, torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.bool),
                        torch.zeros(1), torch.zeros(1), 1, ref_logprobs_T=ref)
    loss, stats = compute_loss(inputs, RLConfig(kl_coef=2.0))
    assert loss.item() == pytest.approx(2.0 * (0.5 - math.log(0.5) - 1))
    assert stats["kl_loss"].item() == pytest.approx(loss.item())
    assert summarize_stats(stats)["kl_ref"] == pytest.approx(0.5 - math.log(0.5) - 1)  # per kept token, no coef


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_kl_log_ratio_is_clamped_so_a_rare_token_cannot_overflow(dtype):
    """log(ref / new) = 200 (exp overflows float32) and -200: finite loss and gradient, both clamped to
    the bound (constant there: no gradient); tokens inside the bound keep the float64 k3 exactly."""
    x = [200.0, -200.0, 9.5, -9.5, 0.3]  # log(ref / new) per token
    new = torch.tensor([-210.0, -1.0, -10.0, -0.5, -2.0], dtype=dtype, requires_grad=True)
    ref = new.detach().double() + torch.tensor(x, dtype=torch.float64)
    zeros = torch.zeros(5, dtype=torch.float64)
    loss, stats = compute_loss(LossInputs(new, new.detach(), zeros, torch.ones(5, dtype=torch.bool), torch.zeros(5),
                                          torch.arange(5), 1, ref_logprobs_T=ref.to(dtype)), RLConfig(kl_coef=1.0))
    loss.backward()
    assert torch.isfinite(loss) and bool(torch.isfinite(new.grad).all())
    def k3(v):
        return math.exp(v) - v - 1
    expected = [k3(10.0), k3(-10.0), k3(9.5), k3(-9.5), k3(0.3)]  # the bound of 10 for +-200
    exact = ref.to(dtype).double() - new.detach().double()  # the log-ratios as stored in this dtype
    expected[2:] = [k3(v) for v in exact[2:].tolist()]
    rel = 1e-12 if dtype == torch.float64 else 1e-2
    assert loss.item() == pytest.approx(sum(expected), rel=rel)
    assert new.grad[:2].tolist() == [0.0, 0.0]
    # d/dnew k3(ref - new) = 1 - exp(ref - new) inside the bound.
    assert new.grad[2:].double().tolist() == pytest.approx([1 - math.exp(v) for v in exact[2:].tolist()], rel=rel)
    assert summarize_stats(stats)["kl_ref"] == pytest.approx(sum(expected) / 5, rel=rel)


def test_config_rejects_conflicting_options():
    with pytest.raises(ConfigError, match="rl.tis_cap"):
        RLConfig(ppo_clip=0.2, tis_cap=2.0)
    with pytest.raises(ConfigError, match="rl.dpo_reference"):
        RLConfig(dpo_reference="sft")
    assert RLConfig(algorithm="dpo").needs_reference_logprobs  # seed 004: the frozen initial model
    assert not RLConfig(algorithm="dpo", dpo_reference="behaviour").needs_reference_logprobs
    assert RLConfig(kl_coef=0.1).needs_reference_logprobs and not RLConfig().needs_reference_logprobs


def test_distillation_advantage_is_teacher_minus_student_per_token_hand_computed():
    """rl.teacher, pure distillation: one 3-token sequence (the first a prompt token). Each completion token's
    gradient is -(teacher - behaviour) * exp(new - behaviour) / num_sequences; the logged reverse KL is the mean
    of behaviour - teacher over those tokens; the sequence's task advantage (5.0) weighs nothing."""
    cfg = RLConfig(teacher="teacher")
    beh, teacher, new = [-1.0, -0.5, -2.0], [-3.0, -0.25, -1.0], [-1.0, -0.7, -1.5]
    seq = {"id": 0, "group": 0, "adv": 5.0, "new": new, "beh": beh, "ref": teacher, "val": [0.0] * 3,
           "ret": [0.0] * 3, "mask": [False, True, True], "lag": [0, 0, 0], "role": 0, "base": 0.0}
    loss, stats, (leaf,), _ = run_loss([seq], num_sequences=2, cfg=cfg)
    loss.backward()
    expected = [0.0, -(0.25 * math.exp(-0.2)) / 2, -(1.0 * math.exp(0.5)) / 2]
    assert leaf.grad.tolist() == pytest.approx(expected, rel=1e-12)
    assert loss.item() == pytest.approx(sum(expected), rel=1e-12)  # ratio x advantage, the same sums
    assert summarize_stats(stats)["distill_reverse_kl"] == pytest.approx(((-0.5 + 0.25) + (-2.0 + 1.0)) / 2)
    mixed, _, _, _ = run_loss([seq], num_sequences=2, cfg=RLConfig(teacher="t", teacher_coef=2.0,
                                                                   teacher_task_weight=0.5))
    assert mixed.item() == pytest.approx(-(math.exp(-0.2) * (2 * 0.25 + 2.5) + math.exp(0.5) * (2 * 1.0 + 2.5)) / 2)
    based, _, _, _ = run_loss([{**seq, "base": -0.6}], num_sequences=2, cfg=cfg)  # the group's mean gap
    assert based.item() == pytest.approx(-(math.exp(-0.2) * (0.25 + 0.6) + math.exp(0.5) * (1.0 + 0.6)) / 2)


def test_distillation_config_is_refused_where_it_cannot_apply():
    with pytest.raises(ConfigError, match="rl.teacher"):
        RLConfig(teacher="t", algorithm="dpo")
    with pytest.raises(ConfigError, match="rl.teacher"):
        RLConfig(teacher="t", value_function=True)
    assert RLConfig(teacher="t").needs_reference_logprobs and not RLConfig().needs_reference_logprobs


def test_teacher_top_k_kl_is_hand_computed_and_replaces_the_sampled_gap():
    """rl.teacher_top_k=2: one 3-token sequence (the first a prompt token). Each completion token adds
    teacher_coef x sum_k q_k (log q_k - log p_k) / num_sequences, q the teacher's top-2 probabilities; the
    gradient on the student's top-k log-probs is -teacher_coef x q / num_sequences; the sampled token's gap
    gives no advantage (new_T gets no gradient) unless teacher_task_weight mixes in the task advantage."""
    teacher = [[-0.1, -2.5], [-0.7, -0.9], [-0.2, -3.0]]
    student = [[-1.0, -1.0], [-0.3, -2.0], [-1.5, -0.4]]
    seq = {"id": 0, "group": 0, "adv": 5.0, "new": [-1.0, -0.7, -1.5], "beh": [-1.0, -0.5, -2.0],
           "ref": [-3.0, -0.25, -1.0], "val": [0.0] * 3, "ret": [0.0] * 3, "mask": [False, True, True],
           "lag": [0, 0, 0], "role": 0, "base": 0.0}

    def run(cfg):
        batch, (leaf,), _ = pack([seq])
        student_TK = torch.tensor(student, dtype=torch.float64, requires_grad=True)
        inputs = LossInputs(advantages_T=torch.full((3,), 5.0, dtype=torch.float64), num_sequences=2, **batch,
                            teacher_top_logprobs_TK=torch.tensor(teacher, dtype=torch.float64),
                            student_top_logprobs_TK=student_TK)
        loss, stats = compute_loss(inputs, cfg)
        loss.backward()
        return loss.item(), stats, leaf.grad, student_TK.grad

    kl = [sum(math.exp(q) * (q - p) for q, p in zip(teacher[t], student[t])) for t in (1, 2)]
    loss, stats, new_grad, top_grad = run(RLConfig(teacher="t", teacher_top_k=2, teacher_coef=0.5))
    assert loss == pytest.approx(0.5 * sum(kl) / 2, rel=1e-12)
    assert new_grad.tolist() == [0.0, 0.0, 0.0]
    assert top_grad[0].tolist() == [0.0, 0.0]  # the prompt token
    for t in (1, 2):
        assert top_grad[t].tolist() == pytest.approx([-0.5 * math.exp(q) / 2 for q in teacher[t]], rel=1e-12)
    summary = summarize_stats(stats)
    assert summary["distill_top_k_kl"] == pytest.approx(sum(kl) / 2, rel=1e-12)
    assert summary["distill_reverse_kl"] == pytest.approx(((-0.5 + 0.25) + (-2.0 + 1.0)) / 2)  # still logged
    mixed, _, new_grad, _ = run(RLConfig(teacher="t", teacher_top_k=2, teacher_coef=0.5, teacher_task_weight=0.2))
    ratios = [math.exp(-0.2), math.exp(0.5)]
    assert mixed == pytest.approx(0.5 * sum(kl) / 2 - sum(0.2 * 5.0 * r for r in ratios) / 2, rel=1e-12)
    assert new_grad.tolist() == pytest.approx([0.0] + [-0.2 * 5.0 * r / 2 for r in ratios], rel=1e-12)


def test_teacher_top_k_config_is_refused_without_a_teacher():
    with pytest.raises(ConfigError, match="rl.teacher_top_k"):
        RLConfig(teacher_top_k=4)
    with pytest.raises(ConfigError, match="rl.teacher_top_k"):
        RLConfig(teacher="t", teacher_top_k=-1)

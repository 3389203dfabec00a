"""Group advantages, DPO pair roles and GAE against hand-computed values and float64 references."""

import pytest
import torch

from pipelinerl.rl import dpo_roles, gae_advantages, group_advantages, terminal_rewards


def test_group_mean_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([5, 5, 5, 5, 9, 9])
    assert group_advantages(rewards, groups).tolist() == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0]
    loo = group_advantages(rewards, groups, baseline="leave_one_out")
    torch.testing.assert_close(loo, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0]))
    std = (1 / 3) ** 0.5  # Bessel-corrected std of [1, 0, 0, 1]
    normed = group_advantages(rewards, groups, divide_by_std=True)
    torch.testing.assert_close(normed, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0]) / torch.tensor(
        [std + 1e-6] * 4 + [1e-6] * 2))
    assert normed[4:].tolist() == [0.0, 0.0]  # equal rewards: advantage 0, no division by zero


@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
@pytest.mark.parametrize("divide_by_std", [False, True])
def test_group_advantages_match_a_groups_by_attempts_view(baseline, divide_by_std):
    gen = torch.Generator().manual_seed(0)
    rewards_GK = torch.rand(6, 5, generator=gen, dtype=torch.float64)
    # Interleave the groups in the flat order, with arbitrary group ids, as a stream would.
    perm = torch.randperm(30, generator=gen)
    group_ids = (torch.arange(6) * 11 + 4).repeat_interleave(5)
    flat = group_advantages(rewards_GK.reshape(-1)[perm], group_ids[perm], baseline, divide_by_std)
    others = (rewards_GK.sum(1, keepdim=True) - rewards_GK) / 4
    expected = rewards_GK - (rewards_GK.mean(1, keepdim=True) if baseline == "mean" else others)
    if divide_by_std:
        expected = expected / (rewards_GK.std(1, keepdim=True) + 1e-6)
    torch.testing.assert_close(flat, expected.reshape(-1)[perm], rtol=1e-12, atol=1e-12)


def test_dpo_roles_best_and_worst_with_ties_and_no_preference():
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.5, 0.5, 0.5, 2.0, -1.0])
    groups = torch.tensor([1, 1, 1, 1, 2, 2, 2, 3, 3])
    assert dpo_roles(rewards, groups).tolist() == [-1, 1, 0, 0, 0, 0, 0, 1, -1]


def test_terminal_rewards_sit_on_the_last_completion_token():
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0], dtype=torch.bool)
    rewards = terminal_rewards(torch.tensor([3.0, 4.0, 5.0]), seq, mask)
    assert rewards.tolist() == [0, 0, 3, 0, 4, 0, 5, 0]


def reference_gae(rewards, values, gamma, lam):
    """A_t = sum_k (gamma*lam)^k delta_{t+k}, delta_t = r_t + gamma V_{t+1} - V_t, V after the end = 0."""
    n = len(rewards)
    deltas = [rewards[t] + gamma * (values[t + 1] if t + 1 < n else 0.0) - values[t] for t in range(n)]
    return [sum((gamma * lam) ** (k - t) * deltas[k] for k in range(t, n)) for t in range(n)]


def test_gae_hand_computed_and_monte_carlo_limit():
    rewards, values = torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 0.6, 0.8])
    adv, ret = gae_advantages(rewards, values, torch.zeros(3), gamma=0.9, lam=0.5)
    d = [0.9 * 0.6 - 0.5, 0.9 * 0.8 - 0.6, 1.0 - 0.8]
    expected = [d[0] + 0.45 * d[1] + 0.45 ** 2 * d[2], d[1] + 0.45 * d[2], d[2]]
    torch.testing.assert_close(adv, torch.tensor(expected))
    torch.testing.assert_close(ret, adv + values)
    adv, ret = gae_advantages(rewards, values, torch.zeros(3), gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret, torch.ones(3))  # lambda = 1: returns are the Monte-Carlo return


def test_gae_packed_sequences_match_per_sequence_reference():
    gen = torch.Generator().manual_seed(3)
    lengths = [4, 1, 6, 3]
    seq = torch.cat([torch.full((n,), 10 + i) for i, n in enumerate(lengths)])
    rewards = torch.rand(len(seq), generator=gen, dtype=torch.float64)
    values = torch.rand(len(seq), generator=gen, dtype=torch.float64)
    adv, _ = gae_advantages(rewards, values, seq, gamma=0.95, lam=0.8)
    expected, start = [], 0
    for n in lengths:
        expected += reference_gae(rewards[start:start + n].tolist(), values[start:start + n].tolist(), 0.95, 0.8)
        start += n
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)

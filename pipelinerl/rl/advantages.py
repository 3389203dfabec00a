"""Advantages: group baselines (GRPO), GAE for the critic option, and online-DPO pair roles.

Shapes: ``_N`` one entry per sequence, ``_G`` one per group (the G attempts at one prompt), ``_T`` one
per packed token. Group and sequence ids may be any integers: they are relabelled locally.
"""

from __future__ import annotations

import torch


def _local_groups(group_index_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dense group id per sequence in 0..G-1, sequences per group)."""
    _, dense_N = torch.unique(group_index_N, return_inverse=True)
    count_G = torch.bincount(dense_N)
    return dense_N, count_G


def group_advantages(rewards_N: torch.Tensor, group_index_N: torch.Tensor, baseline: str = "mean",
                     divide_by_std: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """Advantage of each sequence against the other attempts at the same prompt.

    baseline="mean": reward - group mean (seed 000's GRPO). baseline="leave_one_out": reward - mean of
    the *other* G-1 rewards (RLOO), which keeps the baseline independent of the sample it scores.
    divide_by_std: divide by the group's sample standard deviation (Bessel-corrected, as the original
    GRPO's ``Tensor.std``) + eps; a group with equal rewards then gets advantage 0, not a division by 0.
    """
    assert rewards_N.dim() == 1 and rewards_N.shape == group_index_N.shape
    dense_N, count_G = _local_groups(group_index_N)
    assert int(count_G.min()) >= 2, "every group needs at least 2 attempts (whole groups only)"
    rewards_N = rewards_N.to(torch.promote_types(rewards_N.dtype, torch.float32))
    sum_G = torch.zeros(count_G.shape, dtype=rewards_N.dtype, device=rewards_N.device)
    sum_G.index_add_(0, dense_N, rewards_N)
    count_N = count_G[dense_N].to(rewards_N.dtype)
    mean_N = sum_G[dense_N] / count_N
    if baseline == "mean":
        advantages_N = rewards_N - mean_N
    elif baseline == "leave_one_out":
        advantages_N = rewards_N - (sum_G[dense_N] - rewards_N) / (count_N - 1)
    else:
        raise ValueError(f"unknown baseline {baseline!r}; use 'mean' or 'leave_one_out'")
    if divide_by_std:
        sq_G = torch.zeros_like(sum_G).index_add_(0, dense_N, (rewards_N - mean_N) ** 2)
        std_N = (sq_G[dense_N] / (count_N - 1)).sqrt()
        advantages_N = advantages_N / (std_N + eps)
    return advantages_N


def dpo_roles(rewards_N: torch.Tensor, group_index_N: torch.Tensor) -> torch.Tensor:
    """Online-DPO pair of each group: +1 for the best attempt, -1 for the worst, 0 for the rest.

    Ties are broken by the lowest index, so the choice is deterministic. A group whose rewards are all
    equal has no preference and gets no pair (all 0).
    """
    dense_N, count_G = _local_groups(group_index_N)
    num_groups, n = count_G.numel(), rewards_N.numel()
    rewards_N = rewards_N.to(torch.float64)
    best_G = torch.full((num_groups,), -torch.inf, dtype=torch.float64, device=rewards_N.device)
    best_G = best_G.scatter_reduce(0, dense_N, rewards_N, "amax")
    worst_G = torch.full_like(best_G, torch.inf).scatter_reduce(0, dense_N, rewards_N, "amin")
    index_N = torch.arange(n, device=rewards_N.device)
    roles_N = torch.zeros(n, dtype=torch.long, device=rewards_N.device)
    for target_G, role in ((best_G, 1), (worst_G, -1)):
        hit_N = rewards_N == target_G[dense_N]
        first_G = torch.full((num_groups,), n, dtype=torch.long, device=rewards_N.device)
        first_G = first_G.scatter_reduce(0, dense_N[hit_N], index_N[hit_N], "amin")
        roles_N[first_G] = role
    roles_N[(best_G == worst_G)[dense_N]] = 0
    return roles_N


def terminal_rewards(rewards_N: torch.Tensor, seq_index_T: torch.Tensor, mask_T: torch.Tensor) -> torch.Tensor:
    """Per-token rewards for GAE: each sequence's reward sits on its last masked (completion) token.

    seq_index_T indexes rewards_N directly (values in 0..N-1).
    """
    rewards_T = torch.zeros(seq_index_T.shape, dtype=rewards_N.dtype, device=rewards_N.device)
    position_T = torch.arange(seq_index_T.numel(), device=seq_index_T.device)
    last_N = torch.full(rewards_N.shape, -1, dtype=torch.long, device=seq_index_T.device)
    last_N = last_N.scatter_reduce(0, seq_index_T[mask_T], position_T[mask_T], "amax")
    has_N = last_N >= 0
    rewards_T[last_N[has_N]] = rewards_N[has_N]
    return rewards_T


def gae_advantages(rewards_T: torch.Tensor, values_T: torch.Tensor, seq_index_T: torch.Tensor,
                   gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over packed sequences -> (advantages_T, returns_T).

    Each sequence's tokens must be contiguous and in order. values_T[t] is the critic's value of the
    state in which token t was chosen (aligned like the log-probs); the state after a sequence's last
    token is terminal (value 0): a truncated completion is scored as finished with its reward.
    returns_T = advantages_T + values_T is the critic's regression target. No gradient flows.
    """
    # A sequential scan: the recurrence A_t = delta_t + gamma*lam*A_{t+1} has no stable closed form
    # for long sequences ((gamma*lam)^t underflows), and a Python loop over floats is fast on CPU.
    rewards = rewards_T.detach().double().tolist()
    values = values_T.detach().double().tolist()
    seq = seq_index_T.tolist()
    advantages = [0.0] * len(rewards)
    running, next_value = 0.0, 0.0
    for t in reversed(range(len(rewards))):
        if t == len(rewards) - 1 or seq[t + 1] != seq[t]:
            running, next_value = 0.0, 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
        next_value = values[t]
    advantages_T = torch.tensor(advantages, dtype=values_T.dtype, device=values_T.device)
    return advantages_T, advantages_T + values_T.detach()


def distill_advantages(teacher_T: torch.Tensor, student_T: torch.Tensor, baseline_T: torch.Tensor,
                       task_T: torch.Tensor, keep_T: torch.Tensor, coef: float,
                       task_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation: each kept token's advantage is coef x (log teacher - log student - baseline) of the
    sampled token, plus task_weight x the task's advantage; 0 on other tokens. log teacher - log student is the
    negative of the per-token estimate of KL(student || teacher) on the student's samples (a token the teacher
    finds likelier is reinforced); the baseline (its group's mean over model tokens: trainer/loop.py) leaves the
    expected gradient as it is (E[grad log p] = 0) and removes most of its variance: without it nearly every
    sampled token of a weak student has a negative advantage (the tiny student's mean: -2.2 nats), every sampled
    token is pushed down, and at lr 1e-3 the tiny student drifted away from the teacher (reverse KL 2.1 -> 5-8).
    Returns the advantages and the reverse-KL estimate summed over the kept tokens."""
    gap_T = (teacher_T - student_T) * keep_T
    return coef * (gap_T - baseline_T * keep_T) + task_weight * task_T * keep_T, -gap_T.sum()


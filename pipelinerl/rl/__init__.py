"""RL maths: pure tensor functions (no torch.distributed, no device choice, no I/O).

Suffixes name shapes: ``_N`` one entry per sequence (sample), ``_T`` one per packed token of a
micro-batch (several sequences concatenated), ``_G`` one per group (prompt).
"""

from pipelinerl.rl.advantages import (
    dpo_roles,
    gae_advantages,
    group_advantages,
    terminal_rewards,
)
from pipelinerl.rl.losses import LossInputs, compute_loss
from pipelinerl.rl.stats import LAG_HIST_BINS, merge_stats, summarize_stats

__all__ = [
    "LAG_HIST_BINS",
    "LossInputs",
    "compute_loss",
    "dpo_roles",
    "gae_advantages",
    "group_advantages",
    "merge_stats",
    "summarize_stats",
    "terminal_rewards",
]

"""The RL objective of one packed micro-batch: `compute_loss`, the trainer's single entry point.

Each term is a *sum* over this micro-batch divided by a count of the whole optimizer step (all
micro-batches, all ranks), so summing the micro-batch losses of a step gives the same value and
gradient whatever the packing. The normalisation is mixed:

- policy gradient (with rl.teacher: per-token distillation advantages, advantages.distill_advantages), KL to the
  reference, the teacher top-k KL (rl.teacher_top_k), value loss: per-token sums over ``num_sequences``, the step's
  sequences (seed 000: loss normalised by the number of sequences, every token weighs the same);
- online DPO: the sum over pairs over ``num_pairs``, the step's (chosen, rejected) pairs, i.e. the mean
  pair loss (seed 004). With a KL term a DPO step mixes both: mean pair loss + kl_coef * KL per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipelinerl.config import RLConfig
from pipelinerl.rl.advantages import distill_advantages
from pipelinerl.rl.stats import k3_kl, token_stats

# |log(ref / new)| bound inside the k3 KL term. A token the current policy has moved far from the
# reference (a rare token, or a -inf/underflowed log-prob) would otherwise overflow exp(): float32 and
# bfloat16 overflow at exp(89), float16 at exp(11.1). With 10 one token's k3 is at most e^10 - 11 ~ 2.2e4,
# finite in every dtype the trainer uses, and tokens inside the bound (ratios 4.5e-5 .. 2.2e4) are
# untouched. Outside it the term is constant: such tokens get no KL gradient.
KL_LOG_RATIO_BOUND = 10.0


def kept_tokens(mask_T: torch.Tensor, lag_T: torch.Tensor, max_token_lag: int | None) -> torch.Tensor:
    """Completion tokens that get loss: seed 001 proposes excluding tokens of very high lag."""
    if max_token_lag is None:
        return mask_T
    return mask_T & (lag_T <= max_token_lag)


def _policy_gradient(new_T, behaviour_T, advantages_T, keep_T, cfg: RLConfig):
    """Per-token surrogate (to be maximised) and clip/cap counts.

    Default (seed 000): ratio * A with ratio = exp(new - behaviour), no clamping, so the gradient is
    A * ratio * grad(log pi). tis_cap: sg(min(ratio, cap) / ratio) * ratio * A, whose gradient is
    A * min(ratio, cap) * grad(log pi) (truncated IS keeps a gradient on capped tokens, unlike PPO).
    ppo_clip: min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A).
    """
    ratio_T = (new_T - behaviour_T).exp()
    counts = {}
    if cfg.ppo_clip is not None:
        eps = cfg.ppo_clip
        clipped_T = ratio_T.clamp(1 - eps, 1 + eps) * advantages_T
        surrogate_T = torch.minimum(ratio_T * advantages_T, clipped_T)
        active_T = ((advantages_T > 0) & (ratio_T > 1 + eps)) | ((advantages_T < 0) & (ratio_T < 1 - eps))
        counts["ppo_clipped_tokens"] = (active_T & keep_T).sum().double()
    elif cfg.tis_cap is not None:
        weight_T = ratio_T.detach().clamp(max=cfg.tis_cap)
        surrogate_T = (weight_T / ratio_T.detach()) * ratio_T * advantages_T
        counts["tis_capped_tokens"] = ((ratio_T.detach() > cfg.tis_cap) & keep_T).sum().double()
    else:
        surrogate_T = ratio_T * advantages_T
    return -(surrogate_T * keep_T).sum(), counts


def _dense(index_T: torch.Tensor) -> torch.Tensor:
    return torch.unique(index_T, return_inverse=True)[1]


def _dpo(new_T, reference_T, roles_T, keep_T, seq_index_T, group_index_T, beta: float):
    """Online DPO (seed 004) on each group's (chosen, rejected) pair; both must be in this micro-batch.

    margin_g = [log pi(c) - log ref(c)] - [log pi(r) - log ref(r)], sequence log-probs summed over kept
    tokens; loss_g = -log sigmoid(beta * margin_g).
    """
    assert group_index_T is not None, "algorithm=dpo needs group_index_T (pairs are matched by group)"
    assert bool(((roles_T == 1) | (roles_T == -1) | (roles_T == 0)).all()), "dpo roles must be +1/-1/0"
    seq_T, group_T = _dense(seq_index_T), _dense(group_index_T)
    num_seq, num_groups = int(seq_T.max()) + 1, int(group_T.max()) + 1
    # Each sequence's group and role, read from its tokens (constant within a sequence).
    seq_group_S = torch.zeros(num_seq, dtype=torch.long, device=new_T.device).scatter(0, seq_T, group_T)
    seq_role_S = torch.zeros(num_seq, dtype=torch.long, device=new_T.device).scatter(0, seq_T, roles_T.long())
    chosen_G = torch.bincount(seq_group_S[seq_role_S == 1], minlength=num_groups)
    rejected_G = torch.bincount(seq_group_S[seq_role_S == -1], minlength=num_groups)
    assert bool((chosen_G == rejected_G).all()) and int(chosen_G.max()) <= 1, \
        "a DPO pair must be whole inside one micro-batch: one chosen and one rejected sequence per group"
    contribution_T = roles_T * (new_T - reference_T) * keep_T
    margin_G = torch.zeros(num_groups, dtype=new_T.dtype, device=new_T.device).index_add(0, group_T, contribution_T)
    pair_G = chosen_G == 1
    margin_P = margin_G[pair_G]
    counts = {"dpo_pairs": pair_G.sum().double(), "dpo_correct_pairs": (margin_P > 0).sum().double(),
              "dpo_margin_sum": margin_P.detach().double().sum()}
    return -F.logsigmoid(beta * margin_P).sum(), counts


def _kl_to_reference(new_T, ref_T, keep_T, num_sequences: int, kl_coef: float):
    """kl_coef * the k3 estimate of KL(pi || ref) summed over kept tokens / num_sequences (Schulman 2020),
    the log-ratio clamped to +-KL_LOG_RATIO_BOUND; and its statistics (kl_ref_sum: the same k3, no coef)."""
    kl_sum = (k3_kl(ref_T - new_T, KL_LOG_RATIO_BOUND) * keep_T).sum()
    kl_loss = kl_coef * kl_sum / num_sequences
    return kl_loss, {"kl_loss": kl_loss.detach().double(), "kl_ref_sum": kl_sum.detach().double()}


def _kl_to_teacher_top_k(teacher_TK, student_TK, keep_T, num_sequences: int, coef: float):
    """rl.teacher_top_k: coef * KL(teacher top-k || student) summed over kept tokens / num_sequences, and its
    statistics. At each position the KL is the sum over the teacher's k likeliest tokens of q (log q - log p), q
    their teacher probabilities, log p the student's log-probs of the same tokens; the teacher's mass outside its
    top-k is left out (q is not renormalised), so with k = the vocabulary it is the exact forward KL. Its gradient,
    -sum_k q_k grad log p_k, is the cross-entropy's toward the teacher at every position of the student's own
    samples (on-policy distillation with a dense target, as in GKD), with no sampling noise per position, unlike
    the sampled token's gap (advantages.distill_advantages)."""
    kl_T = (teacher_TK.exp() * (teacher_TK - student_TK)).sum(-1) * keep_T
    loss = coef * kl_T.sum() / num_sequences
    return loss, {"distill_top_k_loss": loss.detach().double(), "distill_top_k_kl_sum": kl_T.detach().sum().double()}


@dataclass
class LossInputs:
    """One packed micro-batch's tensors for `compute_loss`. T = packed completion tokens of several sequences.

    Counts are of the whole optimizer step (all micro-batches, all ranks), so micro-batch losses add up."""

    new_logprobs_T: torch.Tensor  # [T] float: log pi_current(token), carries the gradient
    behaviour_logprobs_T: torch.Tensor  # [T] float: log-prob reported by the inference server that sampled it
    advantages_T: torch.Tensor  # [T] float: the sequence's advantage on each of its tokens (grpo), GAE
    # advantages (value_function), or the DPO role +1 chosen / -1 rejected / 0 unpaired (dpo, see `dpo_roles`)
    mask_T: torch.Tensor  # [T] bool: tokens that may get loss: the model's (not prompt nor environment tokens)
    lag_T: torch.Tensor  # [T] int: trainer version - version that produced the token
    seq_index_T: torch.Tensor  # [T] int: any id of each token's sequence
    num_sequences: int  # sequences in the whole optimizer step, all ranks (> 0)
    ref_logprobs_T: torch.Tensor | None = None  # [T] float: reference model; when cfg.needs_reference_logprobs
    values_T: torch.Tensor | None = None  # [T] float, with gradient: critic values; when cfg.value_function
    returns_T: torch.Tensor | None = None  # [T] float: GAE returns (the critic's target); when cfg.value_function
    group_index_T: torch.Tensor | None = None  # [T] int: any id of each token's prompt group; dpo only
    num_pairs: int | None = None  # DPO pairs in the whole optimizer step, all ranks; dpo only (0: no pair term)
    distill_baseline_T: torch.Tensor | None = None  # [T] float: rl.teacher, the token's group baseline (None: 0)
    teacher_top_logprobs_TK: torch.Tensor | None = None  # [T, k] float: rl.teacher_top_k, the teacher's top-k
    student_top_logprobs_TK: torch.Tensor | None = None  # [T, k] float, with gradient: the student's of those tokens


def compute_loss(inputs: LossInputs, cfg: RLConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss (scalar, to minimise) of one packed micro-batch and its statistics (see rl/stats.py)."""
    new_logprobs_T, behaviour_logprobs_T, mask_T = inputs.new_logprobs_T, inputs.behaviour_logprobs_T, inputs.mask_T
    lag_T, seq_index_T, num_sequences = inputs.lag_T, inputs.seq_index_T, inputs.num_sequences
    ref_logprobs_T, num_pairs = inputs.ref_logprobs_T, inputs.num_pairs
    assert new_logprobs_T.dim() == 1 and new_logprobs_T.shape == behaviour_logprobs_T.shape == mask_T.shape
    assert num_sequences > 0
    mask_T = mask_T.bool()
    keep_T = kept_tokens(mask_T, lag_T, cfg.max_token_lag)
    # A token without loss (masked out, or dropped for its lag) weighs 0, and 0 * inf is NaN: its behaviour and
    # reference log-probs become the current one (ratio 1, KL 0), so whatever the stream holds for it (a
    # behaviour log-prob of -100 overflows float32's exp) changes neither the loss nor its gradient.
    current_T = new_logprobs_T.detach()
    behaviour_T = torch.where(keep_T, behaviour_logprobs_T.detach().to(new_logprobs_T.dtype), current_T)
    advantages_T = inputs.advantages_T.detach().to(new_logprobs_T.dtype)
    stats = token_stats(new_logprobs_T, behaviour_T, lag_T, mask_T, keep_T)
    stats["sequences"] = stats["tokens"].new_tensor(float(torch.unique(seq_index_T[mask_T]).numel()))
    if cfg.needs_reference_logprobs:
        assert ref_logprobs_T is not None, "this RL config needs ref_logprobs_T (kl_coef > 0 or dpo reference)"
        ref_logprobs_T = torch.where(keep_T, ref_logprobs_T.detach().to(new_logprobs_T.dtype), current_T)
    if cfg.teacher is not None:  # the reference log-probs are the teacher's
        baseline_T = inputs.distill_baseline_T
        baseline_T = torch.zeros_like(advantages_T) if baseline_T is None else baseline_T.to(advantages_T.dtype)
        coef = 0.0 if cfg.teacher_top_k else cfg.teacher_coef  # top-k: the KL term below replaces the gap's
        advantages_T, reverse_kl_sum = distill_advantages(ref_logprobs_T, behaviour_T, baseline_T, advantages_T,
                                                          keep_T, coef, cfg.teacher_task_weight)
        stats["distill_reverse_kl_sum"] = reverse_kl_sum.detach().double()
    if cfg.algorithm == "dpo":
        assert num_pairs is not None, "algorithm=dpo needs num_pairs (the step's pairs, all ranks)"
        reference_T = ref_logprobs_T if cfg.dpo_reference == "reference" else behaviour_T
        main, counts = _dpo(new_logprobs_T, reference_T, advantages_T, keep_T, seq_index_T, inputs.group_index_T,
                            cfg.dpo_beta)
        assert int(counts["dpo_pairs"]) <= num_pairs, "num_pairs must count the whole step's pairs"
        loss = main / max(num_pairs, 1)  # no pair anywhere: main is an empty sum, 0
    else:
        main, counts = _policy_gradient(new_logprobs_T, behaviour_T, advantages_T, keep_T, cfg)
        loss = main / num_sequences
    stats.update(counts)
    stats[f"{cfg.algorithm}_loss"] = loss.detach().double()
    if cfg.teacher_top_k:
        teacher_TK, student_TK = inputs.teacher_top_logprobs_TK, inputs.student_top_logprobs_TK
        assert teacher_TK is not None and student_TK is not None, "rl.teacher_top_k needs both top-k log-probs"
        top_k_loss, top_k_stats = _kl_to_teacher_top_k(teacher_TK.detach().to(new_logprobs_T.dtype), student_TK,
                                                       keep_T, num_sequences, cfg.teacher_coef)
        stats.update(top_k_stats)
        loss = loss + top_k_loss
    if cfg.kl_coef > 0:
        kl_loss, kl_stats = _kl_to_reference(new_logprobs_T, ref_logprobs_T, keep_T, num_sequences, cfg.kl_coef)
        stats.update(kl_stats)
        loss = loss + kl_loss
    if cfg.value_function:
        values_T, returns_T = inputs.values_T, inputs.returns_T
        assert values_T is not None and returns_T is not None, "value_function needs values_T and returns_T"
        value_loss = cfg.value_coef * (((values_T - returns_T.detach()) ** 2) * keep_T).sum() / num_sequences
        stats["value_loss"] = value_loss.detach().double()
        loss = loss + value_loss
    return loss, stats

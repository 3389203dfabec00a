"""Statistics returned with every loss: ESS, KL(behaviour || current), entropy, lag, clip fractions.

A micro-batch's statistics are *sufficient statistics*: float64 sums (and, for keys starting with
``max_``, maxima). Summing them over micro-batches and ranks (an all-reduce SUM, MAX for ``max_*``)
gives exactly the optimizer step's statistics, however its sequences were packed; ``summarize_stats``
then turns them into the logged numbers. ``lag_hist`` has a fixed length so it all-reduces as is.

Keys: tokens, kept_tokens, sequences, ratio_sum, ratio_sq_sum, kl_k1_sum, kl_k3_sum, neg_logprob_sum,
lag_sum, max_lag, lag_hist; from `compute_loss` also grpo_loss or dpo_loss, and kl_loss, kl_ref_sum, value_loss,
ppo_clipped_tokens, tis_capped_tokens, dpo_pairs, dpo_correct_pairs, dpo_margin_sum, distill_reverse_kl_sum,
distill_top_k_loss, distill_top_k_kl_sum when those are on.
"""

from __future__ import annotations

import torch

# Counts per lag value 0..LAG_HIST_BINS-2; the last bin counts every lag >= LAG_HIST_BINS-1.
LAG_HIST_BINS = 128


def k3_kl(log_ratio_T: torch.Tensor, bound: float | None = None) -> torch.Tensor:
    """Per-token k3 estimate of KL(p || q) on samples of p (Schulman 2020): r - 1 - log r, r = q / p,
    from log_ratio_T = log q - log p; unbiased and >= 0. ``bound``: log r is clamped to [-bound, bound]
    first (null: not clamped), so the value stays <= exp(bound) and its gradient is zero outside."""
    if bound is not None:
        log_ratio_T = log_ratio_T.clamp(-bound, bound)
    return log_ratio_T.exp() - 1 - log_ratio_T


def token_stats(new_logprobs_T: torch.Tensor, behaviour_logprobs_T: torch.Tensor, lag_T: torch.Tensor,
                mask_T: torch.Tensor, keep_T: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over one micro-batch. mask_T: the model's completion tokens (an episode's environment tokens have
    no version, hence no lag, and are left out of every sum); keep_T: those that get loss (lag filter).

    Lag statistics cover every model token (so the histogram shows what the lag filter dropped);
    importance weights, KL and entropy cover the kept tokens (what the step trains on). Samples come
    from the behaviour policy mu, so with log r = log pi - log mu:
    KL(mu || pi) ~ k1 = -log r (unbiased, noisy) and k3 = r - 1 - log r (unbiased, >= 0, low variance);
    entropy of mu ~ -log mu (the sampled tokens' log-probs).

    These diagnostics are not clamped (unlike the loss's KL term): they are float64, where exp overflows
    only past 709, and a token the server sampled has log mu > -104 (its probability is a positive float32,
    >= 1.4e-45), so log r < 104; ``ess`` and ``kl_k3`` should show the real weights.
    """
    new_T, behaviour_T = new_logprobs_T.detach().double(), behaviour_logprobs_T.detach().double()
    log_ratio_T = (new_T - behaviour_T)[keep_T]
    ratio_T = log_ratio_T.exp()
    lag_M = lag_T[mask_T].long()
    zero = torch.zeros((), dtype=torch.float64, device=new_T.device)
    hist = torch.bincount(lag_M.clamp(0, LAG_HIST_BINS - 1), minlength=LAG_HIST_BINS)
    return {
        "tokens": zero + mask_T.sum(),
        "kept_tokens": zero + keep_T.sum(),
        "ratio_sum": ratio_T.sum(),
        "ratio_sq_sum": (ratio_T ** 2).sum(),
        "kl_k1_sum": (-log_ratio_T).sum(),
        "kl_k3_sum": k3_kl(log_ratio_T).sum(),
        "neg_logprob_sum": -behaviour_T[keep_T].sum(),
        "lag_sum": zero + lag_M.sum(),
        "max_lag": zero + (lag_M.max() if lag_M.numel() else 0),
        "lag_hist": hist.double(),
    }


def merge_stats(stats_list: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Combine micro-batch statistics: sum, or max for ``max_*`` keys (what an all-reduce does)."""
    merged = {}
    for key in stats_list[0]:
        stacked = torch.stack([stats[key] for stats in stats_list])
        merged[key] = stacked.amax(0) if key.startswith("max_") else stacked.sum(0)
    return merged


def _ratio(num: torch.Tensor, den: torch.Tensor) -> float:
    return float(num / den) if float(den) > 0 else float("nan")


def summarize_stats(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """The logged scalars of a step (or micro-batch). NaN where no token qualified.

    ess: (sum w)^2 / (n sum w^2) in (0, 1], 1 when all importance weights are equal (on-policy).
    Loss terms (keys ending in ``_loss``) and counts pass through; ``lag_hist`` is left to the caller.
    """
    kept = stats["kept_tokens"]
    out = {
        "ess": _ratio(stats["ratio_sum"] ** 2, kept * stats["ratio_sq_sum"]),
        "kl_k1": _ratio(stats["kl_k1_sum"], kept),
        "kl_k3": _ratio(stats["kl_k3_sum"], kept),
        "entropy": _ratio(stats["neg_logprob_sum"], kept),
        "lag_mean": _ratio(stats["lag_sum"], stats["tokens"]),
        "lag_max": float(stats["max_lag"]),
        "lag_drop_frac": _ratio(stats["tokens"] - kept, stats["tokens"]),
    }
    for key in ("ppo_clipped_tokens", "tis_capped_tokens"):
        if key in stats:
            out[key.replace("_tokens", "_frac")] = _ratio(stats[key], kept)
    if "distill_reverse_kl_sum" in stats:  # rl.teacher: log student - log teacher per kept token
        out["distill_reverse_kl"] = _ratio(stats["distill_reverse_kl_sum"], kept)
    if "distill_top_k_kl_sum" in stats:  # rl.teacher_top_k: KL(teacher top-k || student) per kept token
        out["distill_top_k_kl"] = _ratio(stats["distill_top_k_kl_sum"], kept)
    if "kl_ref_sum" in stats:  # k3 estimate of KL(current || reference) per kept token, clamped as in the loss
        out["kl_ref"] = _ratio(stats["kl_ref_sum"], kept)
    if "dpo_pairs" in stats:
        out["dpo_accuracy"] = _ratio(stats["dpo_correct_pairs"], stats["dpo_pairs"])
        out["dpo_margin"] = _ratio(stats["dpo_margin_sum"], stats["dpo_pairs"])
    for key, value in stats.items():
        if key.endswith("_loss") or key in ("tokens", "kept_tokens", "sequences", "dpo_pairs"):
            out[key] = float(value)
    return out

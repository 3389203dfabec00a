"""ESS, KL, entropy and lag statistics against exact values."""

import math

import pytest
import torch

from pipelinerl.rl.stats import LAG_HIST_BINS, k3_kl, merge_stats, summarize_stats, token_stats


def stats_of(new, behaviour, lag=None, mask=None):
    new, behaviour = torch.as_tensor(new, dtype=torch.float64), torch.as_tensor(behaviour, dtype=torch.float64)
    mask = torch.ones(len(new), dtype=torch.bool) if mask is None else torch.as_tensor(mask)
    lag = torch.zeros(len(new), dtype=torch.long) if lag is None else torch.as_tensor(lag)
    return token_stats(new, behaviour, lag, mask, mask)


def test_ess_is_one_for_equal_weights_and_hand_computed_otherwise():
    assert summarize_stats(stats_of([-1.0, -2.0, -0.5], [-1.3, -2.3, -0.8]))["ess"] == pytest.approx(1.0)
    # Weights 1 and 3: (1 + 3)^2 / (2 * (1 + 9)) = 0.8.
    summary = summarize_stats(stats_of([0.0, math.log(3.0)], [0.0, 0.0]))
    assert summary["ess"] == pytest.approx(0.8)


def test_kl_and_entropy_estimates_equal_exact_values_on_a_categorical():
    mu = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)
    pi = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    # Samples from mu in exact proportions (8 tokens): the estimators' means are then their expectations.
    tokens = [0, 0, 0, 0, 1, 1, 2, 3]
    summary = summarize_stats(stats_of(pi.log()[tokens], mu.log()[tokens]))
    exact_kl = float((mu * (mu / pi).log()).sum())
    assert summary["kl_k1"] == pytest.approx(exact_kl, rel=1e-12)
    assert summary["kl_k3"] == pytest.approx(exact_kl, rel=1e-12)
    assert summary["entropy"] == pytest.approx(float(-(mu * mu.log()).sum()), rel=1e-12)


def test_lag_histogram_mean_max_and_merge():
    lag = [0, 0, 1, 3, 3, 3, 200, 5]
    mask = [True, True, True, True, True, False, True, True]
    stats = stats_of([-1.0] * 8, [-1.0] * 8, lag, mask)
    hist = stats["lag_hist"]
    assert hist.shape == (LAG_HIST_BINS,) and hist.sum() == 7
    assert (hist[0], hist[1], hist[3], hist[5], hist[-1]) == (2, 1, 2, 1, 1)  # lag 200 lands in the last bin
    summary = summarize_stats(stats)
    assert summary["lag_max"] == 200 and summary["lag_mean"] == pytest.approx(212 / 7)
    parts = [stats_of([-1.0] * 4, [-1.0] * 4, lag[:4], mask[:4]), stats_of([-1.0] * 4, [-1.0] * 4, lag[4:], mask[4:])]
    merged = merge_stats(parts)
    for key in stats:
        torch.testing.assert_close(merged[key], stats[key])


def test_empty_micro_batch_gives_nan_not_an_error():
    summary = summarize_stats(stats_of([-1.0], [-1.0], mask=[False]))
    assert math.isnan(summary["ess"]) and summary["lag_max"] == 0 and summary["tokens"] == 0


def test_k3_is_hand_computed_and_the_bound_only_touches_log_ratios_beyond_it():
    x = torch.tensor([-50.0, -3.0, 0.0, 2.0, 50.0], dtype=torch.float64)
    expected = [math.exp(v) - 1 - v for v in x.tolist()]
    assert k3_kl(x).tolist() == pytest.approx(expected, rel=1e-15)
    bounded = [math.exp(v) - 1 - v for v in (-10.0, -3.0, 0.0, 2.0, 10.0)]
    assert k3_kl(x, bound=10.0).tolist() == pytest.approx(bounded, rel=1e-15)
    # token_stats' KL(behaviour || current) diagnostic is not clamped: a log-ratio of 50 is reported as is.
    summary = summarize_stats(stats_of([0.0], [-50.0]))
    assert summary["kl_k3"] == pytest.approx(math.exp(50.0) - 51.0, rel=1e-12)

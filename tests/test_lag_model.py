"""tools/lag_model.py against seed 001's stated properties and hand-computed cases."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location("lag_model", Path(__file__).parent.parent / "tools" / "lag_model.py")
lag_model = sys.modules["lag_model"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(lag_model)

# Balanced costs: t(H) / H = 1e-4 s per token = train_token_s, so a 50/50 split keeps both sides busy
# (seed 001: "50% of your GPUs for training and 50% for inference is a good starting point").
HW = lag_model.Hardware(decode_fixed_s=0.0128, decode_per_seq_s=5e-5, max_batch=256, train_token_s=1e-4)
S = 512


def test_doubling_accelerators_doubles_the_earliest_tokens_lag():
    for length in (16, 1000, 8192):
        small = lag_model.earliest_token_lag(HW, length, S, n_inference=4, n_train=4)
        large = lag_model.earliest_token_lag(HW, length, S, n_inference=8, n_train=8)
        assert small > 0
        assert large == pytest.approx(2 * small, rel=1e-12)


def test_earliest_tokens_lag_by_hand():
    """Inference-bound at full batch: 4 accelerators x 256 sequences of 1000 tokens in flight, and the
    trainer takes 512 of them per step: the first token of each waits for 1024 / 512 = 2 steps."""
    slow_training = lag_model.Hardware(0.0128, 5e-5, 256, train_token_s=1e-5)
    assert lag_model.earliest_token_lag(slow_training, 1000, S, 4, 4) == pytest.approx(4 * 256 / S)


def test_one_token_sequences_give_both_modes_the_same_throughput():
    n, ones = 8, np.ones(64, dtype=np.int64)
    conv = lag_model.conventional(HW, ones, S, n, steps_per_batch=16)  # B = 8192: full batch everywhere
    pipe = lag_model.pipeline(HW, ones, S, n_inference=n // 2, n_train=n // 2)
    assert conv["samples_per_s"] == pytest.approx(pipe["samples_per_s"], rel=1e-9)
    assert conv["occupancy"] == pytest.approx(1.0) and pipe["occupancy"] == pytest.approx(1.0)
    assert lag_model.best_split(HW, ones, S, n)[0] == n // 2


def test_the_gain_comes_from_the_spread_of_lengths():
    """Equal lengths fill conventional RL's batch to the end (ratio 1 at the balanced split); lengths
    spread over 1..max leave its accelerators waiting for the longest sequence."""
    n = 8
    for max_len in (16, 1024, 8192):
        equal, spread = np.full(64, max_len), lag_model.uniform_lengths(max_len)
        ratios = [lag_model.best_split(HW, lengths, S, n)[1]["samples_per_s"]
                  / lag_model.conventional(HW, lengths, S, n, steps_per_batch=4)["samples_per_s"]
                  for lengths in (equal, spread)]
        assert ratios[0] == pytest.approx(1.0) and ratios[1] > 1.2


def test_lag_grows_with_length_within_a_run():
    """Little's law: n_inference * max_batch sequences are in flight and S leave per step; a token's lag
    is the steps its sequence still runs, so the longest sequence's first token lags most."""
    lengths = lag_model.uniform_lengths(8192)
    pipe = lag_model.pipeline(HW, lengths, S, n_inference=4, n_train=4)
    in_flight_steps = 4 * 256 / S
    assert pipe["lag_max"] == pytest.approx(in_flight_steps * lengths.max() / lengths.mean())
    assert pipe["lag_mean"] < pipe["lag_max"]


def test_larger_g_trades_throughput_for_lag():
    lengths = lag_model.uniform_lengths(2048)
    runs = [lag_model.conventional(HW, lengths, S, 8, G) for G in (1, 4, 16)]
    assert [r["samples_per_s"] for r in runs] == sorted(r["samples_per_s"] for r in runs)
    assert [(r["lag_mean"], r["lag_max"]) for r in runs] == [(0.0, 0.0), (1.5, 3.0), (7.5, 15.0)]


def test_continuous_batching_by_hand():
    """2 slots, lengths 3, 1, 2: steps 1 at batch 2, then the freed slot takes the 2-token sequence:
    2 more steps at batch 2 (both end at step 3). Costs t(2) = 1 + 0.5 * 2 = 2 s per step."""
    hw = lag_model.Hardware(decode_fixed_s=1.0, decode_per_seq_s=0.5, max_batch=2, train_token_s=0.0)
    seconds, busy = lag_model._continuous_batching(hw, np.array([3, 1, 2]))
    assert seconds == pytest.approx(3 * 2.0) and busy == pytest.approx(3 * 2.0 * 2)

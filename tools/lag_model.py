"""Analytic lag and throughput of PipelineRL and conventional RL (seed 001, appendix A3/A4).

The appendix itself is not in the seeds; this model is derived from what seed 001 states about it:
- Figure 3 assumes that doubling the accelerators doubles inference and training throughput; then, for a
  sequence of length L, the lag of its earliest token doubles.
- For 1-token sequences PipelineRL gains nothing over conventional RL with a large enough G: inference
  runs at full batch in both.
- The gain grows with the maximum length and the spread of lengths; so does PipelineRL's maximum lag.
- Conventional RL: a larger G raises hardware efficiency at the cost of more off-policy data.

Costs. A decode step of b sequences on one inference accelerator takes t(b) = decode_fixed_s +
decode_per_seq_s * b seconds (reading the weights once, plus per-sequence work), for b <= max_batch.
Training costs train_token_s seconds per token per accelerator; a weight sync costs sync_s.

PipelineRL: n_inference accelerators always generate (finished sequences are replaced at once, so the
batch stays full unless the lag throttle holds generation back); n_train accelerators train S samples
per step and sync after each. A token generated at position p of a length-L sequence waits (L - p)
decode steps for its sequence to end, so its lag is (L - p) * t(b) / T steps, T the step period.
Conventional RL: all accelerators generate a batch of G*S samples (continuous batching, up to
max_batch per accelerator, until the longest finishes), then all train G steps, then sync once; the
tokens of a batch have lags 0..G-1.

`python tools/lag_model.py --out lag_model.png` plots throughput and lag against the maximum length.
"""

from __future__ import annotations

import argparse
import heapq
from dataclasses import dataclass

import numpy as np


@dataclass
class Hardware:
    decode_fixed_s: float  # seconds per decode step whatever the batch (weights read once per step)
    decode_per_seq_s: float  # extra seconds per decode step for each sequence in the batch
    max_batch: int  # sequences one inference accelerator runs at once (vLLM max_num_seqs)
    train_token_s: float  # seconds per trained token on one training accelerator
    sync_s: float = 0.0  # seconds per weight sync (trainer side; inference pauses as long)

    def step_s(self, batch: float) -> float:
        return self.decode_fixed_s + self.decode_per_seq_s * batch


def pipeline(hw: Hardware, lengths: np.ndarray, samples_per_step: int, n_inference: int, n_train: int,
             max_lag: int | None = None) -> dict:
    """Steady state of PipelineRL for completions drawn from `lengths` (tokens). When generation is
    faster than training, finished samples queue in the stream until the throttle (actor.max_lag)
    stops the actor: each sample then waits about max_lag steps, and the lag is the throttle's bound
    (unbounded without one)."""
    mean_len = float(np.mean(lengths))
    gen_rate = n_inference * hw.max_batch / (hw.step_s(hw.max_batch) * mean_len)  # samples/s at full batch
    train_rate = samples_per_step / (samples_per_step * mean_len * hw.train_token_s / n_train + hw.sync_s)
    rate = min(gen_rate, train_rate)
    # Generation faster than training: the lag throttle lets in only as many sequences as keep pace,
    # n_inference * b / (t(b) * mean_len) = rate, solved for the batch b.
    batch = hw.max_batch if gen_rate <= train_rate else (
        rate * mean_len * hw.decode_fixed_s / (n_inference - rate * mean_len * hw.decode_per_seq_s))
    lags = _pipeline_lags(lengths, hw.step_s(batch), samples_per_step / rate)
    if gen_rate > train_rate:  # queue-bound: a sample starts max_lag steps ahead of the step training it
        bound = float("inf") if max_lag is None else float(max_lag)
        lags.update(lag_mean=max(bound - 0.5, lags["lag_mean"]), lag_max=max(bound, lags["lag_max"]))
    return {"samples_per_s": rate, "tokens_per_s": rate * mean_len, "occupancy": batch / hw.max_batch, **lags}


def _pipeline_lags(lengths: np.ndarray, decode_step_s: float, step_period_s: float) -> dict:
    """Token-weighted mean lag and the earliest token's lag of the longest sequence, in steps."""
    per_step = decode_step_s / step_period_s  # lag added per decode step still to come
    lengths = np.asarray(lengths, dtype=np.float64)
    # A length-L sequence's tokens have lags (L - p) * per_step, p = 0..L-1: mean (L + 1) / 2 * per_step.
    mean = float(np.sum(lengths * (lengths + 1) / 2) / np.sum(lengths)) * per_step
    return {"lag_mean": mean, "lag_max": float(lengths.max()) * per_step, "lag_per_decode_step": per_step}


def earliest_token_lag(hw: Hardware, length: int, samples_per_step: int, n_inference: int, n_train: int) -> float:
    """Lag of the first token of a `length`-token sequence when every completion has that length."""
    result = pipeline(hw, np.array([length]), samples_per_step, n_inference, n_train)
    return length * result["lag_per_decode_step"]


def conventional(hw: Hardware, lengths: np.ndarray, samples_per_step: int, n_accelerators: int,
                 steps_per_batch: int) -> dict:
    """One cycle of conventional RL: generate G*S samples on every accelerator, train G steps, sync."""
    G = steps_per_batch
    batch = np.resize(np.asarray(lengths), G * samples_per_step)  # the length mix, repeated to B samples
    shares = [batch[i::n_accelerators] for i in range(n_accelerators)]  # dealt out round-robin
    runs = [_continuous_batching(hw, share) for share in shares]
    gen_s = max(seconds for seconds, _ in runs)
    # Accelerators that finished early sit idle until the batch's last sequence ends.
    occupancy = sum(busy for _, busy in runs) / (n_accelerators * gen_s * hw.max_batch)
    train_s = len(batch) * float(np.mean(batch)) * hw.train_token_s / n_accelerators
    cycle_s = gen_s + train_s + hw.sync_s
    # Step j of a batch trains its samples at lag j; steps hold equal sample counts.
    return {"samples_per_s": len(batch) / cycle_s, "tokens_per_s": float(np.sum(batch)) / cycle_s,
            "occupancy": occupancy, "lag_mean": (G - 1) / 2, "lag_max": float(G - 1),
            "generation_fraction": gen_s / cycle_s}


def _continuous_batching(hw: Hardware, lengths: np.ndarray) -> tuple[float, float]:
    """(seconds, sequence-seconds) to generate `lengths` on one accelerator with max_batch slots: a
    finished sequence's slot goes to the next waiting one. Event-driven: between two finishes the
    batch is constant, so the cost is (decode steps) * t(batch)."""
    queue = list(np.asarray(lengths, dtype=np.int64)[::-1])
    running: list[int] = []  # heap of the decode-step count at which each running sequence ends
    now_steps, seconds, busy = 0, 0.0, 0.0
    while queue or running:
        while queue and len(running) < hw.max_batch:
            heapq.heappush(running, now_steps + int(queue.pop()))
        next_end = running[0]
        steps, batch = next_end - now_steps, len(running)
        seconds += steps * hw.step_s(batch)
        busy += steps * hw.step_s(batch) * batch
        now_steps = next_end
        while running and running[0] == now_steps:
            heapq.heappop(running)
    return seconds, busy


def best_split(hw: Hardware, lengths: np.ndarray, samples_per_step: int, n_accelerators: int) -> tuple[int, dict]:
    """The number of inference accelerators (of n) that maximises PipelineRL's throughput."""
    options = [(n_inf, pipeline(hw, lengths, samples_per_step, n_inf, n_accelerators - n_inf))
               for n_inf in range(1, n_accelerators)]
    return max(options, key=lambda o: o[1]["samples_per_s"])


def uniform_lengths(max_len: int, count: int = 512) -> np.ndarray:
    """`count` completion lengths spread evenly over 1..max_len (the spread that math RL shows)."""
    return np.maximum(1, np.round(np.linspace(1, max_len, count))).astype(np.int64)


def _sweep(hw: Hardware, S: int, n: int, max_lens: list[int], Gs: list[int]) -> dict:
    rows = {"pipeline": []} | {f"conventional G={G}": [] for G in Gs}
    for max_len in max_lens:
        lengths = uniform_lengths(max_len)
        rows["pipeline"].append(best_split(hw, lengths, S, n)[1])
        for G in Gs:
            rows[f"conventional G={G}"].append(conventional(hw, lengths, S, n, G))
    return rows


def plot(out: str, hw: Hardware, S: int, n: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    max_lens, Gs = [1, 16, 64, 256, 1024, 4096, 8192], [1, 4, 16]
    rows = _sweep(hw, S, n, max_lens, Gs)
    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(11, 4))
    for name, results in rows.items():
        ax_t.plot(max_lens, [r["tokens_per_s"] for r in results], marker="o", label=name)
        ax_l.plot(max_lens, [r["lag_max"] for r in results], marker="o", label=name)
    for ax, label in ((ax_t, "generated tokens / s"), (ax_l, "max lag (optimizer steps)")):
        ax.set_xscale("log")
        ax.set_xlabel("max completion length (lengths uniform in 1..max)")
        ax.set_ylabel(label)
        ax.legend()
    ax_t.set_yscale("log")
    fig.suptitle(f"{n} accelerators, {S} samples/step (PipelineRL at its best inference/training split)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


# Illustrative GPU costs: a 7B decode step reads ~15 GB of weights (~8 ms on an H100) plus ~0.1 ms per
# sequence; training ~3x the forward FLOPs at ~40% utilisation (~0.3 ms per token per GPU).
GPU_7B = Hardware(decode_fixed_s=8e-3, decode_per_seq_s=1e-4, max_batch=256, train_token_s=3e-4, sync_s=2.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="lag_model.png", help="PNG to write")
    parser.add_argument("--accelerators", type=int, default=16)
    parser.add_argument("--samples-per-step", type=int, default=4096)
    args = parser.parse_args()
    rows = _sweep(GPU_7B, args.samples_per_step, args.accelerators, [1, 1024, 8192], [1, 4, 16])
    for name, results in rows.items():
        print(f"{name:>18}: " + "  ".join(f"L<={L}: {r['tokens_per_s']:9.0f} tok/s lag_max {r['lag_max']:6.1f}"
                                          for L, r in zip([1, 1024, 8192], results)))
    plot(args.out, GPU_7B, args.samples_per_step, args.accelerators)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

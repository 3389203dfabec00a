"""Peak memory and time of one micro-batch's forward + backward, unchunked vs chunked log-probs (CPU).

A random-init Qwen2-shaped model with a real-size vocabulary (152k, as Qwen2.5) and a narrow trunk, so the
LM head's [tokens, vocab] logits dominate as they do at 7B. Each variant runs in a fresh subprocess and
reports its peak resident memory (getrusage maxrss) above what it held before the forward pass.

    .venv/bin/python tools/bench_logprobs.py [--tokens 4096] [--chunk 1024] [--vocab 151936] [--summary PATH]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from bench_summary import Summary


def maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def run_variant(args) -> dict:
    """One variant in this process: build, then forward + backward `args.repeats` times."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from pipelinerl.trainer.model import completion_forward, enable_chunked_logprobs
    from pipelinerl.trainer.packing import Sample, pack

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=args.seq_len, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    enable_chunked_logprobs(model)  # the unchunked variant still calls it as a plain Linear
    prompt = args.seq_len // 8  # mostly completion tokens, as in RL micro-batches
    samples = [Sample(torch.randint(args.vocab, (prompt,)).tolist(),
                      torch.randint(args.vocab, (args.seq_len - prompt,)).tolist(), index=i)
               for i in range(args.tokens // args.seq_len)]
    (mb,) = pack(samples, args.tokens)
    chunk = args.chunk if args.variant == "chunked" else None
    before = maxrss_mib()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        logprobs_N, _ = completion_forward(model, mb, torch.device("cpu"), temperature=0.7, chunk_tokens=chunk)
        logprobs_N.sum().backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return {"variant": args.variant, "chunk": chunk, "completion_tokens": len(mb.target_pos_N),
            "peak_mib": maxrss_mib() - before, "time_s": min(times),
            "logprob_sum": float(logprobs_N.sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in the micro-batch")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per packed sequence")
    parser.add_argument("--chunk", type=int, default=1024, help="trainer.logprob_chunk_tokens of the chunked run")
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary (Qwen2.5's)")
    parser.add_argument("--hidden", type=int, default=64, help="model width")
    parser.add_argument("--repeats", type=int, default=2, help="forward + backward passes; the fastest counts")
    parser.add_argument("--variant", choices=("unchunked", "chunked"), help=argparse.SUPPRESS)  # a child run
    parser.add_argument("--summary", default=None, help="also write the key rows there (tools/bench_summary.py)")
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    summary = Summary("logprobs")
    rows = []
    for variant in ("unchunked", "chunked"):
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--variant", variant], check=True,
                             capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"{args.tokens} tokens/micro-batch ({rows[0]['completion_tokens']} scored), vocab {args.vocab}, "
          f"hidden {args.hidden}, float32, CPU")
    print(f"{'variant':<10} {'chunk':>6} {'peak MiB':>10} {'fwd+bwd s':>10}")
    for r in rows:
        print(f"{r['variant']:<10} {r['chunk'] or '-':>6} {r['peak_mib']:>10.0f} {r['time_s']:>10.2f}")
    (u, c) = rows
    print(f"chunked/unchunked: peak memory x{c['peak_mib'] / u['peak_mib']:.3f}, "
          f"time x{c['time_s'] / u['time_s']:.2f}; log-prob sums {u['logprob_sum']:.6g} vs {c['logprob_sum']:.6g}")
    summary.add("peak memory, chunked / whole", c["peak_mib"] / u["peak_mib"], "ratio")
    summary.add("fwd+bwd time, chunked / whole", c["time_s"] / u["time_s"], "ratio")
    summary.add("peak memory, whole", u["peak_mib"], "MiB")
    summary.add("peak memory, chunked", c["peak_mib"], "MiB")
    summary.write(args.summary)


if __name__ == "__main__":
    main()

"""Rollout stream throughput against the disk's raw sequential throughput and against JSON lines, in one run.

Writes realistic rollouts (prompt + thousands of completion tokens per sample, groups of G) through
StreamWriter, reads them back through StreamReader; writes and reads the same samples as JSON lines (the
original PipelineRL's file stream: one JSON object per sample and line, parsed back line by line; here
with the standard library's json, fsynced at the end); then writes and reads as many bytes as the
stream's segments as one plain sequential file (fsynced too). Prints MB/s of each (of the Arrow
segments' bytes, so the three are comparable), the ratios (target: stream >= 50 % of raw, and ahead of
JSON lines) and the machine's load average. By default the reads come from the page cache (the data was
just written): the ratio then measures the stream's CPU overhead (validation, encoding, CRC-32, decoding)
against a memcpy-speed read. `--cold` evicts the files first, so the reads come from the disk, as for a
trainer on another node.

    python tools/bench_streams.py [--samples 2048] [--input numpy|lists] [--cold] [--dir /path/on/disk]
                                  [--summary PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_summary import Summary

from pipelinerl.config import StreamsConfig
from pipelinerl.streams import StreamReader, StreamWriter
from pipelinerl.streams.schema import group_batch

CHUNK = 8 * 2**20


def make_groups(args: argparse.Namespace) -> list[list[dict]]:
    """Rows as an actor holds them: numpy arrays (from the engine) or Python lists (from JSON)."""
    rng = np.random.default_rng(0)
    lengths = random.Random(0)
    groups = []
    for g in range(args.samples // args.group):
        prompt = rng.integers(0, 150_000, args.prompt_tokens, dtype=np.int32)
        rows = []
        for i in range(args.group):
            n = lengths.randint(args.completion_tokens // 4, args.completion_tokens * 7 // 4)
            row = {"run_id": "bench", "group_id": f"g{g}", "sample_id": f"g{g}/s{i}", "prompt_token_ids": prompt,
                       "completion_token_ids": rng.integers(0, 150_000, n, dtype=np.int32),
                       "behaviour_logprobs": -rng.random(n, dtype=np.float32),
                       "versions": np.repeat(np.int32(g // 8), n), "reward": float(i % 2), "finished": True,
                       "truncated": False, "task": "math", "metadata": '{"answer": "42"}', "actor_id": "actor0"}
            if args.input == "lists":
                row = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in row.items()}
            rows.append(row)
        groups.append(rows)
    return groups


def evict(path: Path) -> None:
    """Drop a file's (clean, fsynced) pages from the page cache, so that the read that follows comes
    from the disk, as it does for a trainer on another node."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bench_stream(root: Path, groups: list[list[dict]], cfg: StreamsConfig, cold: bool) -> tuple[float, float, int]:
    start = time.perf_counter()
    with StreamWriter(root, "rollouts", "actor0", cfg) as writer:
        for rows in groups:
            writer.write_group(rows)
    t_write = time.perf_counter() - start
    segments = list((root / "streams").rglob("*.arrow"))
    for path in segments if cold else ():
        evict(path)
    written = time.perf_counter()
    reader = StreamReader(root, "rollouts", cfg)
    got, tokens = 0, 0
    while got < len(groups):
        batches = reader.read_groups(len(groups) - got, timeout_s=10.0)
        got += len(batches)
        tokens += sum(len(b.column("completion_token_ids").flatten()) for b in batches)
    t_read = time.perf_counter() - written
    assert tokens == sum(len(r["completion_token_ids"]) for rows in groups for r in rows)
    return t_write, t_read, sum(p.stat().st_size for p in segments)


def bench_raw(path: Path, size: int, cold: bool) -> tuple[float, float]:
    """The same bytes as one sequential file: write in 8 MiB chunks + fsync, then read it all back."""
    block = os.urandom(CHUNK)
    start = time.perf_counter()
    with open(path, "wb") as f:
        left = size
        while left > 0:
            left -= f.write(block[:min(CHUNK, left)])
        f.flush()
        os.fsync(f.fileno())
    t_write = time.perf_counter() - start
    if cold:
        evict(path)
    written = time.perf_counter()
    buf = bytearray(CHUNK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return t_write, time.perf_counter() - written


def bench_jsonl(path: Path, groups: list[list[dict]], cold: bool) -> tuple[float, float]:
    """The original PipelineRL's format: one JSON object per sample and line (numpy as lists), flushed per
    group, fsynced at the end; read back line by line into dicts of lists."""
    start = time.perf_counter()
    with open(path, "w") as f:
        for rows in groups:
            for row in rows:
                f.write(json.dumps({k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in row.items()}))
                f.write("\n")
            f.flush()
        os.fsync(f.fileno())
    t_write = time.perf_counter() - start
    if cold:
        evict(path)
    written = time.perf_counter()
    with open(path) as f:
        tokens = sum(len(json.loads(line)["completion_token_ids"]) for line in f)
    t_read = time.perf_counter() - written
    assert tokens == sum(len(r["completion_token_ids"]) for rows in groups for r in rows)
    return t_write, t_read


def report(name: str, size: int, t_write: float, t_read: float) -> float:
    mb = size / 1e6
    both = mb / (t_write + t_read)
    print(f"{name:<8} write {mb / t_write:8.0f} MB/s   read {mb / t_read:8.0f} MB/s   write+read {both:8.0f} MB/s")
    return both


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--group", type=int, default=8, help="G, samples per group")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--completion-tokens", type=int, default=4000, help="mean completion length")
    parser.add_argument("--input", choices=("numpy", "lists"), default="numpy")
    parser.add_argument("--segment-rows", type=int, default=StreamsConfig.segment_max_rows,
                        help="streams.segment_max_rows (larger segments: fewer fsyncs)")
    parser.add_argument("--repeats", type=int, default=3, help="best of N runs of stream and raw (JSON lines: 1)")
    parser.add_argument("--cold", action="store_true",
                        help="evict the written files from the page cache before reading them back")
    parser.add_argument("--dir", default=None, help="folder on the disk to measure (default: a temp folder)")
    parser.add_argument("--summary", default=None, help="also write the key rows there (tools/bench_summary.py)")
    args = parser.parse_args()
    summary = Summary("streams")
    cfg = StreamsConfig(segment_max_rows=args.segment_rows)
    groups = make_groups(args)
    base = Path(tempfile.mkdtemp(prefix="bench_streams_", dir=args.dir))
    try:
        stream, raw, jsonl = [], [], []
        for rep in range(args.repeats):
            stream.append(bench_stream(base / f"run{rep}", groups, cfg, args.cold))
            size = stream[-1][2]
            raw.append(bench_raw(base / f"raw{rep}.bin", size, args.cold))
            if rep == 0:  # once: 20-30x slower than the others, so its noise does not matter
                jsonl.append(bench_jsonl(base / "run.jsonl", groups, args.cold))
            shutil.rmtree(base / f"run{rep}")
            (base / f"raw{rep}.bin").unlink()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    tokens = sum(len(r["completion_token_ids"]) + len(r["prompt_token_ids"]) for rows in groups for r in rows)
    print(f"{args.samples} samples, {tokens:,} tokens, {size / 1e6:.0f} MB of segments, input as {args.input}, "
          f"segment_max_rows={cfg.segment_max_rows}, fsync={cfg.fsync}, best of {args.repeats}, "
          f"{'cold' if args.cold else 'page-cached'} reads, disk: {base.parent}")
    print("load average (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
          + f" on {os.cpu_count()} CPUs")
    best = min(stream, key=lambda t: t[0] + t[1])
    s = report("stream", size, *best[:2])
    j = report("jsonl", size, *jsonl[0])
    r = report("raw", size, *min(raw, key=lambda t: t[0] + t[1]))
    print(f"ratio    stream / raw write+read = {100 * s / r:.0f} %  (target >= 50 %)")
    print(f"ratio    jsonl / raw write+read = {100 * j / r:.0f} %;  stream / jsonl = {s / j:.1f}x  (target > 1)")
    summary.add("stream / raw write+read", s / r, "ratio", ">= 0.5")
    summary.add("stream / jsonl write+read", s / j, "ratio", ">= 1")
    for name, rate in (("stream", s), ("jsonl", j), ("raw", r)):
        summary.add(f"{name} write+read", rate, "MB/s")
    start = time.perf_counter()
    for rows in groups:
        group_batch(rows)
    convert = time.perf_counter() - start
    print(f"of the stream's {best[0]:.2f} s of writing, {convert:.2f} s is validating rows and converting them to "
          "Arrow (in the actor); segments are encoded, checksummed and fsynced in the background meanwhile")
    summary.write(args.summary)


if __name__ == "__main__":
    main()

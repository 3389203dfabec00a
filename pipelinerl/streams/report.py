"""`pipelinerl streams inspect RUN_DIR`: what the streams of a run hold, read-only.

Lag is reported two ways, both from the per-token `versions` of the model's tokens (`loss_mask` 1; an
episode's environment tokens have no version):
  * in-flight spread of a sample = max(versions) - min(versions): how many weight updates landed while
    it was being generated (0 = the whole completion came from one policy);
  * token staleness = max(versions of its sample) - version of the token: how many updates behind its
    sample's newest token each token is.
Lag against the trainer (trainer version when trained on - token version) is the trainer's to measure:
the stream does not know when a sample is consumed. Samples without model tokens count in neither
histogram. `completion_tokens` counts every token after the prompt, `model_tokens` those the model sampled.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pipelinerl.streams.segments import (
    CORRUPT_SUFFIX,
    CorruptSegment,
    list_segments,
    list_writers,
    load_segment,
    temp_files,
)


def _empty_stats() -> dict[str, Any]:
    return {"segments": 0, "unreadable_segments": 0, "quarantined_segments": 0, "unpublished_temp_files": 0,
            "groups": 0, "samples": 0, "prompt_tokens": 0, "completion_tokens": 0, "model_tokens": 0,
            "reward_sum": 0.0, "finished": 0, "truncated": 0, "version_min": None, "version_max": None,
            "spread_histogram": Counter(), "token_staleness_histogram": Counter()}


def _add_versions(stats: dict[str, Any], versions: pa.ListArray, loss_mask: pa.ListArray) -> None:
    for i in range(len(versions)):
        values = versions[i].values.filter(loss_mask[i].values.cast(pa.bool_()))  # the model's tokens
        if len(values) == 0:
            continue
        lo, hi = pc.min_max(values).values()
        lo, hi = lo.as_py(), hi.as_py()
        stats["spread_histogram"][hi - lo] += 1
        counts = pc.value_counts(pc.subtract(pa.scalar(hi, pa.int32()), values))
        for entry in counts.to_pylist():
            stats["token_staleness_histogram"][entry["values"]] += entry["counts"]
        stats["version_min"] = lo if stats["version_min"] is None else min(stats["version_min"], lo)
        stats["version_max"] = hi if stats["version_max"] is None else max(stats["version_max"], hi)


def _add_group(stats: dict[str, Any], batch: pa.RecordBatch, ids: Counter) -> None:
    stats["groups"] += 1
    stats["samples"] += batch.num_rows
    stats["prompt_tokens"] += len(batch.column("prompt_token_ids").flatten())
    stats["completion_tokens"] += len(batch.column("completion_token_ids").flatten())
    stats["model_tokens"] += pc.sum(batch.column("loss_mask").flatten().cast(pa.int64())).as_py() or 0
    stats["reward_sum"] += pc.sum(batch.column("reward")).as_py() or 0.0
    stats["finished"] += pc.sum(batch.column("finished").cast(pa.int64())).as_py() or 0
    stats["truncated"] += pc.sum(batch.column("truncated").cast(pa.int64())).as_py() or 0
    ids.update(batch.column("sample_id").to_pylist())
    _add_versions(stats, batch.column("versions"), batch.column("loss_mask"))


def _writer_stats(wdir: Path, ids: Counter) -> dict[str, Any]:
    stats = _empty_stats()
    stats["quarantined_segments"] = len(list(wdir.glob("*" + CORRUPT_SUFFIX)))
    stats["unpublished_temp_files"] = len(temp_files(wdir))
    for segment in list_segments(wdir):
        try:
            batches, _ = load_segment(segment)
        except (CorruptSegment, FileNotFoundError):  # read-only: readers quarantine, inspect only counts
            stats["unreadable_segments"] += 1
            continue
        stats["segments"] += 1
        for batch in batches:
            _add_group(stats, batch, ids)
    return stats


def _finish(stats: dict[str, Any]) -> dict[str, Any]:
    """Counters to sorted plain dicts (JSON-friendly), reward sum to a mean (None without samples)."""
    out = dict(stats)
    out["reward_mean"] = out.pop("reward_sum") / out["samples"] if out["samples"] else None
    for key in ("spread_histogram", "token_staleness_histogram"):
        out[key] = dict(sorted(out[key].items()))
    return out


def _merge(total: dict[str, Any], stats: dict[str, Any]) -> None:
    for key, value in stats.items():
        if isinstance(value, Counter):
            total[key].update(value)
        elif key in ("version_min", "version_max"):
            pick = min if key == "version_min" else max
            total[key] = value if total[key] is None else (total[key] if value is None else pick(total[key], value))
        else:
            total[key] += value


def inspect(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Per topic: per-writer and total counts, tokens, reward mean, lag histograms, duplicate ids."""
    root = Path(run_dir) / "streams"
    if not root.is_dir():
        raise FileNotFoundError(f"{root} does not exist: is {run_dir} a PipelineRL run directory?")
    report: dict[str, Any] = {"run_dir": str(run_dir), "topics": {}}
    for topic in list_writers(root):  # topics are folders too
        ids: Counter = Counter()
        total = _empty_stats()
        writers = {}
        for writer_id in list_writers(root / topic):
            stats = _writer_stats(root / topic / writer_id, ids)
            _merge(total, stats)
            writers[writer_id] = _finish(stats)
        report["topics"][topic] = {"writers": writers, "total": _finish(total),
                                   "duplicate_sample_ids": sum(n - 1 for n in ids.values() if n > 1)}
    return report


def _histogram_lines(title: str, hist: dict[int, int]) -> list[str]:
    total = sum(hist.values())
    lines = [f"  {title}:"]
    for value, count in hist.items():
        lines.append(f"    {value:>4}  {count:>10}  {100.0 * count / total:6.2f}%")
    return lines if hist else lines + ["    (none)"]


def format_inspect(report: dict[str, Any]) -> str:
    """The report as a table per topic, then its lag histograms."""
    lines = [f"streams of {report['run_dir']}"]
    head = f"  {'writer':<20} {'segs':>6} {'bad':>4} {'tmp':>4} {'groups':>8} {'samples':>9} " \
           f"{'prompt tok':>12} {'compl tok':>12} {'model tok':>12} {'reward':>8} {'versions':>11}"
    for topic, info in report["topics"].items():
        lines += ["", f"topic {topic!r}: {info['duplicate_sample_ids']} duplicate sample id(s)", head]
        for name, s in [*info["writers"].items(), ("TOTAL", info["total"])]:
            reward = "-" if s["reward_mean"] is None else f"{s['reward_mean']:.4f}"
            versions = "-" if s["version_min"] is None else f"{s['version_min']}..{s['version_max']}"
            bad = s["unreadable_segments"] + s["quarantined_segments"]
            lines.append(f"  {name:<20} {s['segments']:>6} {bad:>4} {s['unpublished_temp_files']:>4} "
                         f"{s['groups']:>8} {s['samples']:>9} {s['prompt_tokens']:>12} "
                         f"{s['completion_tokens']:>12} {s['model_tokens']:>12} {reward:>8} {versions:>11}")
        lines += _histogram_lines("in-flight spread per sample, max(versions) - min(versions)",
                                  info["total"]["spread_histogram"])
        lines += _histogram_lines("token staleness, max(sample versions) - token version",
                                  info["total"]["token_staleness_histogram"])
    return "\n".join(lines)

"""GPU and CPU id lists as configs write them ("0-3,6"): parsed here, below the config, so that validating a
config needs no launcher module (the launcher places roles with the same parsers)."""

from __future__ import annotations


def _parse_ids(spec: str, what: str) -> list[int]:
    """`"0-3,6"` -> [0, 1, 2, 3, 6]; ValueError on bad text or a repeated id."""
    ids: list[int] = []
    for part in str(spec).replace(" ", "").split(","):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"bad {what} list {spec!r}: use ids and ranges like '0-3' or '0,1,4-7'")
        ids += range(int(first), int(last if dash else first) + 1)
    if len(set(ids)) != len(ids):
        raise ValueError(f"{what} list {spec!r} names a {what} twice")
    return ids


def parse_gpu_ids(spec: str) -> list[str]:
    """`"0-3,6"` -> `["0", "1", "2", "3", "6"]` (as CUDA_VISIBLE_DEVICES takes them); ValueError on bad text."""
    return [str(i) for i in _parse_ids(spec, "GPU")]


def parse_cpu_ids(spec: str) -> list[int]:
    """`"0-3,6"` -> [0, 1, 2, 3, 6] (as os.sched_setaffinity takes them); ValueError on bad text."""
    return _parse_ids(spec, "CPU core")

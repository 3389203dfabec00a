"""The one result format of the benchmarks, read by tools/bench_all.py: each `tools/bench_*.py` takes
`--summary PATH` and writes there, besides its own printed table, the rows it measured with their goals.

    {"bench": "streams", "load_before": [1, 5, 15 min], "load_after": [...],
     "rows": [{"metric": "stream / raw write+read", "value": 0.61, "unit": "ratio", "goal": ">= 0.5", "met": true}]}

A goal is `>= x` or `<= x` (or null: reported, no goal); `met` is computed here, never by hand.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def met(value: float | None, goal: str | None) -> bool | None:
    """Whether value meets goal (`>= x` / `<= x`); None without a goal or a value."""
    if goal is None or value is None:
        return None
    op, bound = goal.split()
    if op == ">=":
        return value >= float(bound)
    if op == "<=":
        return value <= float(bound)
    raise ValueError(f"goal {goal!r}: expected '>= x' or '<= x'")


def row(metric: str, value: float | None, unit: str = "", goal: str | None = None) -> dict:
    """One measured row of a summary."""
    return {"metric": metric, "value": value, "unit": unit, "goal": goal, "met": met(value, goal)}


class Summary:
    """Rows of one benchmark run; the load average is read when it starts and when it is written."""

    def __init__(self, bench: str):
        self.bench, self.rows, self.load_before = bench, [], list(os.getloadavg())

    def add(self, metric: str, value: float | None, unit: str = "", goal: str | None = None) -> None:
        self.rows.append(row(metric, value, unit, goal))

    def write(self, path: str | Path | None) -> None:
        """Write the summary to path (nothing when path is None: the bench was run by hand)."""
        if path is None:
            return
        body = {"bench": self.bench, "load_before": self.load_before, "load_after": list(os.getloadavg()),
                "rows": self.rows}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(body, indent=1))

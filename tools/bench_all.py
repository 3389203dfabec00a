"""Every benchmark, one after the other, and one markdown table of their key rows (the documentation's
performance page, docs/performance.md): `make bench` or

    python tools/bench_all.py [--quick] [--only streams,grading] [--skip pipeline_vs_conventional]

Each `tools/bench_<name>.py` runs in its own process with `--summary runs/bench_all/<name>.json`
(tools/bench_summary.py); its output goes to `<name>.out` / `<name>.err` there. A bench that fails or runs
past its timeout is a FAILED row with the end of its stderr, and the others still run. The table (with the
machine, and each bench's 1-min load average at its start and end) is printed and written to
runs/bench_all/table.md, everything to summary.json. Exit status 1 when a bench failed; goals not met are
reported, not errors. `--quick` runs each bench at small sizes: a smoke test, not numbers to quote.
`--page docs/performance.md` (what `make bench` passes) also replaces the table between that page's bench
markers (TABLE_START / TABLE_END), with the machine and each bench's load: only after a full run (no --quick,
--only or --skip), so the page always shows one whole run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GRACE_S = 30  # after SIGINT, for a timed-out bench's finally blocks to stop its servers
STDERR_LINES = 15  # of a failed bench, in the table's notes
TABLE_START = "<!-- bench table: `make bench` replaces everything down to the end marker -->"
TABLE_END = "<!-- end of bench table -->"


@dataclass(frozen=True)
class Bench:
    """How bench_all runs one `bench_<name>.py`: its arguments (besides --summary) for a full and a --quick
    run, and the seconds each may take before it is stopped and reported as failed."""

    args: tuple[str, ...] = ()
    quick_args: tuple[str, ...] = ()
    timeout_s: float = 1800
    quick_timeout_s: float = 1200  # vLLM servers start in minutes on a loaded 2-CPU machine


# In the order they run: the long end-to-end comparison last. Full runs use each bench's defaults.
BENCHES = {
    "streams": Bench(quick_args=("--samples", "256", "--repeats", "1"), timeout_s=900, quick_timeout_s=300),
    "weight_update": Bench(quick_args=("--rounds", "2")),
    "broadcast": Bench(quick_args=("--steps", "2", "--models", "tiny")),
    "logprobs": Bench(quick_args=("--tokens", "1024", "--chunk", "256", "--vocab", "32000", "--repeats", "1"),
                      timeout_s=900, quick_timeout_s=300),
    "lm_head_precision": Bench(quick_args=("--vocab", "8192", "--hidden", "128", "--prompts", "4", "--n", "2",
                                           "--new-tokens", "16")),
    "grading": Bench(quick_args=("--completions", "60", "--workers", "1", "2"), timeout_s=900, quick_timeout_s=300),
    "placement": Bench(quick_args=("--steps", "8"), timeout_s=3600, quick_timeout_s=1800),
    "sandbox_pool": Bench(quick_args=("--calls", "40", "--pools", "1", "2", "--burst", "100"), timeout_s=900,
                          quick_timeout_s=300),
    "turn_cost": Bench(quick_args=("--turns", "100", "--repeats", "1"), timeout_s=600, quick_timeout_s=300),
    "actor_scale": Bench(quick_args=("--quick",), timeout_s=1800, quick_timeout_s=300),
    "moe_replay": Bench(quick_args=("--steps", "12"), timeout_s=3600, quick_timeout_s=1200),
    # needs the `verifiers` extra (installed by the test set-up)
    "env_adapters": Bench(quick_args=("--episodes", "64", "--concurrency", "16")),
    # needs the `trl` extra (pip install -e '.[trl]'); without it, a FAILED row saying how to install it
    "vs_trl": Bench(quick_args=("--quick",), timeout_s=7200, quick_timeout_s=1800),
    "pipeline_vs_conventional": Bench(quick_args=("--steps", "8"), timeout_s=7200, quick_timeout_s=1800),
}


def machine() -> dict:
    """What the numbers were measured on: CPUs (as `nproc` counts them), CPU model, UTC date, load average."""
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": len(os.sched_getaffinity(0)), "cpu": cpu,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "load_at_start": list(os.getloadavg())}


def wait(proc: subprocess.Popen, timeout_s: float) -> str | None:
    """Wait for a bench: None when it exits 0, else why it failed. Past its timeout its process group gets
    SIGINT (Python's KeyboardInterrupt runs the bench's finally blocks, which stop the servers it started in
    their own sessions), then, after at most GRACE_S, SIGKILL for whatever of the group is left."""
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):  # the whole group has exited
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return f"timed out after {timeout_s:.0f} s"
    return None if rc == 0 else f"exit code {rc}"


def _default_sigint() -> None:
    """In the bench's process before it execs: SIGINT back to its default, so that Python turns it into
    KeyboardInterrupt. A shell ignores SIGINT in the commands it starts in the background (`make bench &`),
    every descendant inherits that, and a timed-out bench would then never run its finally blocks."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def tail(path: Path, lines: int = STDERR_LINES) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run_bench(name: str, script: Path, args: list[str], out_dir: Path, timeout_s: float) -> dict:
    """Run one bench script to completion or timeout. Returns its summary (bench_summary's format) with
    `seconds` and `failed` (None, or why) added; a failed bench has no rows, its load average is read here,
    and `stderr_tail` holds the end of its stderr."""
    summary_path = (out_dir / f"{name}.json").resolve()  # the bench runs in REPO
    summary_path.unlink(missing_ok=True)
    load_before, start = list(os.getloadavg()), time.monotonic()
    with open(out_dir / f"{name}.out", "w") as out, open(out_dir / f"{name}.err", "w") as err:
        cmd = [sys.executable, str(script.resolve()), *args, "--summary", str(summary_path)]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err, start_new_session=True,
                                preexec_fn=_default_sigint)  # noqa: PLW1509 (a signal reset only)
        failed = wait(proc, timeout_s)
    if failed is None and not summary_path.exists():
        failed = "exited 0 without writing its summary"
    seconds = time.monotonic() - start
    if failed is not None:
        return {"bench": name, "load_before": load_before, "load_after": list(os.getloadavg()), "rows": [],
                "seconds": seconds, "failed": failed, "stderr_tail": tail(out_dir / f"{name}.err")}
    return {**json.loads(summary_path.read_text()), "seconds": seconds, "failed": None}


def run_all(benches: dict[str, Bench], bench_dir: Path, out_dir: Path, quick: bool,
            timeout_s: float | None = None) -> list[dict]:
    """Run the benches in order, printing one progress line each; a failure does not stop the others."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for i, (name, bench) in enumerate(benches.items(), 1):
        limit = timeout_s or (bench.quick_timeout_s if quick else bench.timeout_s)
        print(f"[{i}/{len(benches)}] {name} (timeout {limit:.0f} s) ...", flush=True)
        args = list(bench.quick_args if quick else bench.args)
        result = run_bench(name, bench_dir / f"bench_{name}.py", args, out_dir, limit)
        status = f"FAILED: {result['failed']}" if result["failed"] else "ok"
        print(f"      {status} in {result['seconds']:.0f} s (output: {out_dir / name}.out, .err)", flush=True)
        results.append(result)
    return results


def fmt(value: float | None) -> str:
    """A value for the table: 3 significant digits, whole numbers from 100, exponents below 0.01."""
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}" if abs(value) >= 0.01 or value == 0 else f"{value:.2e}"


def table_row(cells: list[str]) -> str:
    """One markdown table row; a `|` inside a cell is escaped."""
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def render(host: dict, results: list[dict], quick: bool) -> str:
    """The markdown table: the machine on top, a row per metric, a FAILED row per failed bench; then the
    failed benches' stderr."""
    lines = [f"Machine: {host['nproc']} CPUs ({host['cpu']}), {host['date']}"
             + (", --quick (smoke-test sizes, not numbers to quote)" if quick else ""), ""]
    if host["load_at_start"][0] > 0.5 * host["nproc"]:
        lines += [f"WARNING: 1-min load average {host['load_at_start'][0]:.2f} at start on {host['nproc']} CPUs "
                  "(above 0.5 x nproc): these numbers are not from a quiet machine.", ""]
    lines += [table_row(["bench", "metric", "value", "unit", "goal", "met", "load average (1 min, start / end)"]),
              "|---|---|---|---|---|---|---|"]
    for r in results:
        load = f"{r['load_before'][0]:.2f} / {r['load_after'][0]:.2f}"
        if r["failed"]:
            lines.append(table_row([r["bench"], f"FAILED: {r['failed']}", "", "", "", "", load]))
        for row in r["rows"]:
            met = {True: "yes", False: "**no**", None: ""}[row["met"]]
            lines.append(table_row([r["bench"], row["metric"], fmt(row["value"]), row["unit"], row["goal"] or "",
                                    met, load]))
    for r in results:
        if r["failed"]:
            lines += ["", f"{r['bench']} failed ({r['failed']}); the end of its stderr:", "```", r["stderr_tail"],
                      "```"]
    return "\n".join(lines) + "\n"


def update_page(path: Path, table: str) -> None:
    """Replace what lies between TABLE_START and TABLE_END in `path` with `table`; ValueError when the
    markers are missing or out of order (nothing is written then)."""
    text = path.read_text()
    start, end = text.find(TABLE_START), text.find(TABLE_END)
    if start < 0 or end < start:
        raise ValueError(f"{path} has no bench table markers ({TABLE_START!r} ... {TABLE_END!r})")
    head = text[:start + len(TABLE_START)]
    path.write_text(f"{head}\n{table}{text[end:]}")


def select(only: str | None, skip: str | None) -> dict[str, Bench]:
    """BENCHES restricted to `only` and without `skip` (comma-separated names), in BENCHES' order."""
    names = [n for part in (only, skip) if part for n in part.split(",")]
    unknown = sorted(set(names) - set(BENCHES))
    if unknown:
        raise ValueError(f"unknown bench(es) {', '.join(unknown)}; choose from {', '.join(BENCHES)}")
    keep = set(only.split(",")) if only else set(BENCHES)
    drop = set(skip.split(",")) if skip else set()
    return {name: bench for name, bench in BENCHES.items() if name in keep - drop}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated benches to run (default: all of " + ", ".join(BENCHES) + ")")
    parser.add_argument("--skip", help="comma-separated benches not to run")
    parser.add_argument("--quick", action="store_true", help="each bench at small sizes (a smoke test)")
    parser.add_argument("--timeout", type=float, help="seconds per bench, for all (default: each bench's own)")
    parser.add_argument("--out-dir", type=Path, default=REPO / "runs" / "bench_all",
                        help="the summaries, the benches' output, table.md and summary.json")
    parser.add_argument("--bench-dir", type=Path, default=REPO / "tools", help="folder of the bench_<name>.py")
    parser.add_argument("--page", type=Path, help="after a full run, write the table into this markdown page "
                                                  "between its bench markers (make bench: docs/performance.md)")
    args = parser.parse_args(argv)
    try:
        benches = select(args.only, args.skip)
    except ValueError as e:
        parser.error(str(e))
    host = machine()
    results = run_all(benches, args.bench_dir, args.out_dir, args.quick, args.timeout)
    table = render(host, results, args.quick)
    print("\n" + table, end="")
    (args.out_dir / "table.md").write_text(table)
    (args.out_dir / "summary.json").write_text(json.dumps({"machine": host, "quick": args.quick,
                                                           "benches": results}, indent=1))
    if args.page is not None:
        if args.quick or args.only or args.skip:
            print(f"bench_all: {args.page} not updated: only a full run (no --quick, --only, --skip) "
                  "writes its table")
        else:
            update_page(args.page, table)
            print(f"bench_all: the table is in {args.page}")
    return 1 if any(r["failed"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

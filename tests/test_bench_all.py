"""tools/bench_summary.py's goals and tools/bench_all.py's runner and table, with tiny fake benches (the real
ones take minutes each)."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))

import bench_all  # noqa: E402
from bench_summary import Summary, met, row  # noqa: E402

# A fake bench writes its summary through the real Summary, as the tools/bench_*.py do.
HEADER = f"""
import sys, time
sys.path.insert(0, {str(TOOLS)!r})
from bench_summary import Summary
summary_path = sys.argv[sys.argv.index("--summary") + 1]
"""
HANG_TIMEOUT_S = 2
FAKES = {
    "ok": """
        s = Summary("ok")
        s.add("ratio", 0.61, "ratio", ">= 0.5")
        s.add("rate", 1234.5, "MB/s")
        s.add("gap | abs", 0.004, "nats", "<= 0.001")
        s.write(summary_path)
    """,
    "fails": """
        print("line one", file=sys.stderr)
        print("ValueError: boom", file=sys.stderr)
        sys.exit(3)
    """,
    "hangs": """
        try:
            open(summary_path + ".started", "w").close()
            time.sleep(60)
        finally:  # SIGINT runs it, as it stops a real bench's servers
            open(summary_path + ".cleaned", "w").close()
    """,
    "silent": "pass",
}


def write_fakes(folder: Path) -> None:
    for name, body in FAKES.items():
        (folder / f"bench_{name}.py").write_text(HEADER + textwrap.dedent(body))


@pytest.mark.parametrize("value, goal, expected", [
    (0.61, ">= 0.5", True), (0.5, ">= 0.5", True), (0.49, ">= 0.5", False),
    (0.9, "<= 1", True), (1.0, "<= 1", True), (1.2, "<= 1", False),
    (0.3, None, None), (None, ">= 1", None),
])
def test_met(value, goal, expected):
    assert met(value, goal) is expected


def test_met_rejects_other_goals():
    with pytest.raises(ValueError, match="expected '>= x' or '<= x'"):
        met(1.0, "> 1")


def test_row_and_summary(tmp_path):
    assert row("r", 0.4, "ratio", ">= 0.5") == {"metric": "r", "value": 0.4, "unit": "ratio", "goal": ">= 0.5",
                                                "met": False}
    summary = Summary("x")
    summary.add("r", 2.0, "s", "<= 3")
    summary.write(None)  # run by hand: nothing written
    summary.write(tmp_path / "sub" / "x.json")
    body = json.loads((tmp_path / "sub" / "x.json").read_text())
    assert body["bench"] == "x" and len(body["load_before"]) == len(body["load_after"]) == 3
    assert body["rows"] == [{"metric": "r", "value": 2.0, "unit": "s", "goal": "<= 3", "met": True}]


def test_run_all_reports_failures_and_runs_the_rest(tmp_path, monkeypatch):
    write_fakes(tmp_path)
    # The hanging bench's timeout counts from when it is inside its try block: a SIGINT that came while the child
    # was still starting Python would skip its finally, however long the timeout, on a loaded enough machine.
    real_wait = bench_all.wait

    def wait_from_start(proc, timeout_s):
        if "bench_hangs.py" in str(proc.args):
            started = tmp_path / "out" / "hangs.json.started"
            for _ in range(6000):  # at most 10 minutes
                if started.exists() or proc.poll() is not None:
                    break
                time.sleep(0.1)
        return real_wait(proc, timeout_s)

    monkeypatch.setattr(bench_all, "wait", wait_from_start)
    benches = {name: bench_all.Bench(timeout_s=HANG_TIMEOUT_S if name == "hangs" else 30) for name in FAKES}
    results = bench_all.run_all(benches, tmp_path, tmp_path / "out", quick=False)
    by_name = {r["bench"]: r for r in results}
    assert [r["bench"] for r in results] == list(FAKES)
    assert by_name["ok"]["failed"] is None and [r["met"] for r in by_name["ok"]["rows"]] == [True, None, False]
    assert by_name["fails"]["failed"] == "exit code 3"
    assert by_name["fails"]["stderr_tail"] == "line one\nValueError: boom"
    assert by_name["hangs"]["failed"] == f"timed out after {HANG_TIMEOUT_S} s"
    assert (tmp_path / "out" / "hangs.json.cleaned").exists()  # SIGINT stopped it: a SIGKILL runs no finally
    assert by_name["silent"]["failed"] == "exited 0 without writing its summary"

    host = {"nproc": 2, "cpu": "Test CPU", "date": "2026-12-01 00:00 UTC", "load_at_start": [0.2, 0.1, 0.1]}
    lines = bench_all.render(host, results, quick=False).splitlines()
    assert lines[0] == "Machine: 2 CPUs (Test CPU), 2026-12-01 00:00 UTC" and "WARNING" not in "".join(lines)
    cells = [line.split(" | ")[1:6] for line in lines if line.startswith("| ") and " | metric | " not in line]
    assert cells == [["ratio", "0.61", "ratio", ">= 0.5", "yes"], ["rate", "1234", "MB/s", "", ""],
                     ["gap \\| abs", "4.00e-03", "nats", "<= 0.001", "**no**"],
                     ["FAILED: exit code 3", "", "", "", ""],
                     [f"FAILED: timed out after {HANG_TIMEOUT_S} s", "", "", "", ""],
                     ["FAILED: exited 0 without writing its summary", "", "", "", ""]]
    assert "fails failed (exit code 3); the end of its stderr:" in lines


def test_render_warns_on_a_loaded_machine():
    host = {"nproc": 2, "cpu": "c", "date": "d", "load_at_start": [1.5, 1.0, 1.0]}
    assert "WARNING: 1-min load average 1.50 at start on 2 CPUs" in bench_all.render(host, [], quick=True)


def test_select():
    assert list(bench_all.select(None, None)) == list(bench_all.BENCHES)
    assert list(bench_all.BENCHES)[-1] == "pipeline_vs_conventional"  # the long one last
    assert list(bench_all.select("grading,streams", None)) == ["streams", "grading"]
    assert "logprobs" not in bench_all.select(None, "logprobs,grading")
    with pytest.raises(ValueError, match="unknown bench"):
        bench_all.select("stream", None)


def test_main_quick_writes_table_and_summary(tmp_path):
    """The CLI end to end on one fake bench named like a real one: it gets its --quick arguments."""
    (tmp_path / "bench_grading.py").write_text(HEADER + textwrap.dedent("""
        s = Summary("grading")
        s.add("quick args", float(sys.argv[1:3] == ["--completions", "60"]), "", ">= 1")
        s.write(summary_path)
    """))
    out = tmp_path / "out"
    assert bench_all.main(["--quick", "--only", "grading", "--bench-dir", str(tmp_path), "--out-dir", str(out)]) == 0
    assert "| grading | quick args | 1 |  | >= 1 | yes |" in (out / "table.md").read_text()
    body = json.loads((out / "summary.json").read_text())
    assert body["quick"] and body["machine"]["nproc"] >= 1 and body["benches"][0]["rows"][0]["met"]


def test_a_full_run_writes_its_table_into_the_page_between_the_markers(tmp_path, monkeypatch):
    """--page: the text between the markers is replaced by the run's table, the rest kept byte for byte; a
    partial run (--only) leaves the page alone; a page without markers is refused before it is written."""
    (tmp_path / "bench_streams.py").write_text(HEADER + textwrap.dedent("""
        s = Summary("streams")
        s.add("ratio", 0.61, "ratio", ">= 0.5")
        s.write(summary_path)
    """))
    monkeypatch.setattr(bench_all, "BENCHES", {"streams": bench_all.Bench()})
    page = tmp_path / "performance.md"
    before, after = "# Title\n\ntext before\n\n", "\ntext after\n"
    page.write_text(f"{before}{bench_all.TABLE_START}\nold table\n{bench_all.TABLE_END}{after}")
    out = tmp_path / "out"
    assert bench_all.main(["--only", "streams", "--bench-dir", str(tmp_path), "--out-dir", str(out),
                           "--page", str(page)]) == 0
    assert "old table" in page.read_text()  # a partial run
    assert bench_all.main(["--bench-dir", str(tmp_path), "--out-dir", str(out), "--page", str(page)]) == 0
    table = (out / "table.md").read_text()
    assert page.read_text() == f"{before}{bench_all.TABLE_START}\n{table}{bench_all.TABLE_END}{after}"
    assert "| streams | ratio | 0.61 | ratio | >= 0.5 | yes |" in table and "Machine: " in table
    page.write_text("no markers\n")
    with pytest.raises(ValueError, match="no bench table markers"):
        bench_all.update_page(page, table)
    assert page.read_text() == "no markers\n"


def test_the_performance_page_has_the_bench_markers_in_order():
    text = (TOOLS.parent / "docs" / "performance.md").read_text()
    assert 0 <= text.index(bench_all.TABLE_START) < text.index(bench_all.TABLE_END)

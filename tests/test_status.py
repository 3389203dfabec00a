"""`pipelinerl status` from a run directory (launch/status.py) and the status files the roles write there
(rundir.StatusFile, procs.Supervisor's report): fabricated files where the moment matters (a wait past its limit,
a stale writer), real child processes where the launcher writes them. The live runs are in test_chaos.py (a local
run with kills), test_launch_health.py (a silent server; a vLLM server's /status) and test_slurm.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipelinerl.config import load_config, save_config
from pipelinerl.launch.procs import Role, Supervisor
from pipelinerl.launch.restarts import RestartBudget, Restarts
from pipelinerl.launch.status import last_error, render, snapshot
from pipelinerl.rundir import StatusFile, read_statuses

REPO = Path(__file__).resolve().parent.parent



def test_a_status_file_is_rewritten_at_most_every_period_and_keeps_a_wait_s_start(tmp_path):
    status = StatusFile(tmp_path, "trainer", every_s=3600)
    status.update(step=1)  # the first update writes at once
    assert read_statuses(tmp_path)["trainer"]["step"] == 1
    status.update(step=2)  # within the period: kept, not written
    assert read_statuses(tmp_path)["trainer"]["step"] == 1
    status.waiting("the rollouts of step 3", groups_read=1)
    since = status.fields["waiting"]["since"]
    status.waiting("the rollouts of step 3", groups_read=2)
    assert status.fields["waiting"] == {"for": "the rollouts of step 3", "since": since, "groups_read": 2}
    status.waiting("the rollouts of step 4")
    assert status.fields["waiting"]["since"] >= since and status.fields["waiting"]["for"].endswith("step 4")
    status.done_waiting()
    status.flush()
    written = read_statuses(tmp_path)["trainer"]
    assert written["step"] == 2 and written["waiting"] is None and written["pid"] == os.getpid()
    assert written["time"] >= written["started"]
    status.close()


def test_a_status_file_is_rewritten_between_updates_until_closed_and_never_recreates_its_folder(tmp_path):
    """The heartbeat: a role busy for minutes (one long step) still rewrites its file, so an old file means a gone
    writer; once closed (the role stopped) or its folder removed, nothing is written."""
    import shutil

    status = StatusFile(tmp_path / "run", "trainer", every_s=0.05)
    status.update(step=1)
    first = read_statuses(tmp_path / "run")["trainer"]["time"]
    deadline = time.monotonic() + 30
    while read_statuses(tmp_path / "run")["trainer"]["time"] == first:  # no update since: the thread writes
        assert time.monotonic() < deadline, "the status file was not rewritten"
        time.sleep(0.01)
    assert read_statuses(tmp_path / "run")["trainer"]["step"] == 1
    shutil.rmtree(tmp_path / "run")
    time.sleep(0.3)  # six periods: a beat would have re-created it by now
    assert not (tmp_path / "run").exists()
    status.close()


def test_a_failed_write_is_logged_once_and_does_not_stop_the_role(tmp_path, caplog):
    (tmp_path / "status").write_text("a file where the folder should be")
    status = StatusFile(tmp_path, "actor0", every_s=0)
    status.update(version=1)
    status.update(version=2)
    assert status.fields["version"] == 2
    assert sum("cannot write" in r.getMessage() for r in caplog.records) == 1


def _write(run_dir, name: str, **fields) -> None:
    (run_dir / "status").mkdir(parents=True, exist_ok=True)
    (run_dir / "status" / f"{name}.json").write_text(json.dumps(fields))


def test_the_snapshot_shows_roles_servers_long_waits_stale_writers_and_errors(tmp_path):
    run_dir, now = tmp_path / "run", 1_000_000.0
    run_dir.mkdir()
    save_config(load_config(REPO / "configs" / "tiny_cpu.yaml", [f"run_dir={run_dir}", "trainer.wait_log_s=30",
                                                                 "actor.wait_log_s=60"]), run_dir / "config.yaml")
    here = {"host": "another-host", "pid": 1}  # another host: the pid is not checked, only the file's age
    _write(run_dir, "launch", **here, time=now - 1, roles={
        "server0": {"pid": 11, "state": "running", "restarts": 0, "log": "logs/server0.log", "kind": "servers",
                    "url": "http://h:8080", "health": "ok",
                    "server": {"version": 7, "updating": True, "held_s": 0.0, "updates": 7}},
        "server1": {"pid": 12, "state": "starting", "restarts": 2, "down_s": 41.0, "log": "logs/server1.log",
                    "kind": "servers"},
        "trainer": {"pid": 13, "state": "running", "restarts": 0, "log": "logs/trainer.log"}})
    _write(run_dir, "trainer", **here, time=now - 2, step=7, max_steps=300, samples_per_s=740.5, lag_mean=1.25,
           lag_max=3, waiting={"for": "the rollouts of step 8", "since": now - 45, "groups_read": 3, "groups": 32})
    _write(run_dir, "actor0", **here, time=now - 3, version=7, groups_in_flight=0, held_by="lag",
           waiting={"for": "the servers to reach version 8", "since": now - 45})  # under actor.wait_log_s
    _write(run_dir, "actor1", **here, time=now - 100, version=5, groups_in_flight=4,
           waiting={"for": "the servers to reach version 6", "since": now - 500})  # stale: not a live wait
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "server1.log").write_text(textwrap.dedent("""\
        2026-12-07 10:00:00,000 INFO serve pipelinerl: ready
        Traceback (most recent call last):
          File "x.py", line 1, in <module>
        ValueError: first
        During handling of the above exception, another exception occurred:

        Traceback (most recent call last):
          File "x.py", line 2, in <module>
        RuntimeError: CUDA error: out of memory
        2026-12-07 10:00:01,000 INFO serve pipelinerl: exiting
        """))
    (run_dir / "logs" / "trainer.log").write_text("Traceback (most recent call last):\n  File ...\n"
                                                  "KeyboardInterrupt\n")  # a role stopped by a signal: no error
    snap = snapshot(run_dir, now=now)
    assert snap["roles"]["server0"]["kind"] == "policy" and snap["roles"]["server1"]["state"] == "starting"
    assert [(w["role"], round(w["waited_s"]), w["limit_s"]) for w in snap["long_waits"]] == [("trainer", 45, 30)]
    assert snap["statuses"]["actor1"]["stale"] == "not rewritten for 100 s" and not snap["statuses"]["trainer"]["stale"]
    assert snap["errors"] == {"server1": {"line": "RuntimeError: CUDA error: out of memory",
                                          "log": str(run_dir / "logs" / "server1.log")}}
    text = render(snap)
    for shown in ("run " + str(run_dir) + ": step 7 of 300; no checkpoint yet", "starting (down 41 s)",
                  "http://h:8080", "updating", "740.5 samples/s", "lag mean 1.25 max 3",
                  "trainer has waited 45 s for the rollouts of step 8 (groups read 3, groups 32) (limit 30 s)",
                  "held by lag", "stale: not rewritten for 100 s", "server1: RuntimeError: CUDA error: out of memory"):
        assert shown in text, (shown, text)
    assert json.loads(json.dumps(snap))["roles"]["server1"]["restarts"] == 2  # --json: plain JSON


def test_a_writer_gone_from_this_host_is_stale_at_once(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _write(tmp_path, "actor0", host=os.uname().nodename, pid=int(dead.stdout), time=time.time(), version=1)
    _write(tmp_path, "trainer", host=os.uname().nodename, pid=int(dead.stdout), time=time.time(), state="stopped")
    statuses = snapshot(tmp_path)["statuses"]
    assert statuses["actor0"]["stale"] == f"its writer (pid {int(dead.stdout)}) is gone"
    assert statuses["trainer"]["stale"] is None  # it said it stopped


def test_last_error_reads_error_lines_and_tracebacks():
    assert last_error(["x ERROR a", "y INFO b"]) == "x ERROR a"
    assert last_error(["Traceback (most recent call last):", '  File "a"', "OSError: disk full", "INFO c"]) == \
        "OSError: disk full"
    assert last_error(["x ERROR a", "Traceback (most recent call last):", "  File", "asyncio.CancelledError"]) == \
        "x ERROR a"
    assert last_error(["Traceback (most recent call last):", "  File"]) is None  # cut off before its exception


SERVER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    runs, discovery, go = map(Path, sys.argv[1:4])
    first = not runs.exists()
    runs.write_text("run\\n" * (1 if first else 2))
    if first:
        raise SystemExit(1)
    while not go.exists():
        time.sleep(0.02)
    discovery.write_text("http://new\\n")
    time.sleep(600)
""")


def test_the_launcher_reports_a_dead_server_restarting_then_running_then_stopped(tmp_path):
    """The supervisor's status file, with real processes: the server's first run dies at once; its restart is
    announced only once the test says so, so "starting" is seen by construction."""
    run_dir, go = tmp_path / "run", tmp_path / "go"
    discovery, runs = run_dir / "servers" / "127.0.0.1_8000", tmp_path / "server0.runs"
    discovery.parent.mkdir(parents=True)
    sup = Supervisor(Restarts(RestartBudget(3, 3600.0), run_dir), status=StatusFile(run_dir, "launch", every_s=0))
    try:
        sup.start(Role("server0", [sys.executable, "-c", SERVER, str(runs), str(discovery), str(go)],
                       tmp_path / "server0.log", discovery=discovery))
        deadline = time.monotonic() + 60
        while not (runs.exists() and runs.read_text().count("run") == 2):
            assert time.monotonic() < deadline
            sup.check()
            time.sleep(0.02)
        sup.check()
        entry = snapshot(run_dir)["roles"]["server0"]
        assert (entry["state"], entry["restarts"], entry["kind"], "url" in entry) == ("starting", 1, "policy", False)
        assert entry["down_s"] > 0 and entry["pid"] == sup.running["server0"][1].pid
        go.touch()
        while not discovery.exists():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        sup.check()
        entry = snapshot(run_dir)["roles"]["server0"]
        assert (entry["state"], entry["restarts"], entry["url"], entry["down_s"]) == ("running", 1, "http://new", None)
    finally:
        sup.stop_all(grace_s=5)
    launch = snapshot(run_dir)["statuses"]["launch"]
    assert launch["state"] == "stopped" and launch["roles"]["server0"]["state"] == "stopped" and not launch["stale"]


@pytest.mark.parametrize("args", [[], ["--json"]])
def test_the_command_prints_the_snapshot(tmp_path, args):
    _write(tmp_path, "trainer", host="h", pid=1, time=time.time(), step=3)
    out = subprocess.run([sys.executable, "-m", "pipelinerl", "status", str(tmp_path), *args], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    if args:
        assert json.loads(out.stdout)["statuses"]["trainer"]["step"] == 3
    else:
        assert out.stdout.startswith(f"run {tmp_path}: step 3; no checkpoint yet")
    missing = subprocess.run([sys.executable, "-m", "pipelinerl", "status", str(tmp_path / "nope")],
                             capture_output=True, text=True, timeout=120, cwd=REPO)
    assert missing.returncode != 0 and "no such run directory" in missing.stderr


def test_files_that_are_not_status_files_are_left_out_and_never_crash_the_command(tmp_path):
    """Whatever else lies in RUN_DIR/status or RUN_DIR/logs (garbled, hand-written, a folder named *.log)."""
    (tmp_path / "status").mkdir()
    for name, text in {"garbled": "{not json", "a_list": "[1, 2]", "no_time": '{"step": 3}',
                       "bad_wait": '{"time": 1.0, "waiting": "forever"}', "bad_roles": '{"time": 1.0, "roles": [1]}'
                       }.items():
        (tmp_path / "status" / f"{name}.json").write_text(text)
    _write(tmp_path, "launch", host="h", pid=1, time=time.time(), roles={"x": "not a role", "server0": {"pid": 2}})
    (tmp_path / "logs" / "folder.log").mkdir(parents=True)
    snap = snapshot(tmp_path)
    assert set(snap["statuses"]) == {"launch"} and set(snap["roles"]) == {"server0"} and snap["errors"] == {}
    assert "server0  ?" in render(snap)

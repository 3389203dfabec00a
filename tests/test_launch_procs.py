"""The launcher's process supervision, with real processes (and grandchildren)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pipelinerl.launch.procs import Role, RoleFailed, Supervisor

# A role that starts a grandchild (as vLLM and DeepSpeed do), records both pids (whole once the file exists: written
# aside, then renamed), then sleeps.
PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead for our purposes
        return f.read().split(")")[-1].split()[0] != "Z"


def _wait_pids(path, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return [int(p) for p in path.read_text().split()]
        time.sleep(0.05)
    raise AssertionError(f"no pids in {path}")


def _gone(pids, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return not any(_alive(p) for p in pids)


def test_stop_all_stops_roles_and_their_grandchildren(tmp_path):
    sup = Supervisor()
    pids = []
    for name in ("server0", "trainer"):
        sup.start(Role(name, [sys.executable, "-c", PARENT, str(tmp_path / name)], tmp_path / f"{name}.log"))
        pids += _wait_pids(tmp_path / name)
    assert all(_alive(p) for p in pids)
    sup.check()  # nothing failed
    sup.stop_all(grace_s=5)
    assert _gone(pids)


def test_a_failing_role_is_named_with_its_log(tmp_path):
    sup = Supervisor()
    sup.start(Role("server0", [sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "s.log"))
    sup.start(Role("actor", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"], tmp_path / "a.log"))
    try:
        with pytest.raises(RoleFailed) as err:
            sup.wait_for("server0", timeout_s=30, poll_s=0.05)
        assert err.value.role.name == "actor" and err.value.returncode == 3
        assert str(tmp_path / "a.log") in str(err.value)
        assert (tmp_path / "a.log").read_text().strip() == "boom"
    finally:
        sup.stop_all(grace_s=5)


def test_children_die_when_the_launcher_is_killed(tmp_path):
    # A launcher process supervising one role is SIGKILLed: PR_SET_PDEATHSIG must stop the role.
    launcher = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from pipelinerl.launch.procs import Role, Supervisor
        Supervisor().start(Role("trainer", [sys.executable, "-c", {PARENT!r}, {str(tmp_path / 'pids')!r}],
                                Path({str(tmp_path / 't.log')!r})))
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", launcher])
    role_pid, grandchild = _wait_pids(tmp_path / "pids")
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert _gone([role_pid])
    finally:  # the role's own children are the role's business (vLLM's engine exits with its parent)
        os.killpg(role_pid, signal.SIGKILL)
        assert _gone([grandchild])

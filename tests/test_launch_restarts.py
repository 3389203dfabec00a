"""The launchers' restart policy (launch/restarts.py, procs.Supervisor.check) with real child processes:
deaths happen by construction (a child that exits 1 at once), and every wait is on a condition with a
bound, never on a sleep's length."""

import json
import shutil
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipelinerl.config import ConfigError, load_config
from pipelinerl.launch.local import _roles, follow_trainer, placement
from pipelinerl.launch.procs import Role, RoleFailed, Supervisor
from pipelinerl.launch.restarts import RestartBudget, Restarts
from pipelinerl.launch.slurm import _follow_trainer, dry_run_allocation, plan_roles
from pipelinerl.launch.slurm_node import node_server_roles

REPO = Path(__file__).resolve().parent.parent

# Appends its pid to RUNS, then: the first DEATHS runs exit 1 at once; later ones `sleep` or `exit` 0.
FLAKY = textwrap.dedent("""
    import os, sys, time
    runs, deaths, then = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with open(runs, "a") as f:
        f.write(f"{os.getpid()}\\n")
    if len(open(runs).read().split()) <= deaths:
        raise SystemExit(1)
    if then == "sleep":
        time.sleep(600)
""")

# A server that publishes its discovery file: its first run publishes and dies; a restarted run publishes
# only once the test creates GO, then serves (sleeps).
SERVER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    runs, discovery, go = map(Path, sys.argv[1:4])
    first = not runs.exists()
    runs.write_text("run\\n" * (1 if first else 2))
    if first:
        discovery.write_text("http://old\\n")
        raise SystemExit(1)
    deadline = time.monotonic() + 120
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    discovery.write_text("http://new\\n")
    time.sleep(600)
""")


def _flaky(tmp_path, name: str, deaths: int, then: str = "sleep", **fields) -> Role:
    return Role(name, [sys.executable, "-c", FLAKY, str(tmp_path / f"{name}.runs"), str(deaths), then],
                tmp_path / f"{name}.log", **fields)


def _runs(tmp_path, name: str) -> list[int]:
    path = tmp_path / f"{name}.runs"
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _check_until(sup: Supervisor, done, timeout_s: float = 60.0) -> None:
    """Call sup.check() (which restarts dead roles) until `done()`; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "condition not reached"
        sup.check()
        time.sleep(0.02)


def _restarts(tmp_path, max_restarts: int = 3, window_s: float = 3600.0) -> Restarts:
    return Restarts(RestartBudget(max_restarts, window_s), tmp_path / "run")


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_the_budget_is_a_sliding_window():
    budget = RestartBudget(max_restarts=2, window_s=10.0)
    assert budget.take("server0", 0.0) and budget.take("server0", 4.0)
    assert not budget.take("server0", 9.0)  # two within the last 10 s
    assert budget.take("actor", 9.0)  # per role
    assert budget.take("server0", 10.0)  # the restart at 0 s is forgotten
    assert not budget.take("server0", 13.9)  # 4 s and 10 s still count
    assert budget.take("server0", 14.0) and not budget.take("server0", 14.0)
    assert not RestartBudget(0, 10.0).take("server0", 0.0)


def test_a_dead_role_is_restarted_in_its_place_and_the_others_keep_running(tmp_path):
    sup = Supervisor(_restarts(tmp_path))
    try:
        for role in (_flaky(tmp_path, "server0", 0), _flaky(tmp_path, "trainer", 0), _flaky(tmp_path, "actor", 1)):
            sup.start(role)
        _check_until(sup, lambda: len(_runs(tmp_path, "actor")) == 2)
        sup.check()
        assert sup.running["actor"][1].pid == _runs(tmp_path, "actor")[1]  # the restarted process
        assert [sup.running[n][1].pid for n in ("server0", "trainer")] == [
            _runs(tmp_path, "server0")[0], _runs(tmp_path, "trainer")[0]]  # untouched
        assert list(sup.running) == ["server0", "trainer", "actor"]  # the shutdown order stays
        assert sup.restarts.count == {"actor": 1}
    finally:
        sup.stop_all(grace_s=5)


def test_past_the_budget_the_run_stops_naming_the_role_and_its_log(tmp_path):
    sup = Supervisor(_restarts(tmp_path, max_restarts=2))
    try:
        sup.start(_flaky(tmp_path, "server0", 0))
        sup.start(_flaky(tmp_path, "actor", deaths=99))
        with pytest.raises(RoleFailed) as err:
            _check_until(sup, lambda: False)
        assert err.value.role.name == "actor" and err.value.returncode == 1
        assert "after 2 restart(s)" in str(err.value) and str(tmp_path / "actor.log") in str(err.value)
        assert len(_runs(tmp_path, "actor")) == 3  # the first run and two restarts
    finally:
        sup.stop_all(grace_s=5)


def test_without_a_policy_or_for_a_role_that_may_not_restart_any_death_stops_the_run(tmp_path):
    for restarts, fields in ((None, {}), (_restarts(tmp_path), {"restartable": False})):
        sup = Supervisor(restarts)
        try:
            sup.start(_flaky(tmp_path, "servers", 99, **fields))
            with pytest.raises(RoleFailed, match=r"role `servers` exited with code 1; its log"):
                _check_until(sup, lambda: False)
        finally:
            sup.stop_all(grace_s=5)
        (tmp_path / "servers.runs").unlink()


def test_a_restart_runs_the_command_computed_then(tmp_path):
    out = tmp_path / "restarted"
    role = Role("server0", [sys.executable, "-c", "raise SystemExit(1)"], tmp_path / "s.log",
                restart_argv=lambda: [sys.executable, "-c",  # written aside, renamed: whole when it exists
                                      f"import os; open({str(out)!r} + '.tmp', 'w').write('v7'); "
                                      f"os.replace({str(out)!r} + '.tmp', {str(out)!r})"])
    sup = Supervisor(_restarts(tmp_path))
    try:
        sup.start(role)
        _check_until(sup, out.exists)
    finally:
        sup.stop_all(grace_s=5)
    assert out.read_text() == "v7"


def test_a_server_is_down_until_it_publishes_again_and_the_scalars_say_so(tmp_path):
    discovery, go = tmp_path / "run" / "servers" / "127.0.0.1_8000", tmp_path / "go"
    discovery.parent.mkdir(parents=True)
    runs = tmp_path / "server0.runs"
    role = Role("server0", [sys.executable, "-c", SERVER, str(runs), str(discovery), str(go)], tmp_path / "s.log",
                discovery=discovery)
    restarts = _restarts(tmp_path)
    sup = Supervisor(restarts)
    try:
        sup.start(role)
        _check_until(sup, lambda: runs.exists() and runs.read_text().count("run") == 2)  # restarted
        assert not discovery.exists()  # the dead server's announcement is gone: nobody routes to it
        for _ in range(5):
            sup.check()
        assert "server0" in restarts._down_since and not restarts.downtime_s.get("server0")  # not up yet
        go.touch()
        _check_until(sup, lambda: "server0" not in restarts._down_since)
        assert discovery.read_text() == "http://new\n"
    finally:
        sup.stop_all(grace_s=5)
    scalars = _scalars(tmp_path / "run" / "tb" / "launch")
    assert scalars["launch/restarts/server0"] == [(1, 1.0)]
    [(step, downtime)] = scalars["launch/downtime_s/server0"]
    assert step == 1 and downtime == pytest.approx(restarts.downtime_s["server0"]) and downtime > 0


def test_restart_counts_and_downtime_accumulate_per_role(tmp_path):
    restarts = _restarts(tmp_path)
    sup = Supervisor(restarts)
    try:
        sup.start(_flaky(tmp_path, "trainer", deaths=2))
        _check_until(sup, lambda: len(_runs(tmp_path, "trainer")) == 3)
        sup.check()
    finally:
        sup.stop_all(grace_s=5)
    scalars = _scalars(tmp_path / "run" / "tb" / "launch")
    assert scalars["launch/restarts/trainer"] == [(1, 1.0), (2, 2.0)]
    assert [step for step, _ in scalars["launch/downtime_s/trainer"]] == [1, 2]  # up once its process started
    assert sum(v for _, v in scalars["launch/downtime_s/trainer"]) == pytest.approx(restarts.downtime_s["trainer"])


def _config(tmp_path, *overrides):
    return load_config(REPO / "configs/tiny_cpu.yaml", [f"run_dir={tmp_path / 'run'}", "inference.base_port=18100",
                                                       "logging.progress_bar=false", *overrides])


def _fake_checkpoint(run_dir: Path, step: int) -> Path:
    path = run_dir / "checkpoints" / f"step_{step:08d}"
    (path / "hf").mkdir(parents=True)
    (path / "hf" / "model.safetensors").write_text(f"weights of step {step}")
    (path / "meta.json").write_text(json.dumps({"step": step, "version": step}))
    return path


def _model_and_version(argv: list[str]) -> tuple[str, str]:
    return argv[argv.index("--model") + 1], argv[argv.index("--version") + 1]


def test_a_restarted_policy_server_starts_from_the_latest_checkpoint(tmp_path):
    cfg = _config(tmp_path, "inference.num_servers=2", "rl.kl_coef=0.1", "inference.reference_servers=1")
    config, run_dir = str(tmp_path / "run" / "config.yaml"), tmp_path / "run"
    local, trainer, actor = _roles(cfg, Path(config), placement(cfg, []))
    node = node_server_roles(cfg, config, cfg.model.path, 0, "n0", side=True)
    assert _model_and_version(local[0].argv) == (cfg.model.path, "0")
    _fake_checkpoint(run_dir, 3)
    latest = _fake_checkpoint(run_dir, 7)
    (run_dir / "checkpoints" / "step_00000009.tmp").mkdir()  # incomplete: never served
    pinned = []
    for role in (local[0], local[1], node[1]):
        argv = role.restart_argv()
        model, version = _model_and_version(argv)
        assert version == "7" and Path(model).parent == run_dir / "serving", role.name
        # pinned: hard links to the latest checkpoint's files, which retention may delete meanwhile
        assert (Path(model) / "model.safetensors").stat().st_ino == (latest / "hf/model.safetensors").stat().st_ino
        changed = [old for old, new in zip(role.argv, argv) if old != new]
        assert len(argv) == len(role.argv) and changed == [cfg.model.path, "0"]  # the same port, config, ...
        pinned.append(Path(model))
    assert len(set(pinned)) == 3  # one folder per server
    shutil.rmtree(latest)
    assert (pinned[0] / "model.safetensors").read_text() == "weights of step 7"
    # The trainer resumes from the checkpoint by itself, the actor continues its stream, a reference server
    # serves the initial model: their commands stay.
    assert trainer.restart_argv is actor.restart_argv is local[2].restart_argv is node[0].restart_argv is None
    assert local[0].discovery == run_dir / "servers" / "127.0.0.1_18100"
    assert local[2].discovery == node[0].discovery == run_dir / "reference_servers" / "127.0.0.1_18102"
    slurm = plan_roles(cfg, dry_run_allocation(cfg), Path(config))
    assert all(role.restartable for role in slurm.values()) and "servers@inference0" in slurm


def test_the_launchers_follow_a_restarted_trainer_until_it_exits_0(tmp_path):
    cfg = _config(tmp_path)
    for follow in (lambda sup: follow_trainer(cfg, sup, ["http://127.0.0.1:9"]),
                   lambda sup: _follow_trainer(cfg, sup, SimpleNamespace(usr1=False))):
        sup = Supervisor(Restarts.from_config(cfg))
        try:
            sup.start(_flaky(tmp_path, "trainer", deaths=1, then="exit"))
            assert follow(sup) in (None, False)  # finished: no requeue
            assert sup.returncode("trainer") == 0 and sup.restarts.count == {"trainer": 1}
        finally:
            sup.stop_all(grace_s=5)
        (tmp_path / "trainer.runs").unlink()


def test_the_restart_fields_are_validated():
    tiny = REPO / "configs/tiny_cpu.yaml"
    cfg = load_config(tiny, [])
    assert (cfg.launch.max_restarts, cfg.launch.restart_window_s) == (3, 3600.0)
    assert Restarts.from_config(load_config(tiny, ["launch.max_restarts=0"])) is None
    with pytest.raises(ConfigError, match="launch.max_restarts"):
        load_config(tiny, ["launch.max_restarts=-1"])
    with pytest.raises(ConfigError, match="launch.restart_window_s"):
        load_config(tiny, ["launch.restart_window_s=0"])


def test_a_checkpoint_rotated_away_while_being_pinned_gives_way_to_the_newer_one(tmp_path, monkeypatch):
    from pipelinerl.launch import local
    from pipelinerl.trainer import checkpoints

    cfg = _config(tmp_path)
    run_dir = tmp_path / "run"
    old = _fake_checkpoint(run_dir, 3)
    _fake_checkpoint(run_dir, 4)
    answers, real = [old], checkpoints.latest_checkpoint

    def rotated(root):  # the trainer saves step 4 and deletes step 3 between the lookup and the pin
        if answers:
            shutil.rmtree(answers.pop())
            return old
        return real(root)

    monkeypatch.setattr(checkpoints, "latest_checkpoint", rotated)
    model, version = local.serving_weights(cfg, pin="x")
    assert (model, version) == (str(run_dir / "serving" / "x"), 4)
    assert (Path(model) / "model.safetensors").read_text() == "weights of step 4"


def _checkpoint_of(run_dir: Path, step: int, files: int = 3) -> Path:
    """A complete checkpoint whose hf/ holds `files` files, so that a pin can fail between two of them."""
    path = _fake_checkpoint(run_dir, step)
    for k in range(1, files):
        (path / "hf" / f"shard{k}.safetensors").write_text(f"shard {k} of step {step}")
    return path


def _rotating_link(monkeypatch, run_dir: Path, rotations: int, delete: bool = True) -> list[Path]:
    """Make the pin's link step rotate checkpoints, as the trainer does, after its first file of each of the
    first `rotations` checkpoints it pins: save the next step, then (`delete`) delete the one being pinned
    (retention, keep_last=1). Returns the checkpoints it saved."""
    from pipelinerl.launch import local

    real, saved, rotated = local._link_or_copy, [], set()

    def link(src: str, dest: str) -> None:
        real(src, dest)
        pinned = Path(src).parent.parent
        if pinned not in rotated and len(rotated) < rotations:
            rotated.add(pinned)
            saved.append(_checkpoint_of(run_dir, int(pinned.name.removeprefix("step_")) + 1))
            if delete:
                shutil.rmtree(pinned)

    monkeypatch.setattr(local, "_link_or_copy", link)
    return saved


def _assert_pinned_whole(model: str, checkpoint: Path) -> None:
    pinned, source = Path(model), checkpoint / "hf"
    assert sorted(p.name for p in pinned.iterdir()) == sorted(p.name for p in source.iterdir())
    assert all((pinned / p.name).stat().st_ino == p.stat().st_ino for p in source.iterdir())  # its own links


def test_a_checkpoint_deleted_mid_copy_gives_way_to_the_next_complete_one(tmp_path, monkeypatch):
    from pipelinerl.launch import local

    cfg, run_dir = _config(tmp_path), tmp_path / "run"
    first = _checkpoint_of(run_dir, 3)
    saved = _rotating_link(monkeypatch, run_dir, rotations=1)
    model, version = local.serving_weights(cfg, pin="x")
    assert not first.exists() and saved == [run_dir / "checkpoints" / "step_00000004"]
    assert (model, version) == (str(run_dir / "serving" / "x"), 4)
    _assert_pinned_whole(model, saved[0])
    assert not (run_dir / "serving" / "x.tmp").exists()


def test_a_checkpoint_superseded_while_pinned_is_not_trusted(tmp_path, monkeypatch):
    """Retention may start on a checkpoint before the pin lists its files (no copy error then): a pin is kept
    only if its checkpoint is still the newest once every link is made."""
    from pipelinerl.launch import local

    cfg, run_dir = _config(tmp_path), tmp_path / "run"
    _checkpoint_of(run_dir, 3)
    saved = _rotating_link(monkeypatch, run_dir, rotations=2, delete=False)
    model, version = local.serving_weights(cfg, pin="x")
    assert (model, version) == (str(run_dir / "serving" / "x"), 5)
    _assert_pinned_whole(model, saved[-1])


def test_checkpoints_rotating_past_every_attempt_stop_the_pin_with_a_clear_error(tmp_path, monkeypatch):
    from pipelinerl.launch import local

    cfg, run_dir = _config(tmp_path), tmp_path / "run"
    _checkpoint_of(run_dir, 3)
    _rotating_link(monkeypatch, run_dir, rotations=local.PIN_ATTEMPTS)
    with pytest.raises(RuntimeError, match=rf"stayed the newest long enough to pin it \({local.PIN_ATTEMPTS} tries\)"):
        local.serving_weights(cfg, pin="x")

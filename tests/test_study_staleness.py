"""tools/study_staleness.py without running a pipeline: the grid and its resume state (--dry-run), and the report's
numbers from a run directory written by the project's own writers (TensorBoard scalars, per-token zarr statistics)
against values computed by hand. tests/test_slurm.py runs a real grid through the Slurm cluster."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from pipelinerl.config import load_config, save_config
from pipelinerl.metrics import Scalars, TokenStats

REPO = Path(__file__).resolve().parent.parent
CONFIG = str(REPO / "configs" / "tiny_cpu.yaml")


@pytest.fixture(scope="module")
def study():
    sys.path.insert(0, str(REPO / "tools"))
    spec = importlib.util.spec_from_file_location("study_staleness", REPO / "tools" / "study_staleness.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


def test_the_dry_run_prints_the_grid_with_finished_points_and_runs_nothing(study, tmp_path, capsys):
    cfg = load_config(CONFIG)
    done = tmp_path / "grpo" / "N2" / "seed1" / "checkpoints" / "step_00000004"
    done.mkdir(parents=True)
    (done / "meta.json").write_text(json.dumps({"step": 4}))
    half = tmp_path / "dpo" / "N1" / "seed0" / "checkpoints" / "step_00000002"  # a run stopped half way
    half.mkdir(parents=True)
    (half / "meta.json").write_text(json.dumps({"step": 2}))
    argv = [CONFIG, "--objectives", "grpo,dpo", "--staleness", "1,2", "--seeds", "0,1", "--out", str(tmp_path),
            "--dry-run", "trainer.max_steps=4"]
    assert study.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    states = {line.split()[0]: line.split()[1] for line in lines[:-1]}
    assert len(states) == 8 and states["grpo/N2/seed1"] == "finished" and states["dpo/N1/seed0"] == "pending"
    assert sum(s == "pending" for s in states.values()) == 7
    groups = 2 * cfg.trainer.samples_per_step // cfg.actor.attempts  # N = 2: two steps' groups in flight at once
    assert (f"rl.algorithm=dpo mode=conventional conventional.steps_per_batch=2 actor.max_lag=null "
            f"actor.max_groups_in_flight={groups} seed=1") in next(li for li in lines if li.startswith("dpo/N2/seed1"))
    assert lines[-1].startswith(f"study: 8 point(s), 7 pending: {7 * 4 * cfg.trainer.samples_per_step} samples")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dpo", "grpo"]  # nothing written, nothing run


def test_the_pipeline_knob_sets_max_lag_and_room_in_flight_for_it(study, tmp_path, capsys):
    cfg = load_config(CONFIG)
    groups = cfg.trainer.samples_per_step // cfg.actor.attempts
    assert study.main([CONFIG, "--objectives", "rloo", "--knob", "pipeline", "--staleness", "0,4", "--out",
                       str(tmp_path), "--dry-run"]) == 0
    lines = {li.split()[0]: li for li in capsys.readouterr().out.splitlines()[:-1]}
    in_flight = max(groups, cfg.actor.max_groups_in_flight)
    assert f"mode=pipeline actor.max_lag=0 actor.max_groups_in_flight={in_flight} seed=0" in lines["rloo/lag0/seed0"]
    assert f"actor.max_lag=4 actor.max_groups_in_flight={max(5 * groups, in_flight)} seed=0" in lines["rloo/lag4/seed0"]


def test_an_unknown_objective_or_an_impossible_point_is_refused(study, tmp_path, capsys):
    assert study.main([CONFIG, "--objectives", "grpo,ppo2", "--out", str(tmp_path), "--dry-run"]) == 2
    assert "ppo2" in capsys.readouterr().err
    assert study.main([CONFIG, "--staleness", "3", "--out", str(tmp_path), "--dry-run", "trainer.max_steps=4"]) == 2
    assert "multiple of conventional.steps_per_batch (3)" in capsys.readouterr().err


def _write_run(run_dir: Path, lags: np.ndarray, behaviour: np.ndarray, current: np.ndarray) -> None:
    save_config(load_config(CONFIG, [f"run_dir={run_dir}", "trainer.samples_per_step=32"]), run_dir / "config.yaml")
    trainer, actor = Scalars(run_dir, "trainer"), Scalars(run_dir, "actor")
    for step in (1, 2, 3, 4):
        trainer.log(step, {"reward_mean": 0.1 * step, "kl_ref": 0.01 * step, "ess": 1.0 - 0.05 * step})
    for step, success in ((0, 0.40), (2, 0.55), (4, 0.50)):
        actor.log(step, {"eval/success": success})
    trainer.close()
    actor.close()
    stats = TokenStats(run_dir)
    stats.append(0, lags, behaviour, current)


def test_run_metrics_and_the_report_from_a_run_directory(study, tmp_path):
    g = np.random.default_rng(0)
    lags = np.arange(100) % 4
    behaviour = -g.random(100).astype(np.float32)
    current = (behaviour + 0.1 * g.standard_normal(100)).astype(np.float32)
    point = study.Point("rloo", "conventional", 4, 0)
    _write_run(tmp_path / point.name, lags, behaviour, current)

    m = study.run_metrics(tmp_path / point.name, target=0.5)
    assert m["gold_final"] == pytest.approx(0.50) and m["gold_first"] == pytest.approx(0.40)
    assert m["proxy"] == pytest.approx(0.4) and m["kl_init"] == pytest.approx(0.04)  # the last quarter: step 4
    assert m["ess"] == pytest.approx(np.mean([0.95, 0.90, 0.85, 0.80]))
    assert m["lag_mean"] == pytest.approx(1.5) and m["lag_p95"] == pytest.approx(3.0)
    log_r = current.astype(np.float64) - behaviour.astype(np.float64)
    assert m["kl_behaviour"] == pytest.approx(np.mean(np.exp(log_r) - 1 - log_r), rel=1e-9)
    assert m["frontier"] == [(0.0, pytest.approx(0.40)), (pytest.approx(0.02), pytest.approx(0.55)),
                             (pytest.approx(0.04), pytest.approx(0.50))]
    assert m["steps"] == 4 and m["samples_per_s"] > 0 and m["time_to_target"] >= 0  # first >= 0.5 at version 2

    report = study.report(tmp_path, [point, study.Point("rloo", "conventional", 8, 0)], 0.5, "the command").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| rloo")]
    assert len(rows) == 1  # the point without a run directory is left out
    cells = [c.strip() for c in rows[0].split("|")[1:-1]]
    assert cells[:5] == ["rloo", "conventional.steps_per_batch=4", "1", "1.50", "3"] and cells[5] == "0.500"
    for image in ("frontier.png", "gold_vs_lag.png"):
        assert (tmp_path / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

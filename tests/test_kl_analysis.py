"""tools/kl_analysis.py on real runs (seed 001's Exp 2).

References: the trainer's own log-probs of the same tokens at the same step (zarr `current_logprobs`,
computed by DeepSpeed with the weights of that version); zero KL where target and behaviour are the
same weights; a positive KL where the target weights moved.
"""

import importlib.util
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from pipelinerl.config import TaskConfig, TinyModelConfig
from pipelinerl.metrics import read_token_stats
from pipelinerl.tasks import get_task
from pipelinerl.tiny.warm_start import warm_start

pytestmark = pytest.mark.slow  # reads two short `pipelinerl run`s

_spec = importlib.util.spec_from_file_location("kl_analysis", Path(__file__).parent.parent / "tools" / "kl_analysis.py")
kl_analysis = sys.modules["kl_analysis"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kl_analysis)


def test_target_logprobs_equal_the_trainers_at_each_step(conventional_g2_run):
    tokens = kl_analysis.token_kl(conventional_g2_run)
    stats = read_token_stats(conventional_g2_run)
    for step in range(6):  # per step, the mean of log(behaviour / target) over the same tokens
        ours = tokens["k1"][tokens["step"] == step]
        sel = stats["step"] == step
        trainer = stats["behaviour_logprobs"][sel].astype(np.float64) - stats["current_logprobs"][sel]
        assert len(ours) == sel.sum()
        np.testing.assert_allclose(ours.mean(), trainer.mean(), atol=1e-5)


def test_kl_is_zero_for_a_run_whose_weights_did_not_change(conventional_g2_run, tiny_model_dir):
    """The run's one-token completions never earn a reward, so every advantage is 0 and no step moves the
    weights: the target equals the behaviour policy at every lag, up to vLLM vs transformers noise."""
    base = load_file(tiny_model_dir / "model.safetensors")
    moved = load_file(conventional_g2_run / "checkpoints" / "step_00000006" / "hf" / "model.safetensors")
    assert max(float((moved[k] - base[k]).abs().max()) for k in base) < 1e-6
    table = {row["lag"]: row for row in kl_analysis.kl_by_lag(kl_analysis.token_kl(conventional_g2_run))}
    assert sorted(table) == [0, 1]  # G = 2
    for row in table.values():
        assert row["kl_k3"] < 1e-7 and abs(row["kl_k1"]) < 1e-4


def test_kl_is_positive_where_the_target_weights_moved(conventional_g2_run, tiny_model_dir, tmp_path):
    """The same run with the checkpoints of steps 1..6 replaced by weights that did move (24 supervised
    steps on the task): tokens trained at step 0 keep KL 0, those of steps 1..5 get a clearly positive KL."""
    run = tmp_path / "run"
    shutil.copytree(conventional_g2_run, run)
    trained = tmp_path / "trained"
    shutil.copytree(tiny_model_dir, trained)
    warm_start(trained, get_task(TaskConfig(eval_fraction=0.01)), TinyModelConfig(warm_start_steps=24,
                                                                                   warm_start_target=1.0))
    for step in range(1, 7):
        shutil.copy(trained / "model.safetensors", run / "checkpoints" / f"step_{step:08d}" / "hf")
    tokens = kl_analysis.token_kl(run)
    assert tokens["k3"][tokens["step"] == 0].mean() < 1e-7
    for step in range(1, 6):  # step t trains with version t; step_00000006 holds the final weights
        assert tokens["k3"][tokens["step"] == step].mean() > 1e-2
    assert all(row["kl_k3"] > 1e-3 for row in kl_analysis.kl_by_lag(tokens))


def test_cli_reports_both_modes(conventional_g2_run, pipeline_lag0_run, tmp_path, capsys):
    out = tmp_path / "kl.json"
    assert kl_analysis.main([str(conventional_g2_run), str(pipeline_lag0_run), "--json", str(out)]) == 0
    import json

    report = json.loads(out.read_text())
    assert report[str(conventional_g2_run)]["mode"] == "conventional"
    pipeline = report[str(pipeline_lag0_run)]
    assert pipeline["mode"] == "pipeline" and [r["lag"] for r in pipeline["by_lag"]] == [0]
    assert pipeline["by_lag"][0]["kl_k3"] < 1e-7  # max_lag = 0: every token scored by its own weights
    assert "conventional" in capsys.readouterr().out

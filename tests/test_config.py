import subprocess
import sys
from pathlib import Path

import pytest

from pipelinerl.config import Config, ConfigError, load_config, save_config

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
TINY = REPO / "configs" / "tiny_cpu.yaml"


def test_the_documented_configs_are_shipped():
    names = {p.name for p in CONFIGS}
    assert {"tiny_cpu.yaml", "qwen7b_orz.yaml", "qwen32b_orz.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_round_trips(path, tmp_path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


def test_seed_000_hyper_parameters_in_the_7b_and_32b_configs():
    for name, nodes in (("qwen7b_orz.yaml", 2), ("qwen32b_orz.yaml", 4)):
        cfg = load_config(REPO / "configs" / name)
        assert cfg.trainer.samples_per_step == 4096
        assert cfg.trainer.lr == pytest.approx(1e-6)
        assert cfg.actor.sampling.max_new_tokens == 8192
        assert cfg.launch.slurm.inference_nodes + cfg.launch.slurm.training_nodes == nodes


def test_overrides_apply_with_types():
    cfg = load_config(TINY, ["trainer.lr=3e-5", "actor.max_lag=null", "inference.engine_args.enforce_eager=true"])
    assert cfg.trainer.lr == pytest.approx(3e-5)
    assert cfg.actor.max_lag is None
    assert cfg.inference.engine_args == {"enforce_eager": True}
    assert load_config(TINY).trainer.lr == pytest.approx(1e-4)  # the file itself is unchanged


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["trainer.lrr=1"], "unknown key `trainer.lrr`; did you mean `trainer.lr`?"),
        (["trainer.lr=abc"], "config `trainer.lr`"),
        (["trainer.lr=-1"], "config `trainer.lr`: got -1.0; must be > 0"),
        (["trainer.zero_stage=5"], "choose one of 0, 1, 2, 3"),
        (["actor.attempts=1"], "config `actor.attempts`"),
        (["actor.attempts=3"], "config `trainer.samples_per_step`: must be a multiple of actor.attempts (3)"),
        (["inference.kv_on_update=drop"], "choose one of 'keep', 'recompute'"),
        (["inference.reference_servers=0"], "config `inference.reference_servers`: got 0; must be > 0"),
        (["model.tiny.num_attention_heads=8"], "head_dim = 16"),
        (["trainer.lr_schedule=cosine", "trainer.max_steps=null"], "set max_steps"),
        (["task.name=math"], "config `task.dataset_path`"),
        (["lr=1"], "unknown key `lr`"),
        (["trainer.lr"], "is not of the form key=value"),
    ],
)
def test_bad_values_raise_clear_errors(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    assert expected in str(err.value)


def test_missing_required_keys_and_files():
    with pytest.raises(ConfigError, match="`run_dir`.*not set"):
        load_config(None, ["model.path=/m"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("no/such/config.yaml")


def test_unknown_key_in_yaml_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.read_text() + "\nactor_typo:\n  attempts: 4\n")
    with pytest.raises(ConfigError, match="unknown key `actor_typo`; did you mean `actor`"):
        load_config(bad)


def test_cli_show_config_and_errors():
    run = [sys.executable, "-m", "pipelinerl.cli"]
    out = subprocess.run(run + ["show-config", str(TINY), "trainer.lr=0.5"], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert "lr: 0.5" in out.stdout and "run_dir: runs/tiny_cpu" in out.stdout
    bad = subprocess.run(run + ["show-config", str(TINY), "trainer.lr=-2"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2
    assert "config `trainer.lr`: got -2.0; must be > 0" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_config_and_cli_do_not_import_heavy_libraries():
    # `pipelinerl --help` and show-config must stay instant: no torch/vllm/deepspeed at import time.
    code = ("import sys, pipelinerl.cli, pipelinerl.config; "
            "print(sorted(m for m in ('torch', 'vllm', 'deepspeed', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

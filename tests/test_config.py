import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from pipelinerl.config import Config, ConfigError, field_doc, load_config, save_config, to_doc_yaml, to_yaml
from pipelinerl.config.fields import section_schema

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
        (["trainer.backend=fsdp"], "config `trainer.backend`: got 'fsdp'; choose one of 'deepspeed'"),
        (["model.dtype=float64"], "config `model.dtype`: got 'float64'; choose one of 'float32', 'bfloat16'"),
        (["actor.attempts=1"], "config `actor.attempts`"),
        (["actor.attempts=3"], "config `trainer.samples_per_step`: must be a multiple of actor.attempts (3)"),
        (["inference.kv_on_update=drop"], "choose one of 'keep', 'recompute'"),
        (["inference.reference_servers=0"], "config `inference.reference_servers`: got 0; must be > 0"),
        (["inference.eval_servers=-1"], "config `inference.eval_servers`: got -1; must be >= 0"),
        (["inference.eval_servers=1", "trainer.broadcast_port=65535"],
         "config `trainer.broadcast_port`: got 65535; the eval servers' weight group listens on broadcast_port + 1"),
        (["inference.eval_servers=2", "reward.kind=model", "reward.model_path=rm", "inference.base_port=65531"],
         "got 65531: its 5 server ports (policy, reference, reward, eval and OpenEnv environment servers) must fit "
         "below 65536"),
        (["launch.backend=slurm", "launch.eval_cpus=1"], "config `launch.eval_cpus`: is for the local launcher"),
        (["launch.eval_cpus=1-"], "config `launch.eval_cpus`"),
        (["model.tiny.num_attention_heads=8"], "head_dim = 16"),
        (["trainer.lr_schedule=cosine", "trainer.max_steps=null"], "set max_steps"),
        (["task.name=math"], "config `task.dataset_path`"),
        (["task.name=math_tir"], "config `task.dataset_path`: the math_tir task needs a file"),
        (["task.name=math_tir", "task.dataset_path=x.jsonl", "task.credit_truncated=true"],
         "config `task.credit_truncated`: math_tir never grades a cut turn"),
        (["task.name=math_tir", "task.dataset_path=x.jsonl", "task.overlong_buffer_tokens=10"],
         "config `task.overlong_buffer_tokens`: the overlong penalty is per single-turn completion"),
        (["task.sandbox.workers=0"], "config `task.sandbox.workers`: got 0; must be > 0"),
        (["task.name=math_tir", "task.dataset_path=x.jsonl", "task.sandbox.timeout_s=40"],
         "config `actor.episode.step_timeout_s`: got 30.0; a step runs the turn's scripts"),
        (["task.overlong_buffer_tokens=100"], "config `task.overlong_buffer_tokens`: got 100: the penalty zone"),
        (["lr=1"], "unknown key `lr`"),
        (["trainer.lr"], "is not of the form key=value"),
    ],
)
def test_bad_values_raise_clear_errors(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    assert expected in str(err.value)


def test_eval_sets_short_and_long_forms_round_trip(tmp_path):
    from pipelinerl.config.actor import EvalSetConfig

    cfg = load_config(TINY, ["task.eval_sets.short=data/a.jsonl", "task.eval_sets.long.path=data/b.parquet",
                             "task.eval_sets.long.samples=8", "task.eval_sets.long.temperature=1",
                             "task.eval_sets.long.max_prompts=30", "task.eval_sets.long.question_field=Problem"])
    assert cfg.task.eval_sets == {"short": EvalSetConfig(path="data/a.jsonl"),
                                  "long": EvalSetConfig("data/b.parquet", 8, 1.0, 30, "Problem", None)}
    assert isinstance(cfg.task.eval_sets["long"].temperature, float)
    save_config(cfg, tmp_path / "config.yaml")
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["task"]["eval_sets"]["short"] == {
        "path": "data/a.jsonl", "samples": 1, "temperature": 0.0, "max_prompts": None, "question_field": None,
        "answer_field": None}  # saved in the long form
    assert load_config(tmp_path / "config.yaml") == cfg
    assert load_config(TINY).task.eval_sets == {}


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["task.eval_sets.default=x.jsonl"], "`task.eval_sets.default`: `default` is the task's held-out split"),
        (["task.eval_sets.a.samples=4"], "config `task.eval_sets.a.path`: set it to the set's data file"),
        (["task.eval_sets.a.path=x", "task.eval_sets.a.samples=0"], "`task.eval_sets.a.samples`: got 0"),
        (["task.eval_sets.a.path=x", "task.eval_sets.a.samples=4"], "would all be the same: set "
                                                                     "task.eval_sets.a.temperature > 0"),
        (["task.eval_sets.a.path=x", "task.eval_sets.a.temperature=3"], "must be in [0, 2] (0 = greedy)"),
        (["task.eval_sets.a.path=x", "task.eval_sets.a.max_prompts=0"], "`task.eval_sets.a.max_prompts`: got 0"),
        (["task.eval_sets.a.path=x", "task.eval_sets.a.sampels=4"], "unknown key(s) ['sampels']; a set's keys are"),
        (["task.eval_sets.a=5"], "`task.eval_sets.a`: got 5; give a data file path or a mapping"),
    ],
)
def test_bad_eval_sets_raise_clear_errors(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    assert expected in str(err.value)


def test_an_eval_set_name_becomes_a_tensorboard_tag():
    from pipelinerl.config.actor import parse_eval_set

    with pytest.raises(ConfigError, match="`task.eval_sets.aime/24`: a set name is letters, digits"):
        parse_eval_set("aime/24", "x.jsonl")


def test_the_7b_and_32b_configs_name_aime24_and_math500_beside_their_training_data():
    """Named, not read: the files are the user's and are checked when the actor or `pipelinerl eval` starts
    (tests/test_actor.py), so these configs load here without them."""
    for name in ("qwen7b_orz.yaml", "qwen7b_orz_conventional.yaml", "qwen7b_tir.yaml", "qwen32b_orz.yaml"):
        cfg = load_config(REPO / "configs" / name)
        sets = cfg.task.eval_sets
        assert set(sets) == {"aime24", "math500"}
        assert all(Path(s.path).parent == Path(cfg.task.dataset_path).parent for s in sets.values())
        assert not Path(sets["aime24"].path).exists()
        assert sets["aime24"].samples > 1 and sets["aime24"].temperature > 0 and sets["math500"].temperature == 0
        assert set(load_config(REPO / "configs" / name, ["task.eval_sets.aime24=null"]).task.eval_sets) == {"math500"}


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


def test_config_and_cli_do_not_import_heavy_libraries():
    # `pipelinerl --help` and show-config must stay instant: no torch/vllm/deepspeed at import time.
    code = ("import sys, pipelinerl.cli, pipelinerl.config; "
            "print(sorted(m for m in ('torch', 'vllm', 'deepspeed', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _fields(schema: type, prefix: str = ""):
    """(dotted key, the field's type, field) of every field of a config section, nested sections included."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        yield prefix + f.name, hints[f.name], f
        if section_schema(f) is not None:
            yield from _fields(section_schema(f), f"{prefix}{f.name}.")


def test_every_field_is_documented_where_it_is_declared():
    keys = [key for key, _, _ in _fields(Config)]
    assert "trainer.lr" in keys and "launch.slurm.account" in keys and "model.tiny" in keys
    undocumented = [key for key, _, f in _fields(Config) if field_doc(f) is None or not field_doc(f).meaning.strip()]
    assert undocumented == []
    null_unexplained = [key for key, hint, f in _fields(Config)
                        if type(None) in typing.get_args(hint) and not field_doc(f).null]
    assert null_unexplained == [], "an optional field says what null means: doc(..., null=...)"


def test_eval_set_fields_are_documented():
    from pipelinerl.config.actor import EvalSetConfig

    hints = typing.get_type_hints(EvalSetConfig)
    for f in dataclasses.fields(EvalSetConfig):
        assert field_doc(f) is not None and field_doc(f).meaning.strip(), f.name
        assert type(None) not in typing.get_args(hints[f.name]) or field_doc(f).null, f.name


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_documented_yaml_is_the_same_data_as_the_plain_yaml(path, tmp_path):
    cfg = load_config(path, ["trainer.deepspeed_config.zero_optimization.reduce_bucket_size=5e8",
                             "inference.engine_args.enforce_eager=true"])
    documented = to_doc_yaml(cfg)
    assert yaml.safe_load(documented) == yaml.safe_load(to_yaml(cfg))
    (tmp_path / "documented.yaml").write_text(documented)
    assert load_config(tmp_path / "documented.yaml") == cfg


def test_documented_yaml_puts_unit_meaning_and_null_beside_each_field():
    lines = to_doc_yaml(load_config(TINY, ["trainer.lr=1e-6"])).splitlines()
    assert "  lr: 1.0e-06  # peak learning rate (after warm-up)" in lines
    assert "  request_timeout_s: 60.0  # [s] one completion request; on timeout it is retried on another server" \
        in lines
    assert any(line.startswith("  max_lag: 4  # [versions] ") and line.endswith("; null = no bound") for line in lines)
    assert "trainer:  # The trainer (`pipelinerl train`): its backend, batch shape, optimizer and timeouts" in lines
    assert max(map(len, lines)) <= 120


def test_list_and_dict_defaults_are_not_shared_between_instances():
    from pipelinerl.config import InferenceConfig, TrainerConfig

    a, b = TrainerConfig(), TrainerConfig()
    a.betas[0] = 0.5
    assert b.betas == [0.9, 0.999] and TrainerConfig().betas == [0.9, 0.999]
    InferenceConfig().engine_args["x"] = 1
    assert InferenceConfig().engine_args == {}

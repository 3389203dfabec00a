"""The one factory: trainer.backend picks a class that has every member of the Trainer contract."""

import pytest

from pipelinerl.config import load_config
from pipelinerl.trainer.backends import BACKENDS, build_trainer
from pipelinerl.trainer.contract import Trainer
from pipelinerl.trainer.dist import DistInfo

MAIN = DistInfo(rank=0, world_size=1, local_rank=0, backend="gloo")
CONTRACT = [name for name in vars(Trainer) if not name.startswith("_")]


@pytest.mark.parametrize("name", list(BACKENDS))
def test_every_backend_is_built_with_its_publisher_and_has_the_whole_contract(name):
    cfg = load_config(None, ["run_dir=x", "model.path=m", f"trainer.backend={name}", "rl.value_function=true",
                             "actor.sampling.temperature=0.7", "model.lm_head_fp32=true"])
    sender = object()
    trainer = build_trainer(cfg, MAIN, sender)  # construction loads nothing: `init` does
    assert trainer.publisher is sender and trainer.value_head and trainer.temperature == 0.7
    assert trainer.lm_head_fp32
    assert set(CONTRACT) >= {"device", "init", "accumulate", "optimizer_step", "publish_weights", "save_state",
                             "load_state", "save_hf"}
    missing = [m for m in CONTRACT if not hasattr(type(trainer), m)]
    assert not missing, f"{name} lacks {missing}"


def test_an_unknown_backend_is_a_clear_error():
    cfg = load_config(None, ["run_dir=x", "model.path=m"])  # the config refuses it too; the factory says why
    object.__setattr__(cfg.trainer, "backend", "fsdp9")
    with pytest.raises(ValueError, match="fsdp9.*deepspeed"):
        build_trainer(cfg, MAIN, None)


def test_auto_attention_is_sdpa_off_cuda_and_flash_attention_where_it_can_run(monkeypatch, caplog):
    """trainer.attn_implementation=auto: flash_attention_2 needs CUDA, a 16-bit model and flash-attn; each
    resolution is logged; an explicit choice is kept as it is."""
    import importlib.util
    import logging

    import torch

    from pipelinerl.trainer import model as model_mod

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    caplog.set_level(logging.INFO, logger="pipelinerl.trainer.model")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "flash_attn" else None)
    assert model_mod.attention_implementation("auto", cuda, "bfloat16") == "flash_attention_2"
    assert model_mod.attention_implementation("auto", cuda, "float32") == "sdpa"
    assert model_mod.attention_implementation("auto", cpu, "bfloat16") == "sdpa"
    assert model_mod.attention_implementation("sdpa", cuda, "bfloat16") == "sdpa"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert model_mod.attention_implementation("auto", cuda, "bfloat16") == "sdpa"
    assert "attention: flash_attention_2 (auto: flash-attn found)" in caplog.text
    assert "attention: sdpa (auto: no CUDA, a float32 model or no flash-attn)" in caplog.text

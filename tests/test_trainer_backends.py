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

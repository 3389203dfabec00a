"""The one place that picks a trainer backend: `trainer.backend` -> a class implementing contract.Trainer.

A second backend (FSDP2, TorchTitan) is one new module with a class of the contract's constructor, plus
one line in BACKENDS and its name in config/trainer.py TRAINER_BACKENDS (the config lists the names
without importing any role package). No torch import here: the config can list the names without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pipelinerl.config.trainer import TRAINER_BACKENDS

if TYPE_CHECKING:
    from pipelinerl.config import Config
    from pipelinerl.trainer.contract import Trainer, WeightPublisher
    from pipelinerl.trainer.dist import DistInfo

# name (config trainer.backend) -> "module:class", imported only when chosen (each pulls in its framework)
BACKENDS = {
    "deepspeed": "pipelinerl.trainer.deepspeed_backend:DeepSpeedTrainer",
    "fsdp2": "pipelinerl.trainer.fsdp2_backend:FSDP2Trainer",
}
assert tuple(BACKENDS) == TRAINER_BACKENDS, "a backend is named in config/trainer.py TRAINER_BACKENDS and here"


def backend_class(name: str) -> type:
    """The class of the backend called `name` (config trainer.backend), imported now."""
    if name not in BACKENDS:
        raise ValueError(f"trainer.backend={name!r} is not one of {', '.join(BACKENDS)}")
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def build_trainer(cfg: Config, dist: DistInfo, publisher: WeightPublisher | None) -> Trainer:
    """The backend named by cfg.trainer.backend, constructed (not yet initialised: call `init`)."""
    backend = backend_class(cfg.trainer.backend)
    return backend(cfg.trainer, dist, cfg.model.dtype, publisher=publisher, value_head=cfg.rl.value_function,
                   temperature=cfg.actor.sampling.temperature, lm_head_fp32=cfg.model.lm_head_fp32,
                   moe_aux_coef=cfg.rl.moe_aux_coef, routing_replay=cfg.rl.routing_replay)

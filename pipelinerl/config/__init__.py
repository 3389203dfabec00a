"""The run configuration: omegaconf structured dataclasses, one section per role.

Every field is declared with its documentation (`fields.doc`: meaning, unit, what `null` means), which
`pipelinerl show-config --doc` prints. Validation lives in each section's `__post_init__` and runs when
`load_config` turns the merged omegaconf tree into these dataclasses, so a bad value fails before any
process starts; checks that span sections and derived fields are in `root.Config`. This package must not
import torch: the CLI loads configs instantly.

    fields.py     doc(), section(), ConfigError and the check helpers
    model.py      model, model.tiny            inference.py  inference
    actor.py      actor, actor.sampling, task  trainer.py    trainer, rl, conventional
    reward.py     reward
    run_dir.py    streams, checkpoints, logging
    launch.py     launch, launch.slurm         root.py       Config (the whole run)
    load.py       YAML + overrides -> Config   dump.py       Config -> YAML (plain or documented)
"""

from pipelinerl.config.actor import ActorConfig, SamplingConfig, TaskConfig
from pipelinerl.config.dump import save_config, to_doc_yaml, to_yaml
from pipelinerl.config.fields import ConfigError, FieldDoc, doc, field_doc, section
from pipelinerl.config.inference import InferenceConfig
from pipelinerl.config.launch import LaunchConfig, SlurmConfig
from pipelinerl.config.load import load_config
from pipelinerl.config.model import ModelConfig, TinyModelConfig
from pipelinerl.config.reward import RewardConfig
from pipelinerl.config.root import Config
from pipelinerl.config.run_dir import CheckpointConfig, LoggingConfig, StreamsConfig
from pipelinerl.config.trainer import TRAINER_BACKENDS, ConventionalConfig, RLConfig, TrainerConfig

__all__ = [
    "TRAINER_BACKENDS", "ActorConfig", "CheckpointConfig", "Config", "ConfigError", "ConventionalConfig",
    "FieldDoc", "InferenceConfig", "LaunchConfig", "LoggingConfig", "ModelConfig", "RLConfig", "RewardConfig",
    "SamplingConfig", "SlurmConfig", "StreamsConfig", "TaskConfig", "TinyModelConfig", "TrainerConfig", "doc",
    "field_doc", "load_config", "save_config", "section", "to_doc_yaml", "to_yaml",
]

"""Shared fixtures. Everything runs on CPU, offline."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A freshly built (untrained) tiny model, shared by the whole session."""
    from pipelinerl.config import TinyModelConfig
    from pipelinerl.tiny_model import build_tiny_model

    out = tmp_path_factory.mktemp("models") / "tiny"
    build_tiny_model(out, TinyModelConfig(seed=0))
    return out

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


# Short `pipelinerl run`s of the untrained tiny model, shared by tests/test_conventional.py and
# tests/test_kl_analysis.py (each run starts a vLLM server and 1-3 DeepSpeed ranks: about a minute).
CONVENTIONAL = REPO / "configs" / "tiny_cpu_conventional.yaml"
S = 48  # samples per optimizer step: 6 prompts x 8 attempts, so 1, 2 or 3 ranks get whole groups


def _run_overrides(run_dir: Path, model_dir: Path, max_steps: int, port: int) -> list[str]:
    return [f"run_dir={run_dir}", f"model.path={model_dir}", "model.build_tiny_if_missing=false",
            f"trainer.max_steps={max_steps}", f"trainer.samples_per_step={S}", "trainer.warmup_steps=0",
            "trainer.lr=1e-3", "actor.sampling.max_new_tokens=24", "actor.eval_every_steps=0",
            "checkpoints.every_steps=1", "checkpoints.keep_last=100", "logging.progress_bar=false",
            f"inference.base_port={port}", f"trainer.broadcast_port={port + 50}", "inference.max_model_len=64",
            "streams.segment_max_seconds=0.3"]


def run_pipelinerl(config: Path, run_dir: Path, model_dir: Path, max_steps: int, port: int, *extra: str) -> Path:
    """`pipelinerl run` to completion; every step checkpointed (the KL analysis reads them)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "pipelinerl.cli", "run", str(config),
                          *_run_overrides(run_dir, model_dir, max_steps, port), *extra],
                         check=False, capture_output=True, text=True, timeout=600, cwd=REPO,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return run_dir


@pytest.fixture(scope="session")
def conventional_g2_run(tmp_path_factory, tiny_model_dir) -> Path:
    """Conventional RL, G = 2, on 3 trainer ranks: three batches of B = 96 samples, six optimizer steps.
    One-token completions earn no reward by construction (the addition task rewards only an answer of
    at least two digits followed by EOS), so every advantage is 0 and no step moves the weights: the KL
    analysis's zero-KL reference. An untrained model's 24-token samples did hit an answer now and then."""
    run_dir = tmp_path_factory.mktemp("conv_g2") / "run"
    return run_pipelinerl(CONVENTIONAL, run_dir, tiny_model_dir, 6, 18610, "conventional.steps_per_batch=2",
                          "trainer.num_gpus=3", "actor.sampling.max_new_tokens=1")


@pytest.fixture(scope="session")
def pipeline_lag0_run(tmp_path_factory, tiny_model_dir) -> Path:
    """Pipeline mode with max_lag = 0 (synchronous on-policy) on 2 trainer ranks, four optimizer steps."""
    run_dir = tmp_path_factory.mktemp("pipe_lag0") / "run"
    return run_pipelinerl(REPO / "configs" / "tiny_cpu.yaml", run_dir, tiny_model_dir, 4, 18620, "actor.max_lag=0",
                          "trainer.num_gpus=2")


# Fixtures of the inference-server tests (tests/test_inference_*.py): each module defines its own
# module-scoped `server` fixture ({"url", "run_dir", "token", "model"}); these resolve against it.
GROUP_PORTS = iter(range(18260, 18290))  # one weight-update group port per connection
GROUP_TIMEOUT_S = 6.0


@pytest.fixture(scope="module")
def models(server):
    """Weight sets A (the served checkpoint), B and C (A perturbed with different seeds), and the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = {"tok": AutoTokenizer.from_pretrained(server["model"])}
    for key, seed in (("A", None), ("B", 1), ("C", 2)):
        m = AutoModelForCausalLM.from_pretrained(server["model"], dtype=torch.float32).eval()
        if seed is not None:
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.5)
        out[key] = m
    return out


@pytest.fixture(scope="module")
def broadcaster(server):
    b = connect_broadcaster(server)
    yield b
    b.close()


def connect_broadcaster(server, delta: bool = False):
    """A gloo weight-update group with the one test server, every update checksummed; `delta`: in delta
    mode (weights/delta.py), which encodes every tensor before it sends."""
    from pipelinerl.weights import WeightBroadcaster

    b = WeightBroadcaster([server["url"]], "gloo", "127.0.0.1", next(GROUP_PORTS), GROUP_TIMEOUT_S,
                          bucket_bytes=1 << 16, token=server["token"], checksum_every=1, delta=delta)
    b.connect()
    return b

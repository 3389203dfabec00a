"""Shared fixtures. Everything runs on CPU, offline."""

import os
import sys
from pathlib import Path

import pytest
from helpers import WORKER, worker_port

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# vLLM 0.32's AOT compile cache never loads on CPU ("'function' object has no attribute 'finalize_loading'"),
# so by default every server start compiles its model afresh (~13 s of CPU on an idle machine). Without
# AOT, vLLM compiles the same graph with the same inductor backend, and torch's own compile cache serves
# every start after the first (~4 s). Inherited by every server the tests start (`serve`, `run`, Slurm).
os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")

REPO = Path(__file__).resolve().parent.parent
# Assigned, not defaulted: xdist workers inherit the controller's environment, where WORKER is 0.
os.environ["PIPELINERL_MASTER_PORT_BASE"] = str(29400 + 500 * WORKER)  # trainer ranks' ports (helpers.py)

# Parallel workers (`make test`: pytest-xdist, --dist loadscope): each module runs whole on one worker, and
# modules sharing a session fixture run together on one (their runs and servers are made once). The slowest
# groups are handed out first so that no worker is left with a long one at the end. (xdist's own
# `loadgroup` marks do nothing under pytest 9, whose node ids no longer take xdist's suffix.)
SHARED = {"test_conventional": "conventional_runs", "test_kl_analysis": "conventional_runs",
          "test_e2e_rl_options": "conventional_runs", "test_inference_recompute": "recompute_server",
          "test_sampling_logprobs": "recompute_server"}
SLOWEST_FIRST = ["test_slurm", "conventional_runs", "test_chaos", "test_chaos_episodes", "test_delivery_trap",
                 "test_trainer_loop", "test_e2e_local", "test_reward_model", "recompute_server",
                 "test_inference_server", "test_actor", "test_launch_health", "test_reference",
                 "test_trainer_deepspeed", "test_eval", "test_trainer_critic"]


def _group(nodeid: str) -> str:
    module = Path(nodeid.split("::")[0]).stem
    return SHARED.get(module, module)


def pytest_collection_modifyitems(config, items):
    rank = {g: i for i, g in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(_group(item.nodeid), len(rank)))  # stable: file order within a group


def pytest_xdist_make_scheduler(config, log):
    """With --dist loadscope, a work unit is a module group (_group) instead of a module."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return ModuleGroups(config, log)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A freshly built (untrained) tiny model, shared by the whole session."""
    from pipelinerl.config import TinyModelConfig
    from pipelinerl.tiny.model import build_tiny_model

    out = tmp_path_factory.mktemp("models") / "tiny"
    build_tiny_model(out, TinyModelConfig(seed=0))
    return out


@pytest.fixture(scope="session")
def moe_model_dir(tmp_path_factory) -> Path:
    """A freshly built tiny Qwen3-MoE model (8 experts, top-2), its routers far from uniform (weights of std 0.5,
    not the initial 0.02): routing decided by the weights rather than by near-ties that float rounding flips."""
    import torch

    from pipelinerl.config import TinyModelConfig
    from pipelinerl.tiny.model import build_tiny_model, save_model

    out = tmp_path_factory.mktemp("models") / "moe"
    model, tokenizer = build_tiny_model(out, TinyModelConfig(seed=0, num_experts=8))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5, generator=g)
    save_model(model, tokenizer, out)
    return out


# Short `pipelinerl run`s, each shared by two modules (tests/test_conventional.py with tests/test_kl_analysis.py
# or tests/test_e2e_rl_options.py): each run starts a vLLM server (two with a reference model) and 1-3
# DeepSpeed ranks, about a minute of start-up for a few seconds of training.
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
    return run_pipelinerl(CONVENTIONAL, run_dir, tiny_model_dir, 6, worker_port(18610),
                          "conventional.steps_per_batch=2",
                          "trainer.num_gpus=3", "actor.sampling.max_new_tokens=1")


@pytest.fixture(scope="session")
def warm_model_dir(tmp_path_factory) -> Path:
    """The tiny model briefly warm-started (held-out greedy >= 0.2): some samples earn a reward."""
    from pipelinerl.config import TaskConfig, TinyModelConfig
    from pipelinerl.tiny.warm_start import build_warm_tiny_model

    out = tmp_path_factory.mktemp("models") / "warm"
    result = build_warm_tiny_model(out, TinyModelConfig(seed=0, warm_start_target=0.2), TaskConfig(name="addition"))
    assert result["heldout_greedy"] >= 0.2
    return out


@pytest.fixture(scope="session")
def tools_model_dir(tmp_path_factory) -> Path:
    """The tiny model after 56 supervised steps on tool_sums' demonstrated episodes: it calls the calculator and
    copies its answer part of the time (held-out greedy success jumps: 0 at step 40, 0.44 at 52, 0.94 at 60),
    so that groups of differing rewards are common. Checked here: a model that solves none or all would stall a
    run with dynamic sampling behind a stream of filtered groups."""
    from pipelinerl.config import TaskConfig, TinyModelConfig
    from pipelinerl.tiny.warm_start import build_warm_tiny_model

    out = tmp_path_factory.mktemp("models") / "tools"
    shape = TinyModelConfig(seed=0, warm_start_steps=56, warm_start_target=1.0, warm_start_check_every=56)
    built = build_warm_tiny_model(out, shape, TaskConfig(name="tool_sums"))
    assert 0.05 <= built["heldout_greedy"] <= 0.99, built
    print(f"warm start: {built}")
    return out


@pytest.fixture(scope="session")
def conventional_g1_kl_value_run(tmp_path_factory, warm_model_dir) -> Path:
    """Conventional RL, G = 1, on 1 trainer rank, four optimizer steps of GRPO with a KL to the frozen
    reference model and a critic head, from the warm model. One run for two modules' assertions that do
    not depend on each other's options: tests/test_conventional.py's (G = 1 trains on-policy: every token
    at lag 0, the weights synced after every step) and tests/test_e2e_rl_options.py's (the reference
    log-probs, KL and value losses)."""
    run_dir = tmp_path_factory.mktemp("conv_g1_kl_value") / "run"
    return run_pipelinerl(CONVENTIONAL, run_dir, warm_model_dir, 4, worker_port(18960),
                          "conventional.steps_per_batch=1",
                          "rl.kl_coef=0.05", "rl.value_function=true",
                          "trainer.lr=1e-4")  # the tiny config's lr: the tests' 1e-3 wrecks a warm model


@pytest.fixture(scope="session")
def pipeline_lag0_run(tmp_path_factory, tiny_model_dir) -> Path:
    """Pipeline mode with max_lag = 0 (synchronous on-policy) on 2 trainer ranks, four optimizer steps."""
    run_dir = tmp_path_factory.mktemp("pipe_lag0") / "run"
    return run_pipelinerl(REPO / "configs" / "tiny_cpu.yaml", run_dir, tiny_model_dir, 4, worker_port(18620),
                          "actor.max_lag=0",
                          "trainer.num_gpus=2")


class SharedServer:
    """A `serve` generator (tests/test_inference_server.py) run by hand, so that the last module using it
    can stop it (and check its clean exit) instead of leaving it idle until the session ends; a module
    that comes after that (another test order) starts it again."""

    def __init__(self, start):
        self._start, self._serving, self._info = start, None, None

    @property
    def info(self) -> dict:  # {"url", "run_dir", "token", "model"}
        if self._serving is None:
            self._serving = self._start()
            self._info = next(self._serving)
        return self._info

    def close(self) -> None:
        serving, self._serving = self._serving, None
        if serving is not None:
            next(serving, None)  # stops the server, then asserts it removed its discovery file


@pytest.fixture(scope="session")
def recompute_server(tiny_model_dir, tmp_path_factory):
    """One vLLM-CPU server of the untrained tiny model with inference.kv_on_update=recompute, for
    tests/test_inference_recompute.py and then tests/test_sampling_logprobs.py (which loads its own
    weights into it by an update and stops it): one server start instead of two."""
    from test_inference_server import serve

    server = SharedServer(lambda: serve(tiny_model_dir, tmp_path_factory.mktemp("recompute_run"), worker_port(18212),
                                        "inference.kv_on_update=recompute"))
    yield server
    server.close()


# Fixtures of the inference-server tests (tests/test_inference_*.py): each module defines its own
# module-scoped `server` fixture ({"url", "run_dir", "token", "model"}); these resolve against it.
GROUP_PORTS = iter(range(worker_port(18260), worker_port(18290)))  # one weight-update group port per connection
# A group's timeout bounds every wait of both sides of an update; the straddle tests hold the engine at its gate
# while an update is sent, so it is generous (a loaded machine must never trip it). The stalled-update test waits
# for one to expire and forms a group of its own with STALL_TIMEOUT_S.
GROUP_TIMEOUT_S = 60.0
STALL_TIMEOUT_S = 6.0


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


def connect_broadcaster(server, delta: bool = False, timeout_s: float = GROUP_TIMEOUT_S):
    """A gloo weight-update group with the one test server, every update checksummed; `delta`: in delta
    mode (weights/delta.py), which encodes every tensor before it sends."""
    from pipelinerl.weights import WeightBroadcaster

    b = WeightBroadcaster([server["url"]], "gloo", "127.0.0.1", next(GROUP_PORTS), timeout_s,
                          bucket_bytes=1 << 16, token=server["token"], checksum_every=1, delta=delta)
    b.connect()
    return b

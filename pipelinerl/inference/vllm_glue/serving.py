"""API-server side: vLLM's command line and its launcher internals.

`open_server` does what `vllm serve` does (bind, engine client, app, OpenAI serving state), except that
the caller adds its routes before serving and a policy server's responses carry `policy_versions`
(versions.py). Importing this module does not import vLLM: the launchers and tests read `vllm_argv`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipelinerl.config import Config, ConfigError
from pipelinerl.inference.vllm_glue import ENGINE_NAME, WORKER_EXTENSION
from pipelinerl.inference.vllm_glue.routing import ENV as ROUTING_ENV
from pipelinerl.inference.vllm_glue.spin import SPIN_ENV
from pipelinerl.rundir import POLICY_KINDS

if TYPE_CHECKING:
    from fastapi import FastAPI

    from pipelinerl.inference.vllm_glue.control import VllmEngine

# Engine arguments the servers set themselves (server.py's docstring says why); engine_args may not
# override them. Reference and reward servers skip logprobs_mode: vLLM never processes prompt log-probs, the
# only ones a reference server returns, and a reward server returns none.
OWN_ENGINE_ARGS = {"generation_config": "vllm", "logprobs_mode": "processed_logprobs"}
# Requests carry a priority (evaluation: actor.eval_priority, training 0), which vLLM refuses (HTTP 400) unless the
# engine schedules by priority; with every priority equal it is first come, first served.
SCHEDULING_POLICY = "priority"
VLLM_MAX_LOGPROBS = 20  # vLLM's default --max-logprobs: the most (prompt) log-probs a request may ask for


def vllm_argv(cfg: Config, host: str, port: int, kind: str = "policy") -> list[str]:
    """The engine's vLLM command line, from the config (engine_args pass through as --flags); `kind` is the
    server's: policy, eval (the policy's command line exactly), reference (rl.teacher when set, else model.path)
    or reward.

    A reference server scores prompt + completion as one prompt, and vLLM refuses a prompt that leaves
    no room for the one token it must generate: a completion that filled max_model_len could not be
    scored. So it runs with max_model_len + 1, which needs max_model_len set (and within the model's
    positions; vLLM says so at start-up if not). A reward server serves reward.model_path: a reward model on
    vLLM's pooling runner (`POST /classify`: sigmoid of the classifier's logit; it generates nothing, so
    max_model_len is enough room), or a judge for generation, up to its own context length."""
    inf = cfg.inference
    model = {"reward": cfg.reward.model_path, "reference": cfg.rl.teacher or cfg.model.path}.get(kind, cfg.model.path)
    argv = ["--model", model, "--host", host, "--port", str(port), "--dtype", cfg.model.dtype,
            "--tensor-parallel-size", str(inf.tensor_parallel_size), "--max-num-seqs", str(inf.max_num_seqs),
            "--gpu-memory-utilization", str(inf.gpu_memory_utilization),
            "--enable-prefix-caching" if inf.enable_prefix_caching else "--no-enable-prefix-caching"]
    for key, value in OWN_ENGINE_ARGS.items():
        if key in inf.engine_args:
            raise ConfigError(f"config `inference.engine_args.{key}`: the servers set it to {value!r} (behaviour "
                              "log-probs must be those of the distribution sampled); remove it")
        if kind in POLICY_KINDS or key != "logprobs_mode":
            argv += ["--" + key.replace("_", "-"), value]
    policy = inf.engine_args.get("scheduling_policy", SCHEDULING_POLICY)
    if policy != SCHEDULING_POLICY:
        raise ConfigError(f"config `inference.engine_args.scheduling_policy`: got {policy!r}; the servers schedule by "
                          "request priority (evaluation requests at actor.eval_priority yield to training ones; "
                          "actor.eval_priority=0 makes it first come, first served): remove it")
    argv += ["--scheduling-policy", SCHEDULING_POLICY]
    if kind == "reference":
        if inf.max_model_len is None:
            raise ConfigError("config `inference.max_model_len`: a reference server needs it set (it runs with "
                              "max_model_len + 1 to score completions that fill max_model_len); set it at "
                              "least one below the model's max_position_embeddings")
        argv += ["--max-model-len", str(inf.max_model_len + 1)]
        if cfg.rl.teacher_top_k > VLLM_MAX_LOGPROBS:  # the teacher's top-k come back as prompt log-probs
            argv += ["--max-logprobs", str(cfg.rl.teacher_top_k)]
    elif kind == "reward":
        argv += ["--runner", "pooling"] if cfg.reward.kind == "model" else []  # a judge generates
    else:  # policy and eval servers: weight updates
        argv += ["--weight-transfer-config", json.dumps({"backend": ENGINE_NAME}),
                 "--worker-extension-cls", WORKER_EXTENSION]
    # a judge reads the rubric around prompt + completion, longer than max_model_len: its model's own limit
    judge = kind == "reward" and cfg.reward.kind == "judge"
    if kind != "reference" and not judge and inf.max_model_len is not None:
        argv += ["--max-model-len", str(inf.max_model_len)]
    for key, value in _engine_args(cfg).items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return argv


def _engine_args(cfg: Config) -> dict:
    """inference.engine_args, plus hf_overrides.head_dtype=float32 with model.lm_head_fp32: vLLM then
    computes the logits in float32 from the live weights (LogitsProcessor casts hidden states and weight at
    each call, so a weight update leaves no stale copy), as the trainer's LogprobHead does."""
    args = dict(cfg.inference.engine_args)
    if not cfg.model.lm_head_fp32:
        return args
    overrides = dict(args.get("hf_overrides") or {})
    if overrides.get("head_dtype", "float32") != "float32":
        raise ConfigError(f"config `inference.engine_args.hf_overrides.head_dtype`: model.lm_head_fp32 sets it "
                          f"to 'float32', got {overrides['head_dtype']!r}; remove it or set model.lm_head_fp32=false")
    args["hf_overrides"] = {**overrides, "head_dtype": "float32"}
    return args


def parse_vllm_args(argv: list[str]):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser(prog="pipelinerl serve")).parse_args(argv)
    validate_parsed_serve_args(args)
    return args


def setup_process(cpu_kv_cache_gb: float | None, engine_spin_s: float | None, tensor_parallel_size: int,
                  routed_experts: bool = False) -> None:
    """vLLM's CLI set-up (spawn for worker processes), the CPU KV-cache size, the engine's spin
    (inference.engine_spin_s: PipelineRL's plugin applies it in the engine core and worker processes, spin.py)
    and the capture of routed experts (inference.return_routed_experts: routing.py, also by the plugin), before
    the engine starts.

    On CPU with one tensor-parallel rank the model runs in the engine core process (vLLM's "uni" executor), as
    it does on a GPU: vLLM's CPU platform otherwise starts a worker process of its own (for the OpenMP thread
    binding, which the launcher does here: CPU affinity, OMP_NUM_THREADS, VLLM_CPU_OMP_THREADS_BIND=nobind) and
    hands it every step through a shared-memory queue. Measured on the tiny run: the server is healthy ~10 s
    sooner (one process less to spawn, and import vLLM in) and the run trains ~24 % more samples per second.
    VLLM_ENABLE_V1_MULTIPROCESSING=0 does it; it changes nothing else for a server (vLLM's API server always
    runs its engine core in a process of its own). Set VLLM_ENABLE_V1_MULTIPROCESSING=1 to keep the worker.
    Also on CPU, VLLM_USE_AOT_COMPILE=0: vLLM 0.32 saves the CPU model's ahead-of-time compiled artefact but cannot
    load it back ("'function' object has no attribute 'finalize_loading'"), so every start compiled the model
    anew (~7 s on the tiny model); without AOT, torch.compile's own caches serve a restart (~4 s).

    vLLM's SageMaker routes import `model_hosting_container_standards`, which at import sets the root
    logger and its handlers to SAGEMAKER_CONTAINER_LOG_LEVEL (default ERROR): every `pipelinerl` line of
    the server would vanish. It is imported here and the root logger's level is put back (its own logger
    keeps ERROR: its start-up lines are noise here)."""
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    cli_env_setup()
    root = logging.getLogger()
    level, handler_levels = root.level, [h.level for h in root.handlers]
    try:
        import model_hosting_container_standards.logging_config  # noqa: F401  (a vLLM dependency)
    except ImportError:
        pass
    root.setLevel(level)
    for handler, handler_level in zip(root.handlers, handler_levels):
        handler.setLevel(handler_level)
    if cpu_kv_cache_gb is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(cpu_kv_cache_gb))
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
        if tensor_parallel_size == 1:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if engine_spin_s is None:
        engine_spin_s = 0.0 if current_platform.is_cpu() else None
    if engine_spin_s is not None:
        os.environ[SPIN_ENV] = repr(float(engine_spin_s))
    if routed_experts:
        os.environ[ROUTING_ENV] = "1"


@dataclass
class Server:
    """What `open_server` yields: add routes to `app`, drive updates through `engine`, then `serve()`."""

    app: FastAPI
    engine: VllmEngine  # an `UpdatableEngine` (pipelinerl/inference/updates.py)
    serve: Callable[[], Awaitable[None]]  # uvicorn until SIGINT/SIGTERM


@asynccontextmanager
async def open_server(args, policy_versions: bool) -> AsyncIterator[Server]:
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server

    from pipelinerl.inference.vllm_glue.control import VllmEngine
    from pipelinerl.inference.vllm_glue.versions import add_versions

    _, sock = setup_server(args, reuse_port=False)
    try:
        async with build_async_engine_client(args) as client:
            tasks = await client.get_supported_tasks()
            app = build_app(args, tasks, client.model_config)
            await init_app_state(client, app.state, args, tasks)
            if policy_versions:
                add_versions(app.state)

            async def serve() -> None:
                await serve_http(app, sock=sock, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                 access_log=not args.disable_uvicorn_access_log)

            yield Server(app, VllmEngine(client), serve)
    finally:
        sock.close()

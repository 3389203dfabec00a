"""`pipelinerl serve`: vLLM's OpenAI-compatible server on its async engine, plus the weight-update routes.

vLLM builds the app, the engine and the OpenAI routes (`/v1/chat/completions`, `/v1/completions`,
`/v1/models`, `/health`, `/metrics`, which also carries the `pipelinerl_*` update metrics); this
module adds:

    POST /init_process_group      (bearer token)  join the trainer's weight-update group
    POST /request_weight_update   (bearer token)  pause, receive, load, set version, resume
    GET  /status                                  version, ranks, update counters (read-only)

vLLM's dev-mode routes are not mounted: they expose every control operation without authentication.

A policy server reports the log-probs of the distribution it sampled from (`--logprobs-mode
processed_logprobs`: after temperature, and after any min_tokens suppression of EOS), which is what the
trainer scores against (`DeepSpeedTrainer(temperature=...)`); vLLM's default, the raw model log-probs,
would make importance ratios wrong at any temperature != 1. Every server also ignores the model folder's
generation_config.json (`--generation-config vllm`): its top_k / top_p / repetition_penalty defaults would
otherwise apply to every request field the actor leaves unset, silently changing the sampled distribution.

`serve --reference` runs a *reference server*: the same OpenAI server on the run's initial model
(`model.path`), frozen. It announces itself in RUN_DIR/reference_servers/, so the trainer never
broadcasts to it and the actor asks it only for reference log-probs (`prompt_logprobs`); its
weight-update routes answer 403, and it has no weight-transfer engine and no `policy_versions`.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse

from pipelinerl.config import Config, ConfigError
from pipelinerl.inference import rundir
from pipelinerl.inference.updates import UpdateError, WeightUpdater

WORKER_EXTENSION = "pipelinerl.inference.engine.WorkerExtension"


def check_model(model_dir: str) -> dict[str, list[int]]:
    """Refuse models whose updates would be silently wrong; return the HF tensor names and shapes."""
    from safetensors import safe_open
    from transformers import AutoConfig

    if AutoConfig.from_pretrained(model_dir).tie_word_embeddings:
        raise ValueError(f"{model_dir} ties its input and output embeddings: vLLM's weight reload leaves "
                         "the tied lm_head on the old weights, so updates would be silently wrong. "
                         "Save the model untied (tie_word_embeddings=false) to serve it here.")
    expected: dict[str, list[int]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as st:
            for name in st.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                expected[name] = list(st.get_slice(name).get_shape())
    if not expected:
        raise ValueError(f"{model_dir} has no *.safetensors weights (save with safe_serialization=True)")
    return expected


# Engine arguments the servers set themselves (module docstring); engine_args may not override them.
# Reference servers skip logprobs_mode: vLLM never processes prompt log-probs, the only ones they return.
OWN_ENGINE_ARGS = {"generation_config": "vllm", "logprobs_mode": "processed_logprobs"}


def vllm_argv(cfg: Config, host: str, port: int, reference: bool = False) -> list[str]:
    """The engine's vLLM command line, from the config (engine_args pass through as --flags).

    A reference server scores prompt + completion as one prompt, and vLLM refuses a prompt that leaves
    no room for the one token it must generate: a completion that filled max_model_len could not be
    scored. So it runs with max_model_len + 1, which needs max_model_len set (and within the model's
    positions; vLLM says so at start-up if not)."""
    inf = cfg.inference
    argv = ["--model", cfg.model.path, "--host", host, "--port", str(port), "--dtype", cfg.model.dtype,
            "--tensor-parallel-size", str(inf.tensor_parallel_size), "--max-num-seqs", str(inf.max_num_seqs),
            "--gpu-memory-utilization", str(inf.gpu_memory_utilization),
            "--enable-prefix-caching" if inf.enable_prefix_caching else "--no-enable-prefix-caching"]
    for key, value in OWN_ENGINE_ARGS.items():
        if key in inf.engine_args:
            raise ConfigError(f"config `inference.engine_args.{key}`: the servers set it to {value!r} (behaviour "
                              "log-probs must be those of the distribution sampled); remove it")
        if not (reference and key == "logprobs_mode"):
            argv += ["--" + key.replace("_", "-"), value]
    if reference:
        if inf.max_model_len is None:
            raise ConfigError("config `inference.max_model_len`: a reference server needs it set (it runs with "
                              "max_model_len + 1 to score completions that fill max_model_len); set it at "
                              "least one below the model's max_position_embeddings")
        argv += ["--max-model-len", str(inf.max_model_len + 1)]
    else:
        from pipelinerl.inference.engine import ENGINE_NAME

        argv += ["--weight-transfer-config", json.dumps({"backend": ENGINE_NAME}),
                 "--worker-extension-cls", WORKER_EXTENSION]
        if inf.max_model_len is not None:
            argv += ["--max-model-len", str(inf.max_model_len)]
    for key, value in inf.engine_args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return argv


def parse_vllm_args(argv: list[str]):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser(prog="pipelinerl serve")).parse_args(argv)
    validate_parsed_serve_args(args)
    return args


def bearer_auth(token: str):
    """A FastAPI dependency: 401 unless `Authorization: Bearer <token>` (constant-time compare)."""

    def check(request: Request) -> None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), token.encode()):
            raise HTTPException(401, "missing or wrong bearer token (see RUN_DIR/auth_token)",
                                headers={"WWW-Authenticate": "Bearer"})

    return check


async def _json_body(request: Request) -> object:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise HTTPException(400, f"malformed JSON body: {err}") from None


async def _answer(call) -> JSONResponse:
    try:
        return JSONResponse(await call)
    except UpdateError as err:
        return JSONResponse({"error": str(err)}, status_code=err.status)


def control_router(updater: WeightUpdater, token: str) -> APIRouter:
    router = APIRouter()
    auth = [Depends(bearer_auth(token))]

    @router.post("/init_process_group", dependencies=auth)
    async def init_process_group(request: Request) -> JSONResponse:
        return await _answer(updater.init_group(await _json_body(request)))

    @router.post("/request_weight_update", dependencies=auth)
    async def request_weight_update(request: Request) -> JSONResponse:
        return await _answer(updater.update(await _json_body(request)))

    @router.get("/status")
    async def status() -> JSONResponse:
        return JSONResponse(updater.status())

    return router


def reference_router() -> APIRouter:
    """A reference server's answer to the weight-update routes: a clear 403, not a silent 404."""
    router = APIRouter()

    async def refuse() -> JSONResponse:
        return JSONResponse({"error": "a reference server never takes weight updates (it serves the run's "
                                      "initial model; broadcast to the servers in RUN_DIR/servers/)"},
                            status_code=403)

    for path in ("/init_process_group", "/request_weight_update"):
        router.add_api_route(path, refuse, methods=["POST"])
    return router


def advertised_host(bind_host: str) -> str:
    return socket.gethostname() if bind_host in ("", "0.0.0.0", "::") else bind_host


async def announce_when_healthy(run_dir: str, bind_host: str, port: int, folder: str, published: list[Path]) -> None:
    """Publish RUN_DIR/<folder>/<host>_<port> once our own /health answers 200."""
    import aiohttp

    local = "127.0.0.1" if bind_host in ("", "0.0.0.0", "::") else bind_host
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(f"http://{local}:{port}/health") as resp:
                    if resp.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    published.append(rundir.publish_server(run_dir, advertised_host(bind_host), port, folder))


@dataclass
class Updates:
    """What a policy server needs for weight updates; a reference server has none."""

    expected: dict[str, list[int]]  # HF tensor name -> shape (check_model)
    token: str  # bearer token of the control routes
    version: int  # policy version of the weights it starts with


async def run(cfg: Config, args, updates: Updates | None) -> None:
    """Serve until SIGINT/SIGTERM: a policy server with `updates`, a reference server without."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server

    from pipelinerl.inference.versions import add_versions

    _, sock = setup_server(args, reuse_port=False)
    published: list[Path] = []
    try:
        async with build_async_engine_client(args) as engine:
            tasks = await engine.get_supported_tasks()
            app = build_app(args, tasks, engine.model_config)
            if updates is None:
                app.include_router(reference_router())
            else:
                num_ranks = engine.vllm_config.parallel_config.world_size
                updater = WeightUpdater(engine, updates.expected, cfg.model.dtype, cfg.inference.kv_on_update,
                                        num_ranks, updates.version)
                app.include_router(control_router(updater, updates.token))
            await init_app_state(engine, app.state, args, tasks)
            if updates is not None:
                add_versions(app.state)
                await updater.start()
            folder = rundir.SERVERS_DIR if updates is not None else rundir.REFERENCE_SERVERS_DIR
            announce = asyncio.create_task(announce_when_healthy(cfg.run_dir, args.host, args.port, folder,
                                                                 published))
            await serve_http(app, sock=sock, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                             access_log=not args.disable_uvicorn_access_log)
            announce.cancel()
    finally:
        for path in published:
            path.unlink(missing_ok=True)
        sock.close()


def serve(cfg: Config, port: int, version: int, reference: bool = False) -> None:
    """Entry point of `pipelinerl serve` (blocks until SIGINT/SIGTERM); `reference`: a frozen reference
    server of `cfg.model.path` (no updates, so neither the token nor the untied-model check applies)."""
    argv = vllm_argv(cfg, cfg.inference.host, port, reference)  # config errors before the heavy imports
    updates = None
    if not reference:
        updates = Updates(check_model(cfg.model.path), rundir.run_token(cfg.run_dir, cfg.inference.auth_token),
                          version)

    import uvloop
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    cli_env_setup()  # vLLM's CLI setup: spawn for worker processes
    if cfg.inference.cpu_kv_cache_gb is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(cfg.inference.cpu_kv_cache_gb))
    uvloop.run(run(cfg, parse_vllm_args(argv), updates))

"""`pipelinerl serve`: vLLM's OpenAI-compatible server on its async engine, plus the weight-update routes.

vLLM builds the app, the engine and the OpenAI routes (`/v1/chat/completions`, `/v1/completions`,
`/v1/models`, `/health`, `/metrics`, which also carries the `pipelinerl_*` update metrics); this
module adds:

    POST /init_process_group      (bearer token)  join the trainer's weight-update group
    POST /request_weight_update   (bearer token)  pause, receive, load, set version, resume
    GET  /status                                  version, ranks, update counters (read-only)

vLLM's dev-mode routes are not mounted: they expose every control operation without authentication.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
from pathlib import Path

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse

from pipelinerl.config import Config
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
            for name in st.keys():
                expected[name] = list(st.get_slice(name).get_shape())
    if not expected:
        raise ValueError(f"{model_dir} has no *.safetensors weights (save with safe_serialization=True)")
    return expected


def vllm_argv(cfg: Config, host: str, port: int) -> list[str]:
    """The engine's vLLM command line, from the config (engine_args pass through as --flags)."""
    from pipelinerl.inference.engine import ENGINE_NAME

    inf = cfg.inference
    argv = ["--model", cfg.model.path, "--host", host, "--port", str(port), "--dtype", cfg.model.dtype,
            "--tensor-parallel-size", str(inf.tensor_parallel_size), "--max-num-seqs", str(inf.max_num_seqs),
            "--gpu-memory-utilization", str(inf.gpu_memory_utilization),
            "--weight-transfer-config", json.dumps({"backend": ENGINE_NAME}),
            "--worker-extension-cls", WORKER_EXTENSION,
            "--enable-prefix-caching" if inf.enable_prefix_caching else "--no-enable-prefix-caching"]
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


def advertised_host(bind_host: str) -> str:
    return socket.gethostname() if bind_host in ("", "0.0.0.0", "::") else bind_host


async def announce_when_healthy(run_dir: str, bind_host: str, port: int, published: list[Path]) -> None:
    """Publish RUN_DIR/servers/<host>_<port> once our own /health answers 200."""
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
    published.append(rundir.publish_server(run_dir, advertised_host(bind_host), port))


async def run(cfg: Config, args, expected: dict[str, list[int]], token: str, version: int) -> None:
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
            num_ranks = engine.vllm_config.parallel_config.world_size
            updater = WeightUpdater(engine, expected, cfg.model.dtype, cfg.inference.kv_on_update,
                                    num_ranks, version)
            app.include_router(control_router(updater, token))
            await init_app_state(engine, app.state, args, tasks)
            add_versions(app.state)
            await updater.start()
            announce = asyncio.create_task(announce_when_healthy(cfg.run_dir, args.host, args.port, published))
            await serve_http(app, sock=sock, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                             access_log=not args.disable_uvicorn_access_log)
            announce.cancel()
    finally:
        for path in published:
            path.unlink(missing_ok=True)
        sock.close()


def serve(cfg: Config, port: int, version: int) -> None:
    """Entry point of `pipelinerl serve` (blocks until SIGINT/SIGTERM)."""
    import uvloop
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    cli_env_setup()  # vLLM's CLI setup: spawn for worker processes
    token = rundir.run_token(cfg.run_dir, cfg.inference.auth_token)
    expected = check_model(cfg.model.path)
    if cfg.inference.cpu_kv_cache_gb is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(cfg.inference.cpu_kv_cache_gb))
    args = parse_vllm_args(vllm_argv(cfg, cfg.inference.host, port))
    uvloop.run(run(cfg, args, expected, token, version))

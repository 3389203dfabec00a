"""`pipelinerl serve`: vLLM's OpenAI-compatible server on its async engine, plus the weight-update routes.

vLLM builds the app, the engine and the OpenAI routes (`/v1/chat/completions`, `/v1/completions`,
`/v1/models`, `/health`, `/metrics`, which also carries the `pipelinerl_*` update metrics); this
module adds:

    POST /init_process_group      (bearer token)  join the trainer's weight-update group
    POST /request_weight_update   (bearer token)  pause, receive, load, set version, resume
    POST /hold                    (bearer token)  {"seconds": s}: updates answer 423 for s seconds (evaluation),
                                                  s at most inference.max_hold_s
    POST /release                 (bearer token)  end the hold early
    GET  /status                                  version, ranks, update counters, the run's public id
                                                  (rundir.run_fingerprint; read-only)

Every body is read through `read_json_body`: at most the route's byte cap (413 past it, before reading on when
the Content-Length says so), a JSON object of finite numbers nested at most MAX_DEPTH deep (400 otherwise). A
refusal is an ordinary reply, so the keep-alive connection serves the next request.

vLLM's dev-mode routes are not mounted: they expose every control operation without authentication.

A policy server reports the log-probs of the distribution it sampled from (`--logprobs-mode
processed_logprobs`: after temperature, and after any min_tokens suppression of EOS), which is what the
trainer scores against (`DeepSpeedTrainer(temperature=...)`); vLLM's default, the raw model log-probs,
would make importance ratios wrong at any temperature != 1. Every server also ignores the model folder's
generation_config.json (`--generation-config vllm`): its top_k / top_p / repetition_penalty defaults would
otherwise apply to every request field the actor leaves unset, silently changing the sampled distribution.

`serve --reference` runs a *reference server*: the same OpenAI server on the run's initial model
(`model.path`; with on-policy distillation, the teacher `rl.teacher`), frozen. It announces itself in
RUN_DIR/reference_servers/, so the trainer never broadcasts to it and the actor asks it only for reference
log-probs (`prompt_logprobs`); its weight-update routes answer 403, and it has no weight-transfer engine
and no `policy_versions`.

`serve --reward` runs a *reward server*: reward.model_path (a one-logit sequence classifier) on vLLM's
pooling runner, whose `POST /classify` the actor asks for the score of each prompt + completion text
(reward.kind=model). It announces itself in RUN_DIR/reward_servers/ and refuses weight updates alike.

`serve --eval` runs an *eval server* (inference.eval_servers): a policy server in every respect (weight
updates, `policy_versions`, the same vLLM command line) that only evaluates. It announces itself in
RUN_DIR/eval_servers/, so the actor's training requests never reach it and the trainer delivers its weights
over a weight-update group of its own.

Everything that touches vLLM itself (command line, launcher, engine calls) is in `vllm_glue/`; this
module and `updates.py` only see `vllm_glue.serving.open_server` and the `UpdatableEngine` steps.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import secrets
import signal
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse

from pipelinerl import rundir
from pipelinerl.announce import announce_when_healthy, stop_if_unannounced
from pipelinerl.config import Config
from pipelinerl.inference.updates import UpdateError, WeightUpdater
from pipelinerl.inference.vllm_glue.serving import vllm_argv

log = logging.getLogger(__name__)


def check_model(model_dir: str) -> dict[str, list[int]]:
    """Refuse models whose updates would be silently wrong; return the names and shapes of the tensors an update
    carries: the trainer's, i.e. those of transformers' model in memory (built on the meta device, no weights
    read). They can differ from the checkpoint's: transformers keeps a mixture of experts' per-expert
    checkpoint tensors fused in memory (`mlp.experts.gate_up_proj` [E, 2 x I, H] and `mlp.experts.down_proj`
    [E, H, I] per layer), and vLLM's expert loader takes that layout as it is."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    if config.tie_word_embeddings:
        raise ValueError(f"{model_dir} ties its input and output embeddings: vLLM's weight reload leaves "
                         "the tied lm_head on the old weights, so updates would be silently wrong. "
                         "Save the model untied (tie_word_embeddings=false) to serve it here.")
    if not any(Path(model_dir).glob("*.safetensors")):
        raise ValueError(f"{model_dir} has no *.safetensors weights (save with safe_serialization=True)")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: list(tensor.shape) for name, tensor in model.state_dict().items()}


def bearer_auth(token: str):
    """A FastAPI dependency: 401 unless `Authorization: Bearer <token>` (constant-time compare)."""

    def check(request: Request) -> None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), token.encode()):
            raise HTTPException(401, "missing or wrong bearer token (see RUN_DIR/auth_token)",
                                headers={"WWW-Authenticate": "Bearer"})

    return check


MAX_DEPTH = 16  # the control bodies nest 3 deep; a deeper one is refused before anything walks it
SMALL_BODY_BYTES = 64 << 10  # /hold, /init_process_group: a few fields
# /request_weight_update names every tensor (name, dtype, shape, ~100 bytes each): a 256-expert MoE's ~50k
# tensors take ~5 MB
UPDATE_BODY_BYTES = 32 << 20


async def read_json_body(request: Request, max_bytes: int) -> dict:
    """The request's JSON object, read up to `max_bytes`. UpdateError 413 for a bigger body (refused from its
    Content-Length before it is read; without one, as soon as the stream passes the cap: uvicorn discards the
    rest, so the connection stays usable), 400 for malformed JSON, NaN or an infinite number, nesting deeper
    than MAX_DEPTH, or a body that is not an object."""
    declared = request.headers.get("content-length", "").lstrip("0")
    if declared.isdigit() and (len(declared) > len(str(max_bytes)) or int(declared) > max_bytes):
        raise _too_large(max_bytes)
    raw, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        raw.append(chunk)
    try:
        body = json.loads(b"".join(raw), parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:  # the decoder recurses per level: ~1000 levels exhaust the stack
        raise UpdateError(400, f"bad request body: JSON nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
        raise UpdateError(400, f"malformed JSON body: {err}") from None
    if not _depth_within(body, MAX_DEPTH):
        raise UpdateError(400, f"bad request body: JSON nested deeper than {MAX_DEPTH} levels")
    if not isinstance(body, dict):
        raise UpdateError(400, f"bad request body: must be a JSON object, got {json.dumps(body)[:100]}")
    return body


def _too_large(max_bytes: int) -> UpdateError:
    return UpdateError(413, f"request body too large: this route takes at most {max_bytes} bytes")


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number this server takes (JSON has no NaN or Infinity)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:50]} is out of the float range")
    return value


def _depth_within(value: object, limit: int) -> bool:
    """Whether `value` nests at most `limit` containers deep; iterative (the depth may be near the recursion
    limit), visiting containers only."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return False
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return True


def _reply(err: UpdateError) -> JSONResponse:
    return JSONResponse({"error": str(err), **err.details}, status_code=err.status)


def _body_route(operation, max_bytes: int):
    """A route answering `operation(body)` for a bounded JSON body (`read_json_body`)."""

    async def route(request: Request) -> JSONResponse:
        try:
            return JSONResponse(await operation(await read_json_body(request, max_bytes)))
        except UpdateError as err:
            return _reply(err)

    return route


def control_router(updater: WeightUpdater, token: str) -> APIRouter:
    """A policy or eval server's weight-update routes: all but `GET /status` need the run's bearer token
    (RUN_DIR/auth_token)."""
    router = APIRouter()
    auth = [Depends(bearer_auth(token))]
    for path, operation, max_bytes in (("/init_process_group", updater.init_group, SMALL_BODY_BYTES),
                                       ("/request_weight_update", updater.update, UPDATE_BODY_BYTES),
                                       ("/hold", updater.hold, SMALL_BODY_BYTES)):
        router.add_api_route(path, _body_route(operation, max_bytes), methods=["POST"], dependencies=auth)

    @router.post("/release", dependencies=auth)
    async def release() -> JSONResponse:  # any body, or none: never read
        """End a hold (`POST /hold`) early; "held": whether one was still in force (not an error when none was)."""
        return JSONResponse(await updater.release())

    @router.get("/status")
    async def status() -> JSONResponse:
        """The server's state (read-only): version, ranks, update counters and timings, hold, the tensors an update
        carries, and the run's public id."""
        return JSONResponse(updater.status())

    return router


def frozen_router(kind: str) -> APIRouter:
    """A reference or reward server's answer to the weight-update routes: a clear 403, not a silent 404."""
    router = APIRouter()
    serves = "the run's initial model" if kind == "reference" else "reward.model_path"

    async def refuse() -> JSONResponse:
        """403: a reference or reward server never takes weight updates."""
        return JSONResponse({"error": f"a {kind} server never takes weight updates (it serves {serves}; "
                                      "broadcast to the servers in RUN_DIR/servers/)"}, status_code=403)

    for path in ("/init_process_group", "/request_weight_update", "/hold", "/release"):  # bodies never read
        router.add_api_route(path, refuse, methods=["POST"])
    return router


@dataclass
class Updates:
    """What a policy server needs for weight updates; a reference server has none."""

    expected: dict[str, list[int]]  # HF tensor name -> shape (check_model)
    token: str  # bearer token of the control routes
    version: int  # policy version of the weights it starts with


async def run(cfg: Config, args, updates: Updates | None, kind: str = "policy") -> None:
    """Serve until SIGINT/SIGTERM: a policy or eval server with `updates`, a reference or reward server without."""
    from pipelinerl.inference.vllm_glue.serving import open_server

    published: list[Path] = []
    try:
        async with open_server(args, policy_versions=updates is not None) as server:
            if updates is None:
                server.app.include_router(frozen_router(kind))
            else:
                updater = WeightUpdater(server.engine, updates.expected, cfg.model.dtype, cfg.inference.kv_on_update,
                                        updates.version, staging=cfg.inference.update_staging,
                                        on_broken=lambda: os.kill(os.getpid(), signal.SIGTERM),
                                        run=rundir.run_fingerprint(updates.token),
                                        max_hold_s=cfg.inference.max_hold_s)
                server.app.include_router(control_router(updater, updates.token))
                await updater.start()
            announce = asyncio.create_task(announce_when_healthy(cfg.run_dir, args.host, args.port,
                                                                 rundir.SERVER_FOLDERS[kind], published))
            announce.add_done_callback(lambda t: stop_if_unannounced(t, lambda: os.kill(os.getpid(), signal.SIGTERM)))
            await server.serve()
            if announce.done() and not announce.cancelled() and announce.exception() is not None:
                raise SystemExit(f"stopped: {announce.exception()}")
            announce.cancel()
            if updates is not None and updater.broken:
                raise SystemExit("stopped: a weight update failed while loading (see above); restart the server")
    finally:
        for path in published:
            path.unlink(missing_ok=True)


def serve(cfg: Config, port: int, version: int, kind: str = "policy") -> None:
    """Entry point of `pipelinerl serve` (blocks until SIGINT/SIGTERM); `kind`: policy, eval (a policy server
    that only evaluates), reference (a frozen server of `cfg.model.path`) or reward (reward.model_path); only
    policy and eval servers take updates, so only they need the token and the untied-model check."""
    # config errors before the heavy imports
    argv = vllm_argv(cfg, rundir.bind_host(cfg.inference.host), port, kind)
    updates = None
    if kind in rundir.POLICY_KINDS:
        updates = Updates(check_model(cfg.model.path), rundir.run_token(cfg.run_dir, cfg.inference.auth_token),
                          version)

    import uvloop

    from pipelinerl.inference.vllm_glue import check_plugin, check_version
    from pipelinerl.inference.vllm_glue.serving import parse_vllm_args, setup_process

    check_version()
    check_plugin()
    setup_process(cfg.inference.cpu_kv_cache_gb, cfg.inference.engine_spin_s, cfg.inference.tensor_parallel_size,
                  routed_experts=kind in rundir.POLICY_KINDS and cfg.returns_routed_experts)
    uvloop.run(run(cfg, parse_vllm_args(argv), updates, kind))

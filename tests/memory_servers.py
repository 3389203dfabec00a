"""In-memory policy servers for weight-transport tests without vLLM: the real control routes and WeightUpdater
(inference/server.py, updates.py) over HTTP, and a memory engine that receives with the real receive_staged over
gloo and loads by keeping copies of the tensors. Imported by tests (pytest puts tests/ on sys.path).

The "training" is an fp32 master copy moved by Adam-sized steps (|step| = lr) and cast to bfloat16 for the wire,
as DeepSpeed's bf16 mode does; references are bit-wise comparisons of integer views.
"""

import asyncio
import threading
import time

import torch
import uvicorn
from fastapi import FastAPI
from helpers import worker_port
from prometheus_client import CollectorRegistry

from pipelinerl.inference.server import control_router
from pipelinerl.inference.updates import WeightUpdater
from pipelinerl.launch.procs import free_port
from pipelinerl.weights import DeltaBase, TensorMeta, UpdateRejected, UpdateRequest, open_group, receive_staged
from pipelinerl.weights.receiver import StagingBuffers

TOKEN = "t" * 32
TIMEOUT_S = 4.0  # the group's collectives: a broken broadcast fails on the servers within this


class MemoryEngine:
    """An UpdatableEngine whose model is a dict of tensors; receive as vllm_glue/transfer.py does."""

    num_ranks = 1

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights = {n: t.clone() for n, t in weights.items()}
        self.group = self.req = self.staged = None
        self.base = DeltaBase()
        self.buffers = StagingBuffers()

    async def set_version(self, version: int) -> None:
        pass

    async def join_group(self, req, staging: str) -> None:
        self.req = req
        self.group = await asyncio.to_thread(open_group, req, req.rank_offset)

    async def pause(self, recompute: bool) -> None:
        pass

    async def receive(self, req: UpdateRequest) -> None:
        try:
            self.staged = await asyncio.to_thread(receive_staged, self.group, req, torch.device("cpu"),
                                                  time.monotonic() + self.req.timeout_s, "the trainer", "host",
                                                  self.base, self.buffers)
        except UpdateRejected:
            raise
        except BaseException:
            self.base.drop()
            self.buffers.forget()
            self.group = None
            raise
        if req.keep_base:
            self.buffers.release(list(self.base.tensors.values()))

    async def load(self, version: int) -> None:
        self.weights.update((n, t.clone()) for n, t in self.staged)

    async def resume(self) -> None:
        pass

    async def worker_timings(self) -> list[dict[str, float]]:
        return [{}]

    async def in_group(self) -> bool:
        return self.group is not None


class Server:
    def __init__(self, weights: dict[str, torch.Tensor], port: int | None = None, dtype: str = "bfloat16",
                 token: str = TOKEN):
        self.engine = MemoryEngine(weights)
        self.updater = WeightUpdater(self.engine, {n: list(t.shape) for n, t in weights.items()}, dtype,
                                     "keep", 0, registry=CollectorRegistry())
        app = FastAPI()
        app.include_router(control_router(self.updater, token))
        self.port = port or free_port(worker_port(18900))
        self.uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uv.started:
            assert time.monotonic() < deadline, "the test server did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(timeout=10)


class HangingServer(Server):
    """Receives nothing: its update never answers until the test sets `release` (a server SIGSTOPped
    mid-update)."""

    def __init__(self, weights: dict[str, torch.Tensor], dtype: str = "bfloat16", token: str = TOKEN):
        super().__init__(weights, dtype=dtype, token=token)
        self.release = threading.Event()

        async def receive(req):
            await asyncio.to_thread(self.release.wait, 600)
            raise RuntimeError("released by the test")

        self.engine.receive = receive


class Trainer:
    """An fp32 master copy, bf16 on the wire: most elements change in no step at lr 1e-5."""

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.g = g
        self.master = {"embed": torch.randn(64, 32, generator=g) * 0.05, "w1": torch.randn(48, 32, generator=g) * 0.05,
                       "bias": torch.zeros(48), "frozen": torch.randn(16, generator=g)}

    def step(self, lr: float) -> None:
        for name, m in self.master.items():
            if name == "frozen":
                continue
            big = 10.0 if name == "bias" else 1.0  # the bias moves a lot: sent dense, per tensor
            m -= lr * big * torch.sign(torch.randn(m.shape, generator=self.g))

    def wire(self) -> dict[str, torch.Tensor]:
        return {n: m.bfloat16() for n, m in self.master.items()}


def metas(weights: dict[str, torch.Tensor]) -> list[TensorMeta]:
    return [TensorMeta(n, "bfloat16", list(t.shape)) for n, t in weights.items()]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def assert_serving(server: Server, weights: dict[str, torch.Tensor]) -> None:
    for name, want in weights.items():
        assert torch.equal(bits(server.engine.weights[name]), bits(want)), name

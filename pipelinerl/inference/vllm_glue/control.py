"""API-server side of the weight updates: the steps `WeightUpdater` drives, on vLLM's `AsyncLLM`.

`VllmEngine` implements `pipelinerl.inference.updates.UpdatableEngine`. Each step is one `AsyncLLM` call
of vLLM's weight-transfer lifecycle; the engine it drives in the workers is `transfer.StagedWeightEngine`.
"""

from __future__ import annotations

from dataclasses import asdict

from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

from pipelinerl.inference.vllm_glue.transfer import group_members
from pipelinerl.weights import InitRequest, UpdateRequest, update_body


class VllmEngine:
    def __init__(self, client) -> None:
        self.client = client  # vLLM's AsyncLLM (the API server's engine client)

    @property
    def num_ranks(self) -> int:
        """Workers that join the weight-update group: one per server (its tensor-parallel rank 0 receives for
        the others, transfer.py), one per pipeline stage with pipeline parallelism."""
        return group_members(self.client.vllm_config.parallel_config)

    async def set_version(self, version: int) -> None:
        # vLLM versions are strings; the per-token spans carry them back (serving.per_token_versions).
        await self.client.update_weight_version(str(version))

    async def join_group(self, req: InitRequest, staging: str) -> None:
        # staging is this server's inference.update_staging: a server-side choice, so not in the trainer's body
        info = {**asdict(req), "staging": staging}
        await self.client.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))
        await self._raise_failure()

    async def pause(self, recompute: bool) -> None:
        # "keep" freezes running requests in place; clearing the cache preempts them (re-prefill later).
        # AsyncLLM.pause_generation is this call and a 20 ms sleep that, by its comment, only orders the final
        # outputs of finishing requests before it returns: none finish in "keep" mode, and a token's version
        # comes from the engine, not from when its output arrives. The sleep was most of the pause call.
        if recompute:
            await self.client.renderer.clear_mm_cache_async()
        await self.client.engine_core.pause_scheduler_async(mode="keep", clear_cache=recompute)

    async def receive(self, req: UpdateRequest) -> None:
        await self.client.start_weight_update()
        await self.client.update_weights(WeightTransferUpdateRequest(update_info=update_body(req)))
        try:
            await self._raise_failure()
        except RuntimeError:
            await self.client.finish_weight_update()  # ends vLLM's update session; the workers load nothing
            raise

    async def _raise_failure(self) -> None:
        """The workers keep the error of their latest join or receive instead of raising it
        (transfer.StagedWeightEngine._recorded): raise the first, in worker rank order."""
        failures = [f for f in await self.client.collective_rpc("pipelinerl_failure") if f is not None]
        if failures:
            raise RuntimeError(failures[0])

    async def load(self, version: int) -> None:
        await self.client.finish_weight_update(str(version))

    async def resume(self) -> None:
        await self.client.resume_generation()

    async def worker_timings(self) -> list[dict[str, float]]:
        return await self.client.collective_rpc("pipelinerl_update_timings")

    async def in_group(self) -> bool:
        """Whether every receiving worker still holds its group (it drops one whose collective failed)."""
        return all(await self.client.collective_rpc("pipelinerl_has_group"))

"""The trainer contract: everything the training loop and the checkpoints need from a backend.

A backend (DeepSpeed in deepspeed_backend.py; FSDP2 or TorchTitan could follow) implements `Trainer`
and is registered by name in backends.py, which builds it: the loop (loop.py) and the checkpoints
(checkpoints.py) use nothing else. Loss maths stays in `pipelinerl.rl`; packing in
`pipelinerl.trainer.packing`; the weight transport to the inference servers comes in through the
constructor as a `WeightPublisher` (rank 0's weights/publish.py `Publication`: the loop publishes, and
weights/delivery.py takes each version to the servers on a thread of its own).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from pipelinerl.trainer.moe import RouterTap
from pipelinerl.trainer.packing import MicroBatch

if TYPE_CHECKING:
    from pipelinerl.weights import PublishStats, TensorMeta

# loss_fn(micro_batch, new_logprobs_N, values_N or None without a value head) -> (loss share, stats):
# the loop's objective of one micro-batch, which `Trainer.accumulate` differentiates.
LossFn = Callable[[MicroBatch, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, dict]]


class WeightPublisher(Protocol):
    """Takes one version of the full LM weights (rank 0 only) and returns without waiting for any server:
    weights.Publication keeps it in host memory for the delivery thread."""

    def publish(self, version: int, metas: list[TensorMeta], tensors: Iterable[torch.Tensor]) -> PublishStats:
        """Copy `tensors` (in `metas` order, each valid until the next is drawn; consumed to the end) as
        `version`."""


class Trainer(Protocol):
    """A training backend: sharded model + optimizer on this rank, driven by the loop.

    Constructed by backends.build_trainer as
    ``Backend(cfg: TrainerConfig, dist: DistInfo, dtype: str, publisher: WeightPublisher | None,
    value_head: bool, temperature: float, lm_head_fp32: bool, moe_aux_coef: float, routing_replay: str)``: dtype
    is model.dtype; publisher is rank 0's weights
    publication (None on the other ranks, or to gather without publishing); value_head trains a critic head
    beside the LM (rl.value_function); temperature is the rollouts' sampling temperature, at which
    completion log-probs are scored (actor.sampling.temperature); lm_head_fp32 computes the logits in
    float32 (model.lm_head_fp32). cfg.logprob_chunk_tokens bounds
    how many rows of [tokens, vocab] logits `forward` and its backward hold at once (model.completion_forward).
    moe_aux_coef and routing_replay are rl.moe_aux_coef and rl.routing_replay (a mixture of experts: moe.py)."""

    router_tap: RouterTap | None  # a mixture of experts' routers, once `init` has loaded it; None: a dense model

    @property
    def device(self) -> torch.device:
        """Where the loss inputs of this rank belong (the device of the log-probs `forward` returns)."""

    def init(self, model_path: str) -> None:
        """Load the HF checkpoint at model_path, shard weights and optimizer state over the ranks."""

    def forward(self, micro_batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[N] log-probs (float32, differentiable) of the micro-batch's completion tokens under the
        current weights, in the order of micro_batch.target_pos_N, and from the same forward pass the
        critic's [N] values (float32, differentiable) of the states in which those tokens were chosen, or
        None when the backend trains no value head (rl.value_function off). The head is the backend's own:
        broadcasts and HF checkpoints carry the LM alone."""

    def accumulate(self, micro_batches: list[MicroBatch], loss_fn: LossFn) -> list[dict]:
        """Collective. Forward + loss_fn + backward over this rank's micro-batches, gradients summed. The loss
        of a micro-batch is its share of the step's total loss (a sum over its tokens divided by a count of
        the whole step, all ranks), so the step's gradient is the plain sum over micro-batches and ranks.
        Ranks may hold different numbers of micro-batches (even none); the backend keeps its collectives in
        step. Returns the stats of this rank's real micro-batches, in order."""

    def optimizer_step(self) -> dict[str, float]:
        """Collective. Clip, step the optimizer and the schedule, zero gradients; returns grad_norm and lr."""

    def publish_weights(self, version: int) -> dict[str, float]:
        """Collective. Gather the full LM weights and (rank 0) hand them to the publisher as `version`;
        returns "bytes" (the LM's size) and "publish_s" (gather + copy)."""

    def save_state(self, out_dir: Path) -> None:
        """Collective. Everything needed to resume (weights with any value head, optimizer, schedule); each
        rank writes its own part under out_dir."""

    def load_state(self, in_dir: Path) -> None:
        """Collective. Restore what `save_state` wrote (after `init`); FileNotFoundError if nothing is there."""

    def save_hf(self, out_dir: Path) -> None:
        """Collective. An HF folder of the LM alone (weights, config, tokenizer) written by rank 0: loadable
        by transformers and vLLM."""

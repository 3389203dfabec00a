"""The trainer contract (seed 000): the five operations the training loop needs from a backend.

A backend (DeepSpeed here; FSDP or TorchTitan could follow) implements this Protocol; the loop and the
tests use nothing else. Loss maths stays in `pipelinerl.rl`; packing in `pipelinerl.trainer.packing`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pipelinerl.trainer.packing import MicroBatch


class Trainer(Protocol):
    def init(self, model_path: str) -> None:
        """Load the HF checkpoint at model_path, shard weights and optimizer state over the ranks."""

    def forward(self, micro_batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[N] log-probs (float32, differentiable) of the micro-batch's completion tokens under the
        current weights, in the order of micro_batch.target_pos_N, and from the same forward pass the
        critic's [N] values (float32, differentiable) of the states in which those tokens were chosen, or
        None when the backend trains no value head (rl.value_function off). The head is the backend's own:
        broadcasts and HF checkpoints carry the LM alone."""

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of loss: this micro-batch's share of the step's total loss (a sum over
        its tokens divided by the number of sequences in the whole step, all ranks)."""

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step the optimizer and the schedule, zero gradients; returns grad_norm and lr."""

    def broadcast_weights(self, version: int) -> dict[str, float]:
        """Gather the full weights layer by layer and send them to the inference servers as `version`."""

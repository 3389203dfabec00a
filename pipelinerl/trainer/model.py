"""The model side of every trainer backend, free of any parallelism framework: the learning-rate schedule,
the value head, and the packed forward pass that scores completion tokens.

Value head (rl.value_function). A backend then wraps `ValueHeadLM`: the HF causal LM plus a critic head on
its final hidden state (shared trunk). The head is trained and checkpointed with the backend's state, but
weights that leave the trainer (broadcasts to the inference servers, the hf/ checkpoint folder) are the LM's
alone, under their HF names.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from pipelinerl.config import TrainerConfig
from pipelinerl.trainer.packing import MicroBatch


def lr_factor(step: int, cfg: TrainerConfig) -> float:
    """Multiplier of cfg.lr for optimizer step `step` (0-based): linear warm-up, then the schedule."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    if cfg.lr_schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class LogitsAndValues(NamedTuple):  # a tuple, so ZeRO-3's hooks on module outputs reach its tensors
    logits: torch.Tensor  # [1, K, V] the LM's logits of the rows kept by logits_to_keep
    values: torch.Tensor  # [1, K] the value head on the same rows' final hidden states


class ValueHeadLM(torch.nn.Module):
    """An HF causal LM plus a critic head `nn.Linear(hidden_size, 1)` on its final (post-norm) hidden state,
    the one the LM head reads. The head starts at zero weight and bias, so every value starts at 0 whatever
    the seed or rank, and the first value-loss step moves the head alone (its zero weight passes the trunk no
    gradient)."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm
        self.value_head = torch.nn.Linear(lm.config.hidden_size, 1, dtype=lm.dtype)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, logits_to_keep: torch.Tensor, **lm_kwargs) -> LogitsAndValues:
        # hidden_states[-1] is the final norm's output (transformers ties it to last_hidden_state). The tuple
        # holds every layer's output, which backward (or gradient checkpointing) keeps anyway.
        out = self.lm(logits_to_keep=logits_to_keep, output_hidden_states=True, **lm_kwargs)
        hidden_KH = out.hidden_states[-1][0, logits_to_keep]
        return LogitsAndValues(out.logits, self.value_head(hidden_KH)[None, :, 0])


def completion_forward(model, micro_batch: MicroBatch, device: torch.device,
                       temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward pass over a packed micro-batch: [N] float32 log-probs of its completion tokens and, when
    `model` is a ValueHeadLM, [N] float32 values (else None). model: an HF causal LM, a ValueHeadLM, or the
    backend engine wrapping either (DeepSpeed's). values_N[i] is the value of the state in which token i was chosen: the
    head on row target_pos_N[i] - 1, the same row whose logits give new_N[i].

    The log-probs are those of softmax(logits / temperature), the distribution the servers sample from and
    report (vLLM's processed log-probs): at temperature != 1 the raw softmax is not the behaviour policy's
    counterpart, and importance ratios against it are wrong even on-policy. Values are untouched."""
    input_ids = micro_batch.input_ids.to(device)
    target_pos = micro_batch.target_pos_N.to(device)
    # No attention mask: transformers isolates the packed sequences from the position-id restarts.
    # Only rows that predict a completion token go through the LM head (the vocabulary is large).
    out = model(input_ids=input_ids, position_ids=micro_batch.position_ids.to(device), use_cache=False,
                logits_to_keep=target_pos - 1)
    logits_NV = out.logits[0].float()
    if temperature != 1.0:
        logits_NV = logits_NV / temperature
    targets_N = input_ids[0, target_pos]
    logprobs_N = logits_NV.gather(-1, targets_N[:, None])[:, 0] - logits_NV.logsumexp(-1)
    return logprobs_N, out.values[0].float() if isinstance(out, LogitsAndValues) else None


def completion_logprobs(model, micro_batch: MicroBatch, device: torch.device,
                        temperature: float = 1.0) -> torch.Tensor:
    """[N] float32 log-probs of a packed micro-batch's completion tokens under an HF causal LM (tempered as in
    `completion_forward`)."""
    return completion_forward(model, micro_batch, device, temperature)[0]

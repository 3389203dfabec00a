"""Packing variable-length samples into micro-batches.

A packed micro-batch is one row: sequences concatenated, position ids restarting at 0 for each. With no
attention mask, transformers derives a block-diagonal causal mask from those restarts (sdpa) or uses
varlen kernels (flash-attention), so attention never crosses sequences and nothing is padded.

Per-token tensors live on completion tokens only (suffix _N): the loss needs nothing else. Per-sequence
values (advantage, group, reward) are kept once per sequence (suffix _S: the row's sequences in row order)
and expanded to tokens by the loss, through row_seq_N. Pure torch: no process groups here; the backend pads
ranks to equal micro-batch counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch


@dataclass
class Sample:
    """One completion with its prompt, as the trainer sees it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    index: int  # position of the sample in its optimizer step (0..N-1), the same on every rank
    token_fields: dict[str, list] = field(default_factory=dict)  # one value (or list of k) per completion token
    seq_fields: dict[str, float] = field(default_factory=dict)  # one value for the whole sequence

    def __post_init__(self) -> None:
        assert self.prompt_ids, "a sample needs at least one prompt token to condition the first completion token"
        for name, values in self.token_fields.items():
            assert len(values) == len(self.completion_ids), f"{name}: one value per completion token"

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass
class MicroBatch:
    """Samples packed into one row; index tensors select the completion tokens."""

    input_ids: torch.Tensor  # [1, L] long
    position_ids: torch.Tensor  # [1, L] long, restarting at 0 for each sequence
    target_pos_N: torch.Tensor  # [N] long: row position of each completion token (predicted from pos - 1)
    seq_index_N: torch.Tensor  # [N] long: the token's Sample.index (step-wide, independent of packing)
    row_seq_N: torch.Tensor  # [N] long: the token's sequence among the row's S (0..S-1): indexes seq_fields_S
    fields_N: dict[str, torch.Tensor]  # [N] float64 per token field ([N, k]: k values per token)
    seq_fields_S: dict[str, torch.Tensor]  # [S] float64 per sequence field, the row's sequences in row order
    num_sequences: int
    is_padding: bool = False  # an empty stand-in that keeps ranks' collectives in step; its loss is 0

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def _row(samples: list[Sample]) -> MicroBatch:
    ids, pos, target, seq, row_seq = [], [], [], [], []
    for k, s in enumerate(samples):
        start = len(ids) + len(s.prompt_ids)
        ids += s.prompt_ids + s.completion_ids
        pos += range(s.num_tokens)
        target += range(start, start + len(s.completion_ids))
        seq += [s.index] * len(s.completion_ids)
        row_seq += [k] * len(s.completion_ids)
    names = samples[0].token_fields.keys()
    fields = {n: torch.tensor([v for s in samples for v in s.token_fields[n]], dtype=torch.float64) for n in names}
    seq_fields = {n: torch.tensor([s.seq_fields[n] for s in samples], dtype=torch.float64)
                  for n in samples[0].seq_fields}
    return MicroBatch(
        input_ids=torch.tensor([ids], dtype=torch.long), position_ids=torch.tensor([pos], dtype=torch.long),
        target_pos_N=torch.tensor(target, dtype=torch.long), seq_index_N=torch.tensor(seq, dtype=torch.long),
        row_seq_N=torch.tensor(row_seq, dtype=torch.long), fields_N=fields, seq_fields_S=seq_fields,
        num_sequences=len(samples))


def pack(samples: list[Sample], micro_batch_tokens: int, together: list | None = None) -> list[MicroBatch]:
    """First-fit decreasing into rows of at most micro_batch_tokens tokens.

    together: one key per sample (or None); samples sharing a non-None key land in the same row (online
    DPO scores a pair inside one micro-batch). A sample, or a bundle, longer than the budget gets a row
    to itself (truncating it would change the objective). Deterministic: ties in length keep the
    samples' order.
    """
    units: dict = {}
    for i, s in enumerate(samples):
        key = i if together is None or together[i] is None else ("together", together[i])
        units.setdefault(key, []).append(s)
    bins: list[list[Sample]] = []
    room: list[int] = []
    for unit in sorted(units.values(), key=lambda u: -sum(s.num_tokens for s in u)):
        size = sum(s.num_tokens for s in unit)
        slot = next((i for i, r in enumerate(room) if r >= size), None)
        if slot is None:
            bins.append(list(unit))
            room.append(micro_batch_tokens - size)
        else:
            bins[slot] += unit
            room[slot] -= size
    return [_row(b) for b in bins]


def padding_micro_batch(token_fields=(), seq_fields=()) -> MicroBatch:
    """Two pad tokens and one target: enough for a forward/backward that touches every parameter. Its
    fields (names as given) are zeros: one token of one (uncounted) sequence. token_fields: names (one value
    per token), or a mapping of names to each token's shape (() or (k,)) or to a real batch's [N, ...] tensors."""
    def shape(name: str) -> tuple[int, ...]:
        per_token = token_fields[name] if isinstance(token_fields, Mapping) else ()
        return tuple(per_token.shape[1:]) if isinstance(per_token, torch.Tensor) else tuple(per_token)

    return MicroBatch(
        input_ids=torch.zeros((1, 2), dtype=torch.long), position_ids=torch.tensor([[0, 1]]),
        target_pos_N=torch.tensor([1]), seq_index_N=torch.tensor([0]), row_seq_N=torch.tensor([0]),
        fields_N={n: torch.zeros((1, *shape(n)), dtype=torch.float64) for n in token_fields},
        seq_fields_S={n: torch.zeros(1, dtype=torch.float64) for n in seq_fields}, num_sequences=0,
        is_padding=True)

"""The rollout row: one row per sample (completion), its Arrow schema and validation on write.

This is the contract between actors and the trainer: both sides import it from here, so neither can drift.
Token-level columns are Arrow lists; `behaviour_logprobs[i]` and `versions[i]` describe
`completion_token_ids[i]` (the policy version is the trainer step whose weights produced that token).
`reference_logprobs[i]` is that token's log-prob under the run's initial (reference) model, from a
reference server; the list is empty when the run has no reference model (rl.kl_coef = 0 and no
dpo_reference=reference), and rows written without the key get an empty list. With rl.teacher_top_k = k,
`teacher_top_ids` and `teacher_top_logprobs` hold the teacher's k likeliest tokens at each completion position
and their log-probs, flattened token by token (token i's are entries i*k .. i*k + k - 1); empty otherwise. With
inference.return_routed_experts (a mixture of experts), `routed_experts` holds each completion token's experts
in every MoE layer, L x k ids per token flattened token by token, then layer by layer (token i's layer l's are
entries (i*L + l)*k .. + k - 1); empty otherwise.

A multi-turn episode is one row: `completion_token_ids` hold everything after the prompt, the model's
tokens and the environment's (tool results, the chat template's turn markers) in order. `loss_mask[i]` is 1
for a token the model sampled and 0 for an environment token, which has version -1 (and behaviour log-prob
0.0): it is context for later model tokens, never trained on. A row written without `loss_mask` (a
single-turn completion) gets all ones. `turns`, `tool_calls`, `tool_errors` and `end_reason` describe the
episode; a single-turn row gets 1, 0, 0 and "finished" or "truncated".
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

SCHEMA_VERSION = 5  # bump on any incompatible change; readers refuse versions they do not know
SCHEMA_VERSION_KEY = b"pipelinerl.rollout_schema_version"

ROLLOUT_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),  # the G attempts at one prompt share it
        pa.field("sample_id", pa.string(), nullable=False),  # unique over the whole stream
        pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("completion_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("behaviour_logprobs", pa.list_(pa.float32()), nullable=False),  # one per completion token
        pa.field("versions", pa.list_(pa.int32()), nullable=False),  # policy version per completion token
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),  # per completion token: 1 model, 0 environment
        pa.field("reference_logprobs", pa.list_(pa.float32()), nullable=False),  # one per token, or none
        pa.field("teacher_top_ids", pa.list_(pa.int32()), nullable=False),  # k per token, or none
        pa.field("teacher_top_logprobs", pa.list_(pa.float32()), nullable=False),  # k per token, or none
        pa.field("routed_experts", pa.list_(pa.uint16()), nullable=False),  # L x k per token, or none
        pa.field("reward", pa.float64(), nullable=False),
        pa.field("finished", pa.bool_(), nullable=False),  # ended with EOS / a stop string
        pa.field("truncated", pa.bool_(), nullable=False),  # hit the max_new_tokens limit
        pa.field("turns", pa.int32(), nullable=False),  # model turns of the episode
        pa.field("tool_calls", pa.int32(), nullable=False),  # tool calls the model made
        pa.field("tool_errors", pa.int32(), nullable=False),  # of those, the ones answered with an error
        pa.field("end_reason", pa.string(), nullable=False),  # "finished", "max_turns", "env_error", ...
        pa.field("task", pa.string(), nullable=False),
        pa.field("metadata", pa.string(), nullable=False),  # JSON object text (answers, scores, ...)
        pa.field("actor_id", pa.string(), nullable=False),
        pa.field("created_at", pa.float64(), nullable=False),  # unix seconds: completion received by the actor
        pa.field("written_at", pa.float64(), nullable=False),  # unix seconds: row accepted by the writer
    ],
    metadata={SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode()},
)

_STRING_COLUMNS = ("run_id", "group_id", "sample_id", "task", "actor_id")
_COUNT_COLUMNS = {"turns": 1, "tool_calls": 0, "tool_errors": 0}  # episode counts and their single-turn defaults
NO_VERSION = -1  # the version of an environment token (loss_mask 0): no policy produced it
# Fields a row may leave out, and their defaults: metadata "{}", created_at now, written_at (always set by
# the writer), reference_logprobs and the teacher's top-k [] (none), loss_mask all ones (every token sampled), the
# counts as in _COUNT_COLUMNS, end_reason "finished" or "truncated" (from `finished`).
_OPTIONAL_FIELDS = ("metadata", "created_at", "written_at", "reference_logprobs", "teacher_top_ids",
                    "teacher_top_logprobs", "routed_experts", "loss_mask", *_COUNT_COLUMNS, "end_reason")

TokenSeq = Sequence[int]  # a list, or a 1-D numpy array (converted without per-element Python work)


@dataclass
class Rollout:
    """One sample as the actor hands it to `StreamWriter.write`. Plain dicts with these keys work too."""

    run_id: str
    group_id: str
    sample_id: str
    prompt_token_ids: TokenSeq
    completion_token_ids: TokenSeq
    behaviour_logprobs: TokenSeq
    versions: TokenSeq
    reward: float
    finished: bool
    truncated: bool
    task: str
    actor_id: str
    metadata: str | dict = "{}"  # a dict is serialised to JSON; a string must already be JSON
    reference_logprobs: TokenSeq = field(default_factory=list)  # one per completion token, or empty: no
    #                                                               reference model in this run
    teacher_top_ids: TokenSeq = field(default_factory=list)  # rl.teacher_top_k: k per completion token, or empty
    teacher_top_logprobs: TokenSeq = field(default_factory=list)  # their teacher log-probs, aligned
    routed_experts: TokenSeq = field(default_factory=list)  # L x k expert ids per completion token, or empty
    created_at: float = field(default_factory=time.time)
    loss_mask: TokenSeq | None = None  # one per completion token: 1 sampled by the model, 0 environment token;
    #                                    None: all ones (a single-turn completion)
    turns: int = 1  # model turns
    tool_calls: int = 0
    tool_errors: int = 0
    end_reason: str | None = None  # None: "finished" if finished else "truncated"


def _as_mapping(row: Rollout | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(row, Rollout):  # no deep copy of token lists; None stands for the default
        return {f.name: getattr(row, f.name) for f in fields(Rollout) if getattr(row, f.name) is not None}
    if isinstance(row, Mapping):
        return row
    raise ValueError(f"a rollout row must be a Rollout or a mapping, got {type(row).__name__}")


def _check_row(row: Mapping[str, Any]) -> None:
    """Per-row checks that are cheap in Python (lengths, scalars); element types are checked by column."""
    sid = row.get("sample_id")
    where = f"rollout row (sample_id={sid!r})"
    missing = [n for n in ROLLOUT_SCHEMA.names if n not in row and n not in _OPTIONAL_FIELDS]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    for name in _STRING_COLUMNS:
        if not isinstance(row[name], str) or (name in ("group_id", "sample_id") and not row[name]):
            raise ValueError(f"{where}: `{name}` must be a non-empty string, got {row[name]!r}")
    n = len(row["completion_token_ids"])
    for name in ("behaviour_logprobs", "versions", "loss_mask"):
        if name in row and len(row[name]) != n:
            raise ValueError(f"{where}: `{name}` has {len(row[name])} entries but the completion has "
                             f"{n} tokens; there must be one per completion token")
    n_ref = len(row.get("reference_logprobs", ()))
    if n_ref not in (0, n):
        raise ValueError(f"{where}: `reference_logprobs` has {n_ref} entries but the completion has {n} tokens; "
                         "give one per completion token, or none when the run has no reference model")
    n_top = len(row.get("teacher_top_ids", ()))
    if n_top != len(row.get("teacher_top_logprobs", ())) or (n_top and (n == 0 or n_top % n)):
        raise ValueError(f"{where}: `teacher_top_ids` has {n_top} entries and `teacher_top_logprobs` "
                         f"{len(row.get('teacher_top_logprobs', ()))}; they must hold the same k entries per "
                         f"completion token, {n} tokens here, or none")
    n_routed = len(row.get("routed_experts", ()))
    if n_routed and (n == 0 or n_routed % n):
        raise ValueError(f"{where}: `routed_experts` has {n_routed} entries for {n} completion tokens; it must "
                         "hold the same L x k expert ids per token, or none")
    for name in ("finished", "truncated"):
        if not isinstance(row[name], bool):
            raise ValueError(f"{where}: `{name}` must be a bool, got {row[name]!r}")  # noqa: TRY004 - one error type for bad rows
    for name in _COUNT_COLUMNS:
        count = row.get(name, 0)
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
            raise ValueError(f"{where}: `{name}` must be an int >= 0, got {count!r}")
    end_reason = row.get("end_reason", "finished")
    if not isinstance(end_reason, str) or not end_reason:
        raise ValueError(f"{where}: `end_reason` must be a non-empty string, got {end_reason!r}")
    reward = row["reward"]
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or math.isnan(reward):
        raise ValueError(f"{where}: `reward` must be a number (not NaN), got {reward!r}")


def _metadata_text(row: Mapping[str, Any]) -> str:
    meta = row.get("metadata", "{}")
    if isinstance(meta, dict):
        return json.dumps(meta, sort_keys=True)
    try:
        json.loads(meta)
    except (TypeError, ValueError):
        raise ValueError(f"rollout row (sample_id={row['sample_id']!r}): `metadata` must be a dict or "
                         f"JSON text, got {meta!r}") from None
    return meta


def _is_numpy_of(values: list, kinds: str) -> bool:
    """All values are 1-D numpy arrays of these dtype kinds."""
    return all(getattr(getattr(v, "dtype", None), "kind", "?") in kinds and v.ndim == 1 for v in values)


def _list_column(values: list, name: str, value_type: pa.DataType) -> pa.Array:
    """A list column from per-row sequences. Floats passed as token ids must be refused, and a plain
    typed `pa.array` would truncate them silently: numpy arrays are checked by dtype (the fast path,
    what an engine hands over), anything else has its type inferred first."""
    target = pa.list_(value_type)
    kinds = "iu" if pa.types.is_integer(value_type) else "iuf"
    try:
        if _is_numpy_of(values, kinds):
            column = _concatenated(values, value_type)  # out-of-range ints raise
        elif not any(map(len, values)):  # e.g. reference_logprobs in a run without a reference model
            column = pa.array(values, target)
        else:
            column = _inferred_list(values, name, value_type).cast(target)  # safe cast
    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
        raise ValueError(f"`{name}` does not fit {value_type}: {err}") from None
    if pa.types.is_floating(value_type) and _has_nan(column.values):  # .values: no compute call
        raise ValueError(f"`{name}` contains NaN")
    return column


def _has_nan(values: pa.Array) -> bool:
    """NaN among the values (a null is not NaN). numpy's isnan is ~5x cheaper than pyarrow.compute's
    on a group's few thousand floats, where the fixed cost of a compute call dominates."""
    if values.null_count:
        return pc.any(pc.is_nan(values)).as_py()
    return bool(np.isnan(values.to_numpy()).any())


def _concatenated(arrays: list, value_type: pa.DataType) -> pa.ListArray:
    """One list column from 1-D numpy arrays: a single concatenation and a cumulative sum of their
    lengths."""
    offsets = np.zeros(len(arrays) + 1, np.int32)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(arrays), type=value_type))


def _inferred_list(values: list, name: str, value_type: pa.DataType) -> pa.Array:
    try:
        inferred = pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
        raise ValueError(f"`{name}` must hold numbers: {err}") from None
    item = inferred.type.value_type
    is_int = pa.types.is_integer(item) or pa.types.is_null(item)
    if pa.types.is_integer(value_type) and not is_int:
        raise ValueError(f"`{name}` must hold integers, got {item}")
    if not (is_int or pa.types.is_floating(item)):
        raise ValueError(f"`{name}` must hold numbers, got {item}")
    return inferred


def _group_columns(rows: list[Mapping[str, Any]], written_at: float) -> list[pa.Array]:
    columns = []
    for f in ROLLOUT_SCHEMA:
        if f.name == "written_at":
            columns.append(pa.array([written_at] * len(rows), pa.float64()))
        elif f.name == "metadata":
            columns.append(pa.array([_metadata_text(r) for r in rows], pa.string()))
        elif f.name == "created_at":
            columns.append(pa.array([float(r.get("created_at", written_at)) for r in rows], pa.float64()))
        elif f.name == "loss_mask":
            columns.append(_list_column([_loss_mask(r) for r in rows], f.name, f.type.value_type))
        elif pa.types.is_list(f.type):  # only reference_logprobs and the top-k may be absent (_check_row): empty
            columns.append(_list_column([r.get(f.name, []) for r in rows], f.name, f.type.value_type))
        elif f.name in _COUNT_COLUMNS:
            columns.append(pa.array([r.get(f.name, _COUNT_COLUMNS[f.name]) for r in rows], f.type))
        elif f.name == "end_reason":
            columns.append(pa.array([_end_reason(r) for r in rows], f.type))
        else:
            columns.append(pa.array([r[f.name] for r in rows], f.type))
    return columns


def _loss_mask(row: Mapping[str, Any]) -> TokenSeq:
    """The row's loss mask; all ones (every completion token sampled) when it has none."""
    if "loss_mask" in row:
        return row["loss_mask"]
    return np.ones(len(row["completion_token_ids"]), np.int8)


def _end_reason(row: Mapping[str, Any]) -> str:
    return row.get("end_reason", "finished" if row["finished"] else "truncated")


def _check_loss_mask(batch: pa.RecordBatch) -> None:
    """Every mask value is 0 or 1; a model token (1) has a version >= 0, an environment token (0) version -1.
    Column-wise over the group's tokens; the first bad token names its sample."""
    mask = batch.column("loss_mask")
    mask_T = mask.flatten().to_numpy(zero_copy_only=False)
    versions_T = batch.column("versions").flatten().to_numpy(zero_copy_only=False)
    bad_T = (mask_T != 0) & (mask_T != 1)
    bad_T |= (mask_T == 1) & (versions_T < 0)
    bad_T |= (mask_T == 0) & (versions_T != NO_VERSION)
    if not bad_T.any():
        return
    t = int(np.argmax(bad_T))
    offsets = mask.offsets.to_numpy()
    row = int(np.searchsorted(offsets, t, side="right")) - 1
    where = f"rollout row (sample_id={batch.column('sample_id')[row].as_py()!r}), completion token {t - offsets[row]}"
    value, version = mask_T[t], versions_T[t]
    if value not in (0, 1):
        raise ValueError(f"{where}: `loss_mask` holds {value}; it must be 1 (sampled by the model) or 0 "
                         "(an environment token)")
    if value == 1:
        raise ValueError(f"{where}: loss_mask 1 (a model token) but version {version}; a sampled token carries "
                         "the policy version (>= 0) that produced it")
    raise ValueError(f"{where}: loss_mask 0 (an environment token) but version {version}; environment tokens "
                     f"carry version {NO_VERSION} (no policy produced them)")


def _locate_bad_row(rows: list[Mapping[str, Any]], err: ValueError) -> ValueError:
    """Column-wise conversion cannot say which row was bad; redo it row by row to name the sample."""
    for row in rows:
        try:
            _group_columns([row], 0.0)
        except ValueError as row_err:
            return ValueError(f"rollout row (sample_id={row['sample_id']!r}): {row_err}")
    return err


def group_batch(rows: Sequence[Rollout | Mapping[str, Any]]) -> pa.RecordBatch:
    """Validate the G rows of one group and turn them into one record batch (ValueError if bad)."""
    if not rows:
        raise ValueError("a rollout group must have at least one row")
    maps = [_as_mapping(r) for r in rows]
    for m in maps:
        _check_row(m)
    group_ids = {m["group_id"] for m in maps}
    if len(group_ids) != 1:
        raise ValueError(f"rows of one group must share group_id, got {sorted(group_ids)}")
    sample_ids = [m["sample_id"] for m in maps]
    if len(set(sample_ids)) != len(sample_ids):
        raise ValueError(f"group {maps[0]['group_id']!r} repeats a sample_id: {sample_ids}")
    try:
        columns = _group_columns(maps, time.time())
    except ValueError as err:
        raise _locate_bad_row(maps, err) from None
    batch = pa.RecordBatch.from_arrays(columns, schema=ROLLOUT_SCHEMA)
    _check_loss_mask(batch)
    return batch


def schema_version_of(schema: pa.Schema) -> int:
    """The rollout schema version a segment was written with (0 if it carries none)."""
    raw = (schema.metadata or {}).get(SCHEMA_VERSION_KEY, b"0")
    return int(raw.decode())

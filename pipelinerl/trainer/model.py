"""The model side of every trainer backend, free of any parallelism framework: the learning-rate schedule,
the value head, and the packed forward pass that scores completion tokens (optionally a chunk of tokens at a
time through LogprobHead, so that the [tokens, vocab] logits never exist whole).

Value head (rl.value_function). A backend then wraps `ValueHeadLM`: the HF causal LM plus a critic head on
its final hidden state (shared trunk). The head is trained and checkpointed with the backend's state, but
weights that leave the trainer (broadcasts to the inference servers, the hf/ checkpoint folder) are the LM's
alone, under their HF names.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from typing import NamedTuple

import torch

from pipelinerl.config import TrainerConfig
from pipelinerl.trainer.packing import MicroBatch

log = logging.getLogger(__name__)


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


def attention_implementation(choice: str, device: torch.device, dtype: str) -> str:
    """trainer.attn_implementation resolved, and logged: "auto" is flash_attention_2 on CUDA in a 16-bit dtype
    when flash-attn imports (varlen kernels over each packed sequence, no T x T mask), else sdpa (a block-diagonal
    T x T mask over the packed micro-batch: the attention of the whole micro-batch is computed and masked)."""
    flash = device.type == "cuda" and dtype in ("bfloat16", "float16") and importlib.util.find_spec("flash_attn")
    resolved = choice if choice != "auto" else "flash_attention_2" if flash else "sdpa"
    why = "" if choice != "auto" else " (auto: " + ("flash-attn found" if flash else
                                                   "no CUDA, a float32 model or no flash-attn") + ")"
    log.info("attention: %s%s", resolved, why)
    return resolved


class LogitsAndValues(NamedTuple):  # a tuple, so ZeRO-3's hooks on module outputs reach its tensors
    logits: torch.Tensor  # [1, K, V] the LM's logits of the rows kept ([1, 0, V] when lm_logits=False)
    values: torch.Tensor  # [1, K] the value head on the same rows' final hidden states
    hidden: torch.Tensor  # [K, H] those final hidden states (the LM head's input)


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

    def forward(self, rows_K: torch.Tensor, lm_logits: bool = True, **lm_kwargs) -> LogitsAndValues:
        """Values (and, with lm_logits, the LM's logits) of rows rows_K of the packed sequence."""
        # hidden_states[-1] is the final norm's output (transformers ties it to last_hidden_state). The tuple
        # holds every layer's output, which backward (or gradient checkpointing) keeps anyway.
        out = self.lm(logits_to_keep=rows_K if lm_logits else rows_K[:0], output_hidden_states=True, **lm_kwargs)
        hidden_KH = out.hidden_states[-1][0, rows_K]
        return LogitsAndValues(out.logits, self.value_head(hidden_KH)[None, :, 0], hidden_KH)


def token_logprobs(logits_NV: torch.Tensor, targets_N: torch.Tensor, temperature: float) -> torch.Tensor:
    """[N] float32 log softmax(logits / temperature) at the targets ([N, K] at targets [N, K]: K per row)."""
    logits_NV = logits_NV.float()
    if temperature != 1.0:
        logits_NV = logits_NV / temperature
    logprobs_NK = logits_NV.gather(-1, _per_row(targets_N)) - logits_NV.logsumexp(-1, keepdim=True)
    return logprobs_NK if targets_N.dim() == 2 else logprobs_NK[:, 0]


def _per_row(targets: torch.Tensor) -> torch.Tensor:
    """Targets as [N, K]: [N] ones become [N, 1]."""
    return targets if targets.dim() == 2 else targets[:, None]


class _ChunkedLogprobs(torch.autograd.Function):
    """token_logprobs(linear(hidden_NH, weight, bias), ...) over chunk_tokens rows at a time. Forward keeps
    only [N] log-sum-exps; backward recomputes each chunk's logits for its gradient. Targets [N, K] (K per row,
    e.g. the sampled token and a teacher's top-k) give [N, K] log-probs from the same logits: the gradient of
    log-prob k of a row is onehot_k - softmax, so a chunk's gradient is scatter_add(grad) - softmax x sum(grad).
    One autograd node, so the head's weight receives one gradient per backward (ZeRO-1/2 reduce a parameter's
    gradient once; reentrant checkpointing per chunk would accumulate it once per chunk).

    Numerics as the unchunked path: logits in the weight's dtype (float32 with fp32), softmax in float32, its
    gradient g cast back to the weight's dtype before the matmuls; the weight's gradient is summed over chunks
    in float32. Every GEMM takes the weight in its own dtype, never a float32 copy of it (V x H x 4 B: 2.2 GB
    for a 152k x 3584 head), and 16-bit operands produce float32 directly where that adds precision
    (_matmul32: the weight's gradient; with fp32 the logits, exact products of the bf16 operands). With fp32
    the float32 g goes into the backward GEMMs as two 16-bit halves (_split16), ~16 significant bits instead
    of 8, still at 16-bit GEMM speed. The logits stay O(chunk_tokens x V)."""

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, bias_V, targets_N, temperature, chunk_tokens, fp32):
        logprobs, lse = [], []
        w_VH = _gemm_operand(weight_VH) if fp32 else weight_VH
        for rows in _chunks(len(hidden_NH), chunk_tokens):
            logits_CV = _tempered_logits(hidden_NH[rows], w_VH, bias_V, temperature, fp32)
            lse.append(logits_CV.logsumexp(-1))
            logprobs.append(logits_CV.gather(-1, _per_row(targets_N)[rows]) - lse[-1][:, None])
            del logits_CV  # before the next chunk's
        ctx.save_for_backward(hidden_NH, weight_VH, bias_V, _per_row(targets_N), torch.cat(lse))
        ctx.temperature, ctx.chunk_tokens, ctx.fp32 = temperature, chunk_tokens, fp32
        logprobs_NK = torch.cat(logprobs)
        return logprobs_NK if targets_N.dim() == 2 else logprobs_NK[:, 0]

    @staticmethod
    def backward(ctx, grad_N):
        hidden_NH, weight_VH, bias_V, targets_NK, lse_N = ctx.saved_tensors
        grad_NK = _per_row(grad_N).float()
        split = ctx.fp32 and weight_VH.dtype != torch.float32
        w_gemm = _gemm_operand(weight_VH)
        grad_hidden_NH = torch.empty_like(hidden_NH)
        grad_weight_VH = torch.zeros(weight_VH.shape, dtype=torch.float32, device=weight_VH.device)
        grad_bias_V = None if bias_V is None else torch.zeros(bias_V.shape, dtype=torch.float32,
                                                              device=bias_V.device)
        for rows in _chunks(len(hidden_NH), ctx.chunk_tokens):
            # d logprob_ik / d logits_ij = (onehot_kj - softmax_ij) / T, in place over the recomputed logits
            g_CV = _tempered_logits(hidden_NH[rows], w_gemm if ctx.fp32 else weight_VH, bias_V, ctx.temperature,
                                    ctx.fp32)
            g_CV.sub_(lse_N[rows, None]).exp_().mul_(-grad_NK[rows].sum(-1, keepdim=True))
            g_CV.scatter_add_(-1, targets_NK[rows], grad_NK[rows])
            if ctx.temperature != 1.0:
                g_CV.div_(ctx.temperature)
            if grad_bias_V is not None:
                grad_bias_V += g_CV.sum(0)
            halves = _split16(g_CV, weight_VH.dtype) if split else (g_CV.to(weight_VH.dtype),)
            del g_CV
            hidden_CH = hidden_NH[rows].to(weight_VH.dtype)
            grad_CH = None
            for g in halves:
                grad_CH = _matmul32(g, w_gemm, grad_CH)
                _matmul32(g.T, hidden_CH, grad_weight_VH)
            grad_hidden_NH[rows] = grad_CH  # cast to the hidden states' dtype by the assignment
            del halves
        grad_bias_V = None if grad_bias_V is None else grad_bias_V.to(bias_V.dtype)
        return grad_hidden_NH, grad_weight_VH.to(weight_VH.dtype), grad_bias_V, None, None, None, None


class _Float32Logits(torch.autograd.Function):
    """float32 linear(hidden_NH, weight_VH, bias_V) of a 16-bit head (LogprobHead's plain call with fp32), its
    forward and backward GEMMs run as _ChunkedLogprobs runs them: torch's out_dtype GEMM has no autograd
    formula of its own."""

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, bias_V):
        ctx.save_for_backward(hidden_NH, weight_VH, bias_V)
        return _tempered_logits(hidden_NH, _gemm_operand(weight_VH), bias_V, 1.0, True)

    @staticmethod
    def backward(ctx, grad_NV):
        hidden_NH, weight_VH, bias_V = ctx.saved_tensors
        g_NV = grad_NV.float().clone()  # _split16 overwrites its input
        halves = _split16(g_NV, weight_VH.dtype) if weight_VH.dtype != torch.float32 else (g_NV,)
        w_VH, h_NH = _gemm_operand(weight_VH), hidden_NH.to(weight_VH.dtype)
        grad_hidden = grad_weight = None
        for g in halves:
            grad_hidden = _matmul32(g, w_VH, grad_hidden)
            grad_weight = _matmul32(g.T, h_NH, grad_weight)
        grad_bias = None if bias_V is None else grad_NV.float().sum(0).to(bias_V.dtype)
        return grad_hidden.to(hidden_NH.dtype), grad_weight.to(weight_VH.dtype), grad_bias


def _matmul32(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
    """float32 a @ b, added into the float32 `acc` in place when given: exact products, float32 sums. On CUDA
    16-bit operands go to one tensor-core GEMM with float32 output (torch's out_dtype), no float32 copy of
    either (a float32 GEMM runs on CUDA cores, an order of magnitude below bf16 tensor-core throughput);
    elsewhere they are upcast first, the same arithmetic (CPU torch has no kernel for out_dtype)."""
    if _out_dtype_gemm(a) and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16):
        if acc is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    a, b = a.float(), b.float()  # no copy when already float32
    return a @ b if acc is None else acc.addmm_(a, b)


def _out_dtype_gemm(t: torch.Tensor) -> bool:
    """Whether torch has a GEMM with float32 output from 16-bit operands on `t`'s device (CUDA only)."""
    return t.is_cuda


def _gemm_operand(weight_VH: torch.Tensor) -> torch.Tensor:
    """The weight as _matmul32 takes it: itself where _out_dtype_gemm; elsewhere its float32 copy (the upcast
    _matmul32 would make), once per forward or backward instead of once per chunk."""
    return weight_VH if _out_dtype_gemm(weight_VH) else weight_VH.float()


def _split16(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 x as hi + lo, both `dtype` (16-bit): hi is x rounded, lo the rounding error rounded, so
    hi + lo carries ~2 x 8 significant bits of x (bfloat16) and a product with a 16-bit operand stays exact.
    Overwrites x (no float32 temporary beyond hi's upcast)."""
    hi = x.to(dtype)
    return hi, x.sub_(hi.float()).to(dtype)


def _chunks(n: int, chunk_tokens: int) -> list[slice]:
    return [slice(start, start + chunk_tokens) for start in range(0, n, chunk_tokens)]


def _tempered_logits(hidden_CH, weight_VH, bias_V, temperature, fp32: bool) -> torch.Tensor:
    """float32 logits / temperature, a fresh tensor: computed in the weight's dtype, or from its exact products
    in float32 with fp32."""
    if fp32:
        logits_CV = _matmul32(hidden_CH.to(weight_VH.dtype), weight_VH.T)
        if bias_V is not None:
            logits_CV += bias_V.float()
    else:
        logits_CV = torch.nn.functional.linear(hidden_CH, weight_VH, bias_V).float()
    return logits_CV.div_(temperature) if temperature != 1.0 else logits_CV


class LogprobHead(torch.nn.Linear):
    """The LM head (an nn.Linear) that can also score targets chunk by chunk: `head(hidden)` are logits as
    before; `head(hidden_NH, targets_N, temperature, chunk_tokens)` are [N] float32 log-probs, peak memory
    O(chunk_tokens x V). Scoring goes through the head module's own call so that whatever wraps it sees an
    ordinary module call: ZeRO-3's hooks gather its partitioned weight around forward and backward and
    reduce its gradient. Installed by `enable_chunked_logprobs`; parameters and names are the Linear's.

    fp32 (model.lm_head_fp32): both calls compute the logits in float32 from the live low-precision weight,
    as the vLLM servers do with head_dtype float32; rounding bfloat16 logits (8 significant bits) is then no
    longer a source of behaviour/trainer disagreement."""

    fp32: bool = False

    def forward(self, hidden, targets_N=None, temperature=1.0, chunk_tokens=None):
        if targets_N is None:
            if not self.fp32:
                return super().forward(hidden)
            logits = _Float32Logits.apply(hidden.reshape(-1, hidden.shape[-1]), self.weight, self.bias)
            return logits.view(*hidden.shape[:-1], self.out_features)
        return _ChunkedLogprobs.apply(hidden, self.weight, self.bias, targets_N, temperature, chunk_tokens,
                                      self.fp32)


def enable_chunked_logprobs(lm: torch.nn.Module, fp32: bool = False) -> None:
    """Make the HF LM's output head a LogprobHead (in place: the same module, parameters and hooks); fp32
    makes its logits float32 (LogprobHead), whether or not they are chunked."""
    head = lm.get_output_embeddings()
    if type(head) not in (torch.nn.Linear, LogprobHead):
        raise ValueError(f"chunked or float32 log-probs need an nn.Linear LM head, got {type(head).__name__}: "
                         "set trainer.logprob_chunk_tokens=null and model.lm_head_fp32=false")
    head.__class__ = LogprobHead
    head.fp32 = fp32


def chunked_logprobs(head: torch.nn.Module, hidden_NH: torch.Tensor, targets_N: torch.Tensor,
                     temperature: float, chunk_tokens: int) -> torch.Tensor:
    """[N] float32 token_logprobs(head(hidden_NH), targets_N, temperature), chunk_tokens rows at a time."""
    assert isinstance(head, LogprobHead), "call enable_chunked_logprobs(lm) first"
    return head(hidden_NH, targets_N, temperature, chunk_tokens)


def completion_forward(model, micro_batch: MicroBatch, device: torch.device, temperature: float = 1.0,
                       chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward pass over a packed micro-batch: [N] float32 log-probs of its completion tokens (with a
    `teacher_top_ids` field of k per token, rl.teacher_top_k: [N, 1 + k], column 0 the completion token's,
    then those of the teacher's top-k) and, when
    `model` is a ValueHeadLM, [N] float32 values (else None). model: an HF causal LM, a ValueHeadLM, or the
    backend engine wrapping either (DeepSpeed's, which exposes it as `.module`). values_N[i] is the value of
    the state in which token i was chosen: the head on row target_pos_N[i] - 1, the same row whose logits
    give new_N[i].

    The log-probs are those of softmax(logits / temperature), the distribution the servers sample from and
    report (vLLM's processed log-probs): at temperature != 1 the raw softmax is not the behaviour policy's
    counterpart, and importance ratios against it are wrong even on-policy. Values are untouched.

    chunk_tokens: None runs the LM head on all N rows at once ([N, V] logits, then float32); a number runs
    it over that many rows at a time (`chunked_logprobs`, after `enable_chunked_logprobs`), equal to float
    tolerance. Either way the logits are float32 from the start when the head is a LogprobHead with fp32."""
    input_ids = micro_batch.input_ids.to(device)
    target_pos = micro_batch.target_pos_N.to(device)
    rows_K = target_pos - 1  # only rows that predict a completion token go through the LM head
    targets_N = input_ids[0, target_pos]
    if "teacher_top_ids" in micro_batch.fields_N:  # rl.teacher_top_k: the student's log-probs of those tokens too
        targets_N = torch.cat([targets_N[:, None], micro_batch.fields_N["teacher_top_ids"].to(device).long()], 1)
    unwrapped = getattr(model, "module", model)
    value_head = isinstance(unwrapped, ValueHeadLM)
    lm = unwrapped.lm if value_head else unwrapped
    # No attention mask: transformers isolates the packed sequences from the position-id restarts.
    kwargs = {"input_ids": input_ids, "position_ids": micro_batch.position_ids.to(device), "use_cache": False}
    if value_head:
        out = model(rows_K=rows_K, lm_logits=chunk_tokens is None, **kwargs)
        hidden_NH, values_N = out.hidden, out.values[0].float()
    elif chunk_tokens is None:
        out = model(logits_to_keep=rows_K, **kwargs)
    else:  # an empty logits_to_keep: the trunk's hidden states, no logits
        out = model(logits_to_keep=rows_K[:0], output_hidden_states=True, **kwargs)
        hidden_NH = out.hidden_states[-1][0, rows_K]
    if chunk_tokens is None:
        logprobs_N = token_logprobs(out.logits[0], targets_N, temperature)
    else:
        logprobs_N = chunked_logprobs(lm.get_output_embeddings(), hidden_NH, targets_N, temperature, chunk_tokens)
    return logprobs_N, values_N if value_head else None


def completion_logprobs(model, micro_batch: MicroBatch, device: torch.device, temperature: float = 1.0,
                        chunk_tokens: int | None = None) -> torch.Tensor:
    """[N] float32 log-probs of a packed micro-batch's completion tokens under an HF causal LM (tempered and
    chunked as in `completion_forward`)."""
    return completion_forward(model, micro_batch, device, temperature, chunk_tokens)[0]

"""model.lm_head_fp32: float32 logits from bfloat16 weights, in the trainer (LogprobHead) and on the vLLM
servers (hf_overrides head_dtype), against a float64 reference of the same bfloat16 operands."""

import copy
from pathlib import Path

import pytest
import torch

from pipelinerl.config import ConfigError, load_config
from pipelinerl.trainer.packing import Sample, pack

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parent.parent
BF16 = torch.bfloat16


def _bf16_head(fp32: bool, seed: int = 0, N: int = 37, H: int = 64, V: int = 300):
    """A bfloat16 LogprobHead with peaked logits (|logits| ~ 10, where bf16 rounds by ~0.03), hidden, targets."""
    from pipelinerl.trainer.model import LogprobHead

    g = torch.Generator().manual_seed(seed)
    head = LogprobHead(H, V, dtype=BF16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g) * 1.3)
        head.bias.copy_(torch.randn(V, generator=g))
    head.fp32 = fp32
    return head, torch.randn(N, H, generator=g).to(BF16), torch.randint(V, (N,), generator=g)


def _reference64(head, hidden_NH, targets_N, temperature):
    """Float64 log_softmax(linear(hidden, weight, bias) / T) of the very same bfloat16 operands."""
    logits = torch.nn.functional.linear(hidden_NH.double(), head.weight.double(), head.bias.double())
    return (logits / temperature).log_softmax(-1)[torch.arange(len(targets_N)), targets_N]


def _scored(head, hidden_NH, targets_N, temperature, chunk):
    """[N] log-probs and the gradients (hidden, weight, bias) of sum(w_i * logprob_i)."""
    from pipelinerl.trainer.model import chunked_logprobs, token_logprobs

    head = copy.deepcopy(head)
    hidden = hidden_NH.clone().requires_grad_(True)
    if chunk is None:
        logprobs_N = token_logprobs(head(hidden), targets_N, temperature)
    else:
        logprobs_N = chunked_logprobs(head, hidden, targets_N, temperature, chunk)
    weights_N = torch.randn(len(targets_N), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (logprobs_N.double() * weights_N).sum().backward()
    return logprobs_N.detach().double(), [hidden.grad, head.weight.grad, head.bias.grad]


def _reference64_grads(head, hidden_NH, targets_N, temperature):
    head64 = copy.deepcopy(head).double()
    hidden = hidden_NH.double().requires_grad_(True)
    logprobs = (head64(hidden) / temperature).log_softmax(-1)[torch.arange(len(targets_N)), targets_N]
    weights_N = torch.randn(len(targets_N), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (logprobs * weights_N).sum().backward()
    return [hidden.grad, head64.weight.grad, head64.bias.grad]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_head_scores_bf16_operands_like_float64_and_the_bf16_head_does_not(temperature):
    """With fp32 the log-probs (chunked or not) equal the float64 reference to float32 tolerance; the plain
    bfloat16 head is off by bfloat16's logit rounding, at least 50x more."""
    want = None
    for fp32 in (True, False):
        head, hidden_NH, targets_N = _bf16_head(fp32)
        want = _reference64(head, hidden_NH, targets_N, temperature)
        errors = []
        for chunk in (None, 8, 1000):  # 8 does not divide 37
            got, _ = _scored(head, hidden_NH, targets_N, temperature, chunk)
            errors.append((got - want).abs().max().item())
        if fp32:
            assert max(errors) < 2e-5, errors
            fp32_error = max(errors)
        else:
            assert min(errors) > 50 * fp32_error, (errors, fp32_error)


def test_fp32_head_gradients_equal_float64_to_bf16_rounding():
    """Gradients wrt hidden states, weight and bias: float64's, rounded once to bfloat16 (the parameters'
    dtype), chunked and unchunked alike."""
    head, hidden_NH, targets_N = _bf16_head(True)
    want = _reference64_grads(head, hidden_NH, targets_N, 0.7)
    for chunk in (None, 8):
        _, grads = _scored(head, hidden_NH, targets_N, 0.7, chunk)
        for name, got, ref in zip(("hidden", "weight", "bias"), grads, want, strict=True):
            assert got.dtype == BF16
            # one bf16 rounding: relative 2^-8 of each entry, plus float32 noise near zero
            torch.testing.assert_close(got.double(), ref, rtol=2**-8, atol=1e-5, msg=f"d/d{name}, chunk {chunk}")


def test_fp32_head_plain_call_returns_float32_logits_of_the_live_weight():
    """`head(hidden)` (what HF's forward calls) is float32 and follows an in-place weight update: no copy."""
    head, hidden_NH, _ = _bf16_head(True)
    logits = head(hidden_NH)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), torch.nn.functional.linear(
        hidden_NH.double(), head.weight.double(), head.bias.double()), rtol=1e-6, atol=1e-5)
    with torch.no_grad():
        head.weight.mul_(-1)
    torch.testing.assert_close(head(hidden_NH), -logits + 2 * head.bias.float(), rtol=1e-6, atol=1e-5)


def _samples():
    return [Sample([3, 4, 5], [6, 7, 8, 9, 10, 11, 12], index=0), Sample([10, 11], [12, 3, 14, 4], index=1),
            Sample([5], [4, 4, 6, 7, 8, 9, 10, 11, 12], index=2)]  # 20 completion tokens


@pytest.mark.parametrize("value_head", [False, True])
def test_completion_forward_of_a_bf16_model_with_fp32_head_equals_float64_head(tiny_model_dir, value_head):
    """The whole tiny model in bfloat16 (weights sharpened so that logits are large): completion_forward's
    log-probs, chunked or not, equal float64 log_softmax of the model's own bfloat16 final hidden states
    through its bfloat16 head; without the option they are much further off."""
    from transformers import AutoModelForCausalLM

    from pipelinerl.trainer.model import ValueHeadLM, completion_forward, enable_chunked_logprobs

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=BF16, attn_implementation="sdpa")
    with torch.no_grad():
        base.lm_head.weight.mul_(30)  # random init gives near-uniform logits, where rounding hardly shows
    (mb,) = pack(_samples(), 64)
    pos = mb.target_pos_N
    with torch.no_grad():
        out = base(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False, output_hidden_states=True)
        hidden_NH = out.hidden_states[-1][0, pos - 1]
        logits64 = torch.nn.functional.linear(hidden_NH.double(), base.lm_head.weight.double())
        want = logits64.log_softmax(-1)[torch.arange(len(pos)), mb.input_ids[0, pos]]
    errors = {}
    for fp32 in (True, False):
        model = copy.deepcopy(base)
        enable_chunked_logprobs(model, fp32=fp32)
        if value_head:
            model = ValueHeadLM(model)
        for chunk in (None, 6):
            with torch.no_grad():
                got, _ = completion_forward(model, mb, CPU, chunk_tokens=chunk)
            assert got.dtype == torch.float32
            errors[fp32, chunk] = (got.double() - want).abs().max().item()
    assert max(errors[True, c] for c in (None, 6)) < 1e-4, errors
    assert min(errors[False, c] for c in (None, 6)) > 20 * max(errors[True, c] for c in (None, 6)), errors


def test_the_option_refuses_a_head_that_is_not_linear():
    from pipelinerl.trainer.model import enable_chunked_logprobs

    class Odd(torch.nn.Module):
        def get_output_embeddings(self):
            return torch.nn.Identity()

    with pytest.raises(ValueError, match="model.lm_head_fp32=false"):
        enable_chunked_logprobs(Odd(), fp32=True)


def _cfg(tmp_path, *overrides):
    return load_config(REPO / "configs" / "tiny_cpu.yaml",
                       [f"run_dir={tmp_path}", "inference.max_model_len=64", *overrides])


def _hf_overrides(argv):
    import json

    return json.loads(argv[argv.index("--hf-overrides") + 1]) if "--hf-overrides" in argv else None


def test_servers_get_a_float32_head_from_the_option(tmp_path):
    """Policy and reference servers alike; a user's other hf_overrides are kept, a contrary head_dtype is
    refused."""
    from pipelinerl.inference.vllm_glue.serving import vllm_argv

    for kind in ("policy", "reference"):
        assert _hf_overrides(vllm_argv(_cfg(tmp_path), "127.0.0.1", 1, kind)) is None
        on = vllm_argv(_cfg(tmp_path, "model.lm_head_fp32=true"), "127.0.0.1", 1, kind)
        assert _hf_overrides(on) == {"head_dtype": "float32"}
    kept = _cfg(tmp_path, "model.lm_head_fp32=true", "inference.engine_args.hf_overrides.rope_theta=5")
    assert _hf_overrides(vllm_argv(kept, "127.0.0.1", 1)) == {"rope_theta": 5, "head_dtype": "float32"}
    bad = _cfg(tmp_path, "model.lm_head_fp32=true", "inference.engine_args.hf_overrides.head_dtype=bfloat16")
    with pytest.raises(ConfigError, match="hf_overrides.head_dtype"):
        vllm_argv(bad, "127.0.0.1", 1)


def test_vllm_logits_processor_computes_float32_logits_from_the_servers_command_line(tiny_model_dir, tmp_path):
    """No server: the command line vllm_argv builds, parsed by vLLM, gives a model config whose head_dtype is
    float32, and vLLM's LogitsProcessor under it turns bfloat16 hidden states and the live bfloat16 head
    weight into float32 logits equal to float64's (the mechanism this vLLM version offers; a version
    without it fails here)."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from pipelinerl.inference.vllm_glue.serving import parse_vllm_args, vllm_argv

    cfg = _cfg(tmp_path, f"model.path={tiny_model_dir}", "model.dtype=bfloat16", "model.lm_head_fp32=true")
    args = parse_vllm_args(vllm_argv(cfg, "127.0.0.1", 1))
    vllm_config = EngineArgs.from_cli_args(args).create_engine_config()
    assert vllm_config.model_config.head_dtype == torch.float32
    head, hidden_NH, _ = _bf16_head(True, V=17)  # the tiny vocabulary

    class Head(torch.nn.Module):  # what LogitsProcessor reads of a ParallelLMHead on one rank
        quant_method, tp_size, weight = UnquantizedEmbeddingMethod(), 1, head.weight

    with set_current_vllm_config(vllm_config):
        processor = LogitsProcessor(17)
    logits = processor(Head(), hidden_NH, head.bias)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), torch.nn.functional.linear(
        hidden_NH.double(), head.weight.double(), head.bias.double()), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("fp32", [False, True])
def test_every_head_gemm_takes_the_bf16_weight_itself(monkeypatch, fp32):
    """No float32 copy of the head's weight in forward or backward: every GEMM that produces float32 gets the
    bfloat16 weight (or its transpose) and a bfloat16 partner (on CUDA: one tensor-core GEMM with float32
    output); with fp32, forward gets the exact float32 products and backward the gradient in two bf16 halves."""
    from pipelinerl.trainer import model as model_mod

    calls = []
    real = model_mod._matmul32

    def recording(a, b, acc=None):
        calls.append((a.dtype, b.dtype, acc is None))
        return real(a, b, acc)

    monkeypatch.setattr(model_mod, "_matmul32", recording)
    monkeypatch.setattr(model_mod, "_gemm_operand", lambda weight: weight)  # as on CUDA: the weight itself
    head, hidden_NH, targets_N = _bf16_head(fp32)
    _scored(head, hidden_NH, targets_N, 0.7, 8)  # 37 rows: 5 chunks
    assert calls and all(a == BF16 and b == BF16 for a, b, _ in calls), calls
    halves = 2 if fp32 else 1
    forward, backward = 5 * fp32, 5 * halves * 2  # 5 chunks, recomputed logits in backward go the same way
    assert len(calls) == forward + 5 * fp32 + backward, len(calls)


def test_split16_carries_twice_the_bits_of_one_bf16_rounding():
    from pipelinerl.trainer.model import _split16

    x = torch.randn(10_000, generator=torch.Generator().manual_seed(3)) * 1e-3
    hi, lo = _split16(x.clone(), BF16)
    assert hi.dtype == lo.dtype == BF16
    one = (hi.double() - x.double()).abs() / x.double().abs()
    two = ((hi.double() + lo.double()) - x.double()).abs() / x.double().abs()
    assert 2**-10 < one.max() <= 2**-8  # bf16: 8 significant bits
    assert two.max() <= 2**-16


@pytest.mark.parametrize("chunk", [None, 8])
def test_the_cuda_gemm_path_runs_forward_and_backward_on_the_meta_device(monkeypatch, chunk):
    """The branch CUDA takes (torch.mm / torch.addmm with out_dtype, which have meta kernels but no CPU ones),
    run on meta tensors: forward and backward of the fp32 head, chunked and plain, give the shapes and dtypes
    the real path needs. The plain call needs its own autograd function: out_dtype GEMMs have no derivative."""
    from pipelinerl.trainer import model as model_mod

    monkeypatch.setattr(model_mod, "_out_dtype_gemm", lambda t: t.device.type == "meta")
    head = model_mod.LogprobHead(64, 300, dtype=BF16, device="meta")
    head.fp32 = True
    hidden = torch.empty(37, 64, dtype=BF16, device="meta", requires_grad=True)
    if chunk is None:
        logits = head(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (37, 300)
        out = logits.sum()
    else:
        out = model_mod.chunked_logprobs(head, hidden, torch.zeros(37, dtype=torch.long, device="meta"), 0.7, chunk)
        out = out.sum()
    out.backward()
    assert hidden.grad.dtype == BF16 and hidden.grad.shape == hidden.shape
    assert head.weight.grad.dtype == BF16 and head.weight.grad.shape == head.weight.shape
    assert head.bias.grad.dtype == BF16


def test_plain_fp32_head_gemms_take_the_bf16_weight_and_match_float64(monkeypatch):
    """head(hidden) with fp32 (trainer.logprob_chunk_tokens=null): one GEMM forward, two bf16 halves x two
    GEMMs backward; gradients as float64's within one bf16 rounding."""
    from pipelinerl.trainer import model as model_mod

    calls = []
    real = model_mod._matmul32
    monkeypatch.setattr(model_mod, "_matmul32", lambda a, b, acc=None: calls.append((a.dtype, b.dtype)) or
                        real(a, b, acc))
    monkeypatch.setattr(model_mod, "_gemm_operand", lambda weight: weight)
    head, hidden_NH, targets_N = _bf16_head(True)
    _, grads = _scored(head, hidden_NH, targets_N, 0.7, None)
    assert len(calls) == 5 and all(a == b == BF16 for a, b in calls), calls
    want = _reference64_grads(head, hidden_NH, targets_N, 0.7)
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got.double(), ref, rtol=2**-8, atol=1e-5)

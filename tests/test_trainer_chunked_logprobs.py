"""Chunked log-probs (model.chunked_logprobs, trainer.logprob_chunk_tokens) against a float64 reference:
values and gradients, at temperature 1 and 0.7, with chunk sizes that do and do not divide the tokens."""

import copy

import pytest
import torch

from pipelinerl.trainer.packing import Sample, pack

CPU = torch.device("cpu")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_head_equals_float64_log_softmax_in_values_and_gradients(temperature):
    """On a bare linear head: log-probs and the gradients wrt hidden states, weight and bias."""
    from pipelinerl.trainer.model import LogprobHead, chunked_logprobs, token_logprobs

    g = torch.Generator().manual_seed(0)
    N, H, V = 13, 16, 50
    head = LogprobHead(H, V)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g))  # peaked: the temperature matters
    hidden_NH = torch.randn(N, H, generator=g)
    targets_N = torch.randint(V, (N,), generator=g)
    weights_N = torch.randn(N, generator=g, dtype=torch.float64)  # d loss / d logprob_i

    def run(module, hidden, score):
        hidden = hidden.clone().requires_grad_(True)
        logprobs_N = score(module, hidden)
        (logprobs_N.double() * weights_N).sum().backward()
        return logprobs_N.detach(), [hidden.grad, module.weight.grad, module.bias.grad]

    def reference(module, hidden):
        return (module(hidden) / temperature).log_softmax(-1)[torch.arange(N), targets_N]

    want, want_grads = run(copy.deepcopy(head).double(), hidden_NH.double(), reference)
    unchunked, _ = run(copy.deepcopy(head), hidden_NH, lambda m, h: token_logprobs(m(h), targets_N, temperature))
    for chunk in (1, 4, 13, 1000):  # 4 does not divide 13
        got, got_grads = run(copy.deepcopy(head), hidden_NH,
                             lambda m, h, c=chunk: chunked_logprobs(m, h, targets_N, temperature, c))
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, unchunked, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        for name, a, b in zip(("hidden", "weight", "bias"), got_grads, want_grads, strict=True):
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5, msg=f"d/d{name}, chunk {chunk}")
    if temperature != 1.0:  # not vacuous: the temperature changes the answer
        assert (unchunked - token_logprobs(head(hidden_NH), targets_N, 1.0)).abs().max() > 0.1


def _samples():
    return [Sample([3, 4, 5], [6, 7, 8, 9, 10], index=0), Sample([10, 11], [12, 3, 14], index=1),
            Sample([5], [4, 4, 6, 7, 8, 9, 10, 11, 12], index=2)]  # 17 completion tokens


def _perturbed_model(tiny_model_dir, value_head):
    from transformers import AutoModelForCausalLM

    from pipelinerl.trainer.model import ValueHeadLM, enable_chunked_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    enable_chunked_logprobs(model)
    if value_head:
        model = ValueHeadLM(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # peaked distributions and a nonzero value head (so values reach the trunk)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _reference64(model, mb, temperature):
    """Float64 straightforward scoring: every row's logits, log_softmax(logits / T) at the targets."""
    from pipelinerl.trainer.model import ValueHeadLM

    ids, pos = mb.input_ids, mb.target_pos_N
    kwargs = {"input_ids": ids, "position_ids": mb.position_ids, "use_cache": False}
    if isinstance(model, ValueHeadLM):
        out = model(rows_K=pos - 1, **kwargs)
        logits, values = out.logits[0], out.values[0]
    else:
        logits, values = model(logits_to_keep=pos - 1, **kwargs).logits[0], None
    logprobs = (logits / temperature).log_softmax(-1)[torch.arange(len(pos)), ids[0, pos]]
    return logprobs, values


def _loss_and_grads(model, score):
    g = torch.Generator().manual_seed(2)
    logprobs_N, values_N = score(model)
    loss = (logprobs_N.double() * torch.randn(len(logprobs_N), generator=g, dtype=torch.float64)).sum()
    if values_N is not None:
        loss = loss + (values_N.double() * torch.randn(len(values_N), generator=g, dtype=torch.float64)).sum()
    model.zero_grad()
    loss.backward()
    grads = {n: p.grad.double().clone() for n, p in model.named_parameters()}
    return logprobs_N.detach().double(), None if values_N is None else values_N.detach().double(), grads


@pytest.mark.parametrize("value_head", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_completion_forward_equals_float64_reference(tiny_model_dir, value_head, temperature):
    """completion_forward on the tiny model, chunked (chunks that do and do not divide the 17 tokens) and
    not: log-probs, values and the gradient of every parameter against the float64 model's."""
    from pipelinerl.trainer.model import completion_forward

    model = _perturbed_model(tiny_model_dir, value_head)
    (mb,) = pack(_samples(), 64)
    want = _loss_and_grads(copy.deepcopy(model).double(), lambda m: _reference64(m, mb, temperature))
    unchunked = _loss_and_grads(model, lambda m: completion_forward(m, mb, CPU, temperature))
    for chunk in (None, 1, 5, 17, 2048):
        got = _loss_and_grads(model, lambda m, c=chunk: completion_forward(m, mb, CPU, temperature, c))
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[0], unchunked[0], rtol=1e-6, atol=1e-6)
        if value_head:
            torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
        else:
            assert got[1] is None
        assert got[2].keys() == want[2].keys()
        for name, truth in want[2].items():
            # as accurate as today's unchunked float32 path, up to rounding luck
            err = (got[2][name] - truth).abs().max().item()
            unchunked_err = (unchunked[2][name] - truth).abs().max().item()
            scale = truth.abs().max().item()
            assert err <= 2 * unchunked_err + 1e-6 * scale, f"{name}, chunk {chunk}: {err:.2e} from float64, " \
                                                            f"unchunked {unchunked_err:.2e} (max |grad| {scale:.2e})"
            assert err <= 1e-4 * scale, f"{name}, chunk {chunk}: {err:.2e} from float64 (max |grad| {scale:.2e})"


def test_chunked_scoring_without_gradients(tiny_model_dir):
    """Under no_grad (reference scoring) the chunks run directly and give the same log-probs."""
    from pipelinerl.trainer.model import completion_logprobs

    model = _perturbed_model(tiny_model_dir, value_head=False)
    (mb,) = pack(_samples(), 64)
    with torch.no_grad():
        want = completion_logprobs(model, mb, CPU, 0.7)
        got = completion_logprobs(model, mb, CPU, 0.7, chunk_tokens=4)
    assert not got.requires_grad
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_chunked_logprobs_refuse_a_head_that_is_not_linear():
    from pipelinerl.trainer.model import enable_chunked_logprobs

    class Odd(torch.nn.Module):
        def get_output_embeddings(self):
            return torch.nn.Identity()

    with pytest.raises(ValueError, match="logprob_chunk_tokens=null"):
        enable_chunked_logprobs(Odd())


def test_logprob_chunk_tokens_must_be_positive_or_null():
    from pipelinerl.config import TrainerConfig

    assert TrainerConfig(logprob_chunk_tokens=None).logprob_chunk_tokens is None
    with pytest.raises(ValueError, match="trainer.logprob_chunk_tokens"):
        TrainerConfig(logprob_chunk_tokens=0)


def test_chunked_head_scores_several_targets_per_row_like_float64():
    """Targets [N, K] (rl.teacher_top_k: the sampled token and the teacher's top-k, which may repeat it): [N, K]
    log-probs and the gradients of hidden states, weight and bias, against float64 log_softmax gathered."""
    from pipelinerl.trainer.model import LogprobHead, chunked_logprobs, token_logprobs

    g = torch.Generator().manual_seed(3)
    N, H, V, K = 11, 8, 20, 4
    head = LogprobHead(H, V)
    hidden_NH = torch.randn(N, H, generator=g)
    targets_NK = torch.randint(V, (N, K), generator=g)
    targets_NK[:, 2] = targets_NK[:, 0]  # a repeated target: both gradients add
    weights_NK = torch.randn(N, K, generator=g, dtype=torch.float64)

    def run(module, hidden, score):
        hidden = hidden.clone().requires_grad_(True)
        logprobs_NK = score(module, hidden)
        (logprobs_NK.double() * weights_NK).sum().backward()
        return logprobs_NK.detach(), [hidden.grad, module.weight.grad, module.bias.grad]

    want, want_grads = run(copy.deepcopy(head).double(), hidden_NH.double(),
                           lambda m, h: (m(h) / 0.7).log_softmax(-1).gather(-1, targets_NK))
    for score in [lambda m, h: token_logprobs(m(h), targets_NK, 0.7)] + [
            lambda m, h, c=c: chunked_logprobs(m, h, targets_NK, 0.7, c) for c in (1, 3, 1000)]:
        got, got_grads = run(copy.deepcopy(head), hidden_NH, score)
        assert got.shape == (N, K)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        for name, a, b in zip(("hidden", "weight", "bias"), got_grads, want_grads, strict=True):
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5, msg=f"d/d{name}")


def test_completion_forward_scores_the_teachers_top_k_beside_each_token(tiny_model_dir):
    """A micro-batch with a `teacher_top_ids` field (k per token): [N, 1 + k] log-probs, column 0 the completion
    token's (as without the field), the others those of the listed tokens, chunked or not."""
    from pipelinerl.trainer.model import completion_forward

    model = _perturbed_model(tiny_model_dir, value_head=False)
    samples = _samples()
    g = torch.Generator().manual_seed(4)
    for s in samples:
        s.token_fields["teacher_top_ids"] = torch.randint(15, (len(s.completion_ids), 3), generator=g).tolist()
    (mb,) = pack(samples, 64)
    (plain,) = pack(_samples(), 64)
    want, _ = _reference64(copy.deepcopy(model).double(), mb, 1.0)
    with torch.no_grad():
        logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids, logits_to_keep=mb.target_pos_N - 1,
                       use_cache=False).logits[0].double()
        top_want = logits.log_softmax(-1).gather(-1, mb.fields_N["teacher_top_ids"].long())
        for chunk in (None, 5):
            got = completion_forward(model, mb, CPU, 1.0, chunk)[0]
            assert got.shape == (17, 4)
            torch.testing.assert_close(got[:, 0], completion_forward(model, plain, CPU, 1.0, chunk)[0])
            torch.testing.assert_close(got[:, 0].double(), want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got[:, 1:].double(), top_want, rtol=1e-5, atol=1e-5)

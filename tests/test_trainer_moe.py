"""The trainer's MoE routers (trainer/moe.py) on the tiny Qwen3-MoE model: replay, statistics, the auxiliary loss.

References: the model's own forward (replaying its own routing must change nothing, bit for bit), causality
(which positions a changed routing may reach, beyond float32 rounding), a float64 re-computation of a sparse block
with replayed experts (gradients of the router), transformers' load_balancing_loss_func, and loads counted by hand.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from pipelinerl.config import TinyModelConfig
from pipelinerl.tiny.model import build_tokenizer, tiny_config
from pipelinerl.trainer.moe import RouterTap, find_routers, load_balancing_loss, load_stats, slot_counts

SHAPE = TinyModelConfig(num_experts=8, experts_per_token=2, moe_intermediate_size=32)
T = 12  # tokens in the test sequence


@pytest.fixture(scope="module")
def lm():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(SHAPE, build_tokenizer()), dtype=torch.float32)
    with torch.no_grad():  # routers far from uniform, so that routing is decided, not tied
        for router in find_routers(model):
            router.weight.normal_(0, 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def tap(lm):
    return RouterTap(lm)


def _ids() -> torch.Tensor:
    return torch.randint(3, 17, (1, T), generator=torch.Generator().manual_seed(1))


def _forward(lm, tap, replay=None):
    tap.start()
    with tap.replaying(replay):
        logits = lm(input_ids=_ids(), use_cache=False).logits[0]
    return logits, [layer.experts.clone() for layer in tap.layers]


def test_a_dense_model_has_no_routers():
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_config(tiny_config(TinyModelConfig(), build_tokenizer()))
    assert find_routers(dense) == []


def test_replaying_the_trainers_own_routing_reproduces_its_forward_bit_for_bit(lm, tap):
    own_logits, own = _forward(lm, tap)
    assert len(own) == SHAPE.num_layers and own[0].shape == (T, 2)
    replay = torch.stack(own, 1)  # [T, L, k]
    again, replayed = _forward(lm, tap, replay)
    assert torch.equal(again, own_logits)
    assert all(torch.equal(a, b) for a, b in zip(replayed, own))
    # the order of a token's k experts does not matter either
    swapped, _ = _forward(lm, tap, replay.flip(-1))
    assert torch.equal(swapped, own_logits)


def test_a_different_routing_changes_exactly_the_tokens_it_reaches(lm, tap):
    own_logits, own = _forward(lm, tap)
    last = SHAPE.num_layers - 1
    replay = torch.full((T, SHAPE.num_layers, 2), -1)
    # the last layer, token 5: another expert pair; only that token's output can change
    unused = [e for e in range(SHAPE.num_experts) if e not in own[last][5].tolist()]
    replay[5, last] = torch.tensor(unused[:2])
    logits, routed = _forward(lm, tap, replay)
    changed = _changed(logits, own_logits)
    assert changed.tolist() == [t == 5 for t in range(T)]
    assert routed[last][5].tolist() == unused[:2]
    # the first layer, token 7: attention carries it to every later position and to none before
    replay = torch.full((T, SHAPE.num_layers, 2), -1)
    unused = [e for e in range(SHAPE.num_experts) if e not in own[0][7].tolist()]
    replay[7, 0] = torch.tensor(unused[:2])
    logits, _ = _forward(lm, tap, replay)
    changed = _changed(logits, own_logits)
    assert changed[:7].sum() == 0 and changed[7:].all()


def _changed(logits: torch.Tensor, own_logits: torch.Tensor) -> torch.Tensor:
    """[T] bool: the positions whose logits moved beyond float32 rounding. A token's experts changed moves its
    logits by ~1e-2; the other tokens an expert GEMM holds change count, so their rows may round otherwise (seen:
    up to 9e-8 with transformers 5.19's grouped GEMM and its eager loop alike)."""
    return ((logits - own_logits).abs() > 1e-5).any(-1)


def test_replayed_gates_come_from_the_dense_router_logits_with_their_float64_gradient(lm, tap):
    """One sparse block on its own: output and router gradient against float64 maths, with every token replayed
    onto experts the router does not rank first (the gradient must still reach their logits)."""
    block = lm.model.layers[0].mlp
    router, experts = block.gate, block.experts
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(1, T, SHAPE.hidden_size, generator=g)
    with torch.no_grad():
        own = torch.topk(F.linear(hidden[0], router.weight), 2).indices
    replay_Tk = torch.stack([torch.tensor([e for e in range(8) if e not in row][:2]) for row in own.tolist()])
    weight = torch.randn(T, SHAPE.hidden_size, generator=g)

    router.zero_grad()
    tap.start()
    with tap.replaying(torch.stack([replay_Tk] + [torch.full_like(replay_Tk, -1)], 1)):  # layer 0 replayed
        out = block(hidden)
    (out[0] * weight).sum().backward()
    grad = router.weight.grad.clone()

    w64 = router.weight.detach().double().requires_grad_()
    h64 = hidden[0].double()
    probs = torch.softmax(h64 @ w64.T, -1)
    gates = probs.gather(-1, replay_Tk)
    gates = gates / gates.sum(-1, keepdim=True)
    ref = torch.zeros_like(h64)
    for t in range(T):
        for slot, e in enumerate(replay_Tk[t].tolist()):
            gate_up = experts.gate_up_proj[e].detach().double()
            g_, u_ = (h64[t] @ gate_up.T).chunk(2)
            ref[t] += gates[t, slot] * (experts.down_proj[e].detach().double() @ (F.silu(g_) * u_))
    (ref * weight.double()).sum().backward()
    torch.testing.assert_close(out[0].double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), w64.grad, rtol=1e-4, atol=1e-6)
    assert (grad.abs().sum(-1) > 0).all()  # every expert's router row moves, the replayed ones included


def test_replayed_routing_of_the_wrong_shape_or_experts_is_refused(tap):
    with pytest.raises(ValueError, match="MoE layers"), tap.replaying(torch.zeros(T, 3, 2, dtype=torch.long)):
        pass
    with pytest.raises(ValueError, match="expert 8"), tap.replaying(torch.full((T, 2, 2), 8)):
        pass


def test_router_stats_count_the_routed_slots(lm, tap):
    from pipelinerl.trainer.moe import LayerRouting

    tap.start()
    uniform = torch.arange(16).reshape(8, 2) % 8  # each expert twice
    one_sided = torch.tensor([[0, 1]] * 6 + [[0, 2]] * 2)  # expert 0: 8 of 16 slots, 1: 6, 2: 2
    logits = torch.zeros(8, 8)
    tap.layers = [LayerRouting(logits, uniform), LayerRouting(logits, one_sided)]
    slots = slot_counts(tap)
    assert slots[1, :3].tolist() == [8, 6, 2] and slots.sum() == 32
    stats = load_stats(slots + slots)  # two micro-batches' counts: the same loads
    assert stats["moe/layer0/load_entropy"] == pytest.approx(math.log(8))
    assert stats["moe/layer0/load_max_over_mean"] == pytest.approx(1.0)
    assert [stats[f"moe/layer1/load_e{e}"] for e in range(4)] == [0.5, 0.375, 0.125, 0.0]
    entropy = -(0.5 * math.log(0.5) + 0.375 * math.log(0.375) + 0.125 * math.log(0.125))
    assert stats["moe/layer1/load_entropy"] == pytest.approx(entropy)
    assert stats["moe/layer1/load_max_over_mean"] == pytest.approx(4.0)
    assert stats["moe/load_max_over_mean"] == pytest.approx(4.0)


def test_the_load_balancing_loss_is_transformers_own_without_replay(lm, tap):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    tap.start()
    out = lm(input_ids=_ids(), use_cache=False, output_router_logits=True)
    ours = load_balancing_loss(tap)
    theirs = load_balancing_loss_func(out.router_logits, SHAPE.num_experts, 2)
    torch.testing.assert_close(ours, theirs.float())
    ours.backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in tap.routers)


def test_routing_compared_but_not_applied_changes_nothing_and_counts_the_differing_token_layers(lm, tap):
    own_logits, own = _forward(lm, tap)
    replay = torch.stack(own, 1).clone()
    tap.start()
    with tap.replaying(replay, apply=False):
        lm(input_ids=_ids(), use_cache=False)
    assert tap.compared.tolist() == [T * 2, 0]  # every token-layer given, none differs from the trainer's own
    last = SHAPE.num_layers - 1
    unused = [e for e in range(SHAPE.num_experts) if e not in own[last][5].tolist()]
    replay[5, last] = torch.tensor(unused[:2])
    replay[6, 0] = replay[6, 0].flip(-1)  # the same set in another order: not a difference
    replay[:2] = -1  # not given: neither counted nor compared
    tap.start()
    with tap.replaying(replay, apply=False):
        logits = lm(input_ids=_ids(), use_cache=False).logits[0]
    assert torch.equal(logits, own_logits)
    assert tap.compared.tolist() == [(T - 2) * 2, 1]
    with tap.replaying(replay):  # applied: the same count, and now the output moves
        tap.start()
        assert not torch.equal(lm(input_ids=_ids(), use_cache=False).logits[0], own_logits)
    assert tap.compared.tolist() == [(T - 2) * 2, 1]

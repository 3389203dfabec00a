"""Mixture-of-experts routers in the trainer: their statistics, the load-balancing loss, and routing replay.

Pure torch over an HF MoE causal LM (Qwen3-MoE, Qwen2-MoE: every sparse layer's `mlp.gate` is a top-k
router returning (logits, top-k gate weights, top-k expert ids)). `RouterTap(lm)` wraps each router's forward
in place (the same module, parameters and hooks, so ZeRO-3 and FSDP2 still gather its weight around the call)
and, for every forward the trainer runs:

- records each layer's router logits and chosen experts (`RouterTap.layers`), from which `slot_counts` and
  `load_stats` give the expert load (fraction of routed slots per expert), its entropy and max-over-mean per
  layer, and `load_balancing_loss` the auxiliary load-balancing loss (rl.moe_aux_coef);
- replays given routing (rl.routing_replay = r3: rollout routing replay), or only compares the trainer's own
  with it (`compared`: moe/routing_mismatch). Inside `with tap.replaying(ids)`,
  ids [T, L, k] (-1: the trainer routes that token itself), each replayed token goes to the experts the server
  chose, with gate weights softmax(dense router logits) gathered at those experts and renormalised as the
  router's own (norm_topk_prob). The gradient therefore reaches every router logit through the dense softmax:
  taking the weights from probabilities already zeroed outside the trainer's own top-k would give an expert
  the server chose but the trainer did not a weight of 0 and no gradient.

Replaying the trainer's own routing reproduces its forward bit for bit: the gathered probabilities are the
values top-k returned, put in top-k's order (descending probability), so neither the order of a token's k ids
in the stream nor the kernels' summation order changes the result.
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def find_routers(lm: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k routers of an HF MoE LM in layer order ([] for a dense model)."""
    return [m for m in lm.modules() if _is_router(m)]


def _is_router(module: torch.nn.Module) -> bool:
    return (type(module).__name__.endswith("TopKRouter") and hasattr(module, "top_k")
            and hasattr(module, "num_experts") and isinstance(getattr(module, "weight", None), torch.Tensor))


@dataclass
class LayerRouting:
    """One router call: logits [T, E] (the router's dtype, in the autograd graph) and chosen experts [T, k] long."""

    logits: torch.Tensor
    experts: torch.Tensor


class RouterTap:
    """Wraps an MoE LM's routers (see the module's docstring); `layers` holds the latest forward's routing."""

    def __init__(self, lm: torch.nn.Module):
        self.routers = find_routers(lm)
        self.layers: list[LayerRouting] = []
        self._replay: torch.Tensor | None = None  # [T, L, k] long, -1: not replayed
        self._apply = True  # replay the routing; False: only compare it with the trainer's own (`compared`)
        self.compared = torch.zeros(2, dtype=torch.float64)  # since `start`: (token-layer routings given, of
        #                                                       them those whose expert set the trainer's differs)
        for index, router in enumerate(self.routers):
            router.forward = types.MethodType(_routing_forward(self, index), router)

    @property
    def num_experts(self) -> int:
        return self.routers[0].num_experts

    @property
    def top_k(self) -> int:
        return self.routers[0].top_k

    def start(self) -> None:
        """Forget the previous forward's routing and comparison (call before each forward)."""
        self.layers = [None] * len(self.routers)
        self.compared = torch.zeros(2, dtype=torch.float64)

    @contextmanager
    def replaying(self, ids_TLk: torch.Tensor | None, apply: bool = True) -> Iterator[None]:
        """Route the next forwards' tokens by ids_TLk ([T, L, k], -1 = the trainer's own choice; None: no replay);
        with apply=False, only count how often the trainer's own top-k differs from them (`compared`). Keep it
        open through backward: gradient checkpointing re-runs the forward there."""
        if ids_TLk is not None:
            expected = (len(self.routers), self.top_k)
            if tuple(ids_TLk.shape[1:]) != expected:
                raise ValueError(f"replayed routing has shape {tuple(ids_TLk.shape)}; this model needs [tokens, "
                                 f"{expected[0]} MoE layers, top-{expected[1]}]")
            if int(ids_TLk.max()) >= self.num_experts:
                raise ValueError(f"replayed routing names expert {int(ids_TLk.max())}; this model has "
                                 f"{self.num_experts}")
        self._replay, self._apply = ids_TLk, apply
        try:
            yield
        finally:
            self._replay, self._apply = None, True


def replay_ids(tap: RouterTap, mb, routed_NW: torch.Tensor) -> torch.Tensor:
    """A packed micro-batch's (packing.MicroBatch) routing to replay, [T, L, k] long on the CPU, from its
    completion tokens' served routing routed_NW [N, L x k] (the stream's `routed_experts` token field): token i's
    routing is that of the row whose logits chose it (the server's forward row), target_pos_N - 1; -1 elsewhere."""
    layers, k = len(tap.routers), tap.top_k
    if routed_NW.shape[1] != layers * k:
        raise ValueError(f"the stream's routed experts hold {routed_NW.shape[1]} ids per token; this model "
                         f"routes {layers} MoE layers x top-{k}")
    ids_TLk = torch.full((mb.num_tokens, layers, k), -1, dtype=torch.long)
    ids_TLk[mb.target_pos_N.cpu() - 1] = routed_NW.long().cpu().view(-1, layers, k)
    return ids_TLk


def _routing_forward(tap: RouterTap, index: int):
    def forward(router, hidden_states):
        hidden_TH = hidden_states.reshape(-1, router.hidden_dim)
        logits_TE = F.linear(hidden_TH, router.weight)
        probs_TE = torch.softmax(logits_TE, dtype=torch.float, dim=-1)
        gates_Tk, experts_Tk = torch.topk(probs_TE, router.top_k, dim=-1)
        if tap._replay is not None:
            replay_Tk = tap._replay[:, index].to(experts_Tk.device).long()
            if len(replay_Tk) != len(experts_Tk):
                raise ValueError(f"replayed routing covers {len(replay_Tk)} tokens, the forward has "
                                 f"{len(experts_Tk)}")
            replayed_T = (replay_Tk >= 0).all(-1)
            differs_T = (experts_Tk.sort(-1).values != replay_Tk.sort(-1).values).any(-1) & replayed_T
            tap.compared += torch.stack([replayed_T.sum(), differs_T.sum()]).double().cpu()
            if tap._apply:
                experts_Tk = torch.where(replayed_T[:, None], replay_Tk, experts_Tk)
                # in top-k's order (descending probability): the experts' kernels may sum a token's k outputs in
                # slot order (transformers 5.19 does), and the trainer's own routing must come out bit for bit
                gates_Tk, order_Tk = probs_TE.gather(-1, experts_Tk).sort(dim=-1, descending=True, stable=True)
                experts_Tk = experts_Tk.gather(-1, order_Tk)
        if router.norm_topk_prob:
            gates_Tk = gates_Tk / gates_Tk.sum(dim=-1, keepdim=True)
        if tap.layers:
            tap.layers[index] = LayerRouting(logits_TE, experts_Tk.detach())
        return logits_TE, gates_Tk.to(logits_TE.dtype), experts_Tk

    return forward


def load_balancing_loss(tap: RouterTap) -> torch.Tensor:
    """The latest forward's auxiliary load-balancing loss (Switch Transformer), as transformers computes it for
    these models (`load_balancing_loss_func`, every layer's tokens pooled) but over the experts the tokens were
    actually routed to (replayed ones included): E x sum_e f_e x P_e, f_e the routed slots of expert e per token
    (summing to k), P_e its mean router probability. k when the load is uniform; differentiable through P."""
    slots_E = sum(torch.bincount(layer.experts.reshape(-1), minlength=tap.num_experts) for layer in tap.layers)
    probs_E = sum(torch.softmax(layer.logits.float(), dim=-1).sum(0) for layer in tap.layers)
    rows = sum(len(layer.experts) for layer in tap.layers)
    return tap.num_experts * (slots_E.float() / rows * probs_E / rows).sum()


def slot_counts(tap: RouterTap) -> torch.Tensor:
    """[L, E] float64: the routed slots each expert of each MoE layer took in the latest forward (zeros before
    any). Sums over micro-batches and ranks are the step's; `load_stats` summarises them."""
    counts = torch.zeros(len(tap.routers), tap.num_experts, dtype=torch.float64)
    for i, layer in enumerate(tap.layers or []):
        if layer is not None:
            counts[i] = torch.bincount(layer.experts.reshape(-1).cpu(), minlength=tap.num_experts).double()
    return counts


def router_stats(tap: RouterTap | None, aux_loss: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A micro-batch's router statistics, summed over micro-batches and ranks by the loop: routed slots
    (`slot_counts`), the load-balancing loss share, and the comparison with the servers' routing (`compared`).
    Without a forward (`aux_loss` None: a rank with nothing to train) the same keys at zero; {} for a dense model."""
    if tap is None:
        return {}
    if aux_loss is None:
        return {"moe_slots": slot_counts(tap) * 0, "moe_aux_loss": torch.zeros((), dtype=torch.float64),
                "moe_compared": torch.zeros(2, dtype=torch.float64)}
    return {"moe_slots": slot_counts(tap), "moe_aux_loss": aux_loss, "moe_compared": tap.compared.clone()}


def load_stats(slots_LE: torch.Tensor) -> dict[str, float]:
    """Per MoE layer i: moe/layer{i}/load_e{e} (the fraction of its routed slots expert e took), moe/layer{i}/
    load_entropy (in nats; log E when uniform) and moe/layer{i}/load_max_over_mean (1 when uniform, E when one
    expert takes every slot); moe/load_max_over_mean is the largest over the layers. Top-k routing has no
    capacity limit here (neither transformers' nor vLLM's kernels drop tokens), so there is no dropped count."""
    stats: dict[str, float] = {}
    num_experts = slots_LE.shape[1]
    for i, slots_E in enumerate(slots_LE):
        load_E = slots_E / slots_E.sum().clamp(min=1)
        for e, share in enumerate(load_E.tolist()):
            stats[f"moe/layer{i}/load_e{e}"] = share
        stats[f"moe/layer{i}/load_entropy"] = -sum(p * math.log(p) for p in load_E.tolist() if p > 0)
        stats[f"moe/layer{i}/load_max_over_mean"] = float(load_E.max() * num_experts)
    stats["moe/load_max_over_mean"] = max(stats[f"moe/layer{i}/load_max_over_mean"] for i in range(len(slots_LE)))
    return stats

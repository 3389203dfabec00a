"""What every trainer backend shares, whatever shards the model: construction, the LM's preparation, the
padded accumulation, and the weights that leave the trainer (publication, gathered copies, the HF folder).

A backend subclasses `BackendBase` and supplies how the model is built and sharded (`init`), one backward
(`backward`), the optimizer step, its own state files, and two views of the LM's parameters that need no
whole-model gather: `named_shapes` (full shapes, no collective) and `gathered_parameters` (full tensors one
module at a time, a collective every rank runs in the same order).

Loss weighting (contract.Trainer.accumulate). A micro-batch's loss is its share of the step's loss, so the
step's gradient is the plain sum of micro-batch gradients over every rank; each backend reduces so. Both
backends reduce gradients on every micro-batch's backward (ZeRO-2/3; FSDP2's reduce-scatter), so every rank
must run the same number of them: `accumulate` pads the shorter ranks with zero-loss micro-batches.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from pipelinerl.config import TrainerConfig
from pipelinerl.dtypes import dtype_name
from pipelinerl.trainer.contract import LossFn, WeightPublisher
from pipelinerl.trainer.dist import DistInfo, all_reduce_max, all_reduce_sum
from pipelinerl.trainer.lora import WeightGroup, adapter_tensors, add_adapters, weight_groups
from pipelinerl.trainer.model import ValueHeadLM, completion_forward, enable_chunked_logprobs
from pipelinerl.trainer.moe import RouterTap, find_routers, load_balancing_loss, replay_ids, router_stats
from pipelinerl.trainer.packing import MicroBatch, padding_micro_batch

# Files of an HF folder that describe weights; everything else (config, tokenizer) is copied as-is.
_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


class BackendBase:
    """contract.Trainer's shared part (constructor as the contract says). `publisher` (rank 0 only) is a
    contract.WeightPublisher, or None to gather without publishing (benchmarks, tests). `value_head`: train a
    critic head beside the LM (ValueHeadLM); `forward` and `accumulate` then also give the values.
    `temperature`: the rollouts' sampling temperature (actor.sampling.temperature); completion log-probs are
    scored at it, like the behaviour log-probs, cfg.logprob_chunk_tokens rows at a time (model.LogprobHead:
    scoring is a call of the LM head module, so a sharding framework's hooks on it gather its weight).
    `lm_head_fp32` (model.lm_head_fp32): the LM head's logits in float32, as on the servers. A mixture of experts
    gets a RouterTap (moe.py): every micro-batch's routed-slot counts go into its statistics, and its load-balancing
    loss, weighted by `moe_aux_coef` (rl.moe_aux_coef) and the micro-batch's share of the step's tokens, into its
    loss (logged either way); a micro-batch whose tokens carry the servers' routing (a `routed_experts` field)
    is routed by it with `routing_replay` r3 (rl.routing_replay), and either way compared with the trainer's own."""

    # transformers' gradient_checkpointing_kwargs (trainer.gradient_checkpointing); None: its default
    checkpointing_kwargs: dict | None = None

    def __init__(self, cfg: TrainerConfig, dist: DistInfo, dtype: str = "float32",
                 publisher: WeightPublisher | None = None, value_head: bool = False, temperature: float = 1.0,
                 lm_head_fp32: bool = False, moe_aux_coef: float = 0.0, routing_replay: str = "none"):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r} (actor.sampling.temperature)")
        self.cfg, self.dist, self.dtype, self.publisher = cfg, dist, dtype, publisher
        self.value_head, self.temperature, self.lm_head_fp32 = value_head, temperature, lm_head_fp32
        self.lora = cfg.lora.rank > 0
        self.moe_aux_coef, self.routing_replay = moe_aux_coef, routing_replay
        self.router_tap: RouterTap | None = None  # set by `prepare` for a mixture of experts
        self.model_path: Path | None = None

    @property
    def device(self) -> torch.device:
        return torch.device(f"cuda:{self.dist.local_rank}") if self.dist.backend == "nccl" else torch.device("cpu")

    @property
    def model(self) -> torch.nn.Module:
        """What the forward pass calls: the (sharded) LM, or ValueHeadLM around it."""
        raise NotImplementedError

    @property
    def lm(self) -> torch.nn.Module:
        """The HF causal LM (without the value head)."""
        return self.model.lm if self.value_head else self.model

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """The loaded HF LM made ready for training, before any sharding: no KV cache, gradient checkpointing
        (trainer.gradient_checkpointing), the chunked / float32 LM head, LoRA adapters (trainer.lora; the
        base frozen), and the value head around it (trained in full)."""
        model.config.use_cache = False
        if self.cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=self.checkpointing_kwargs)
        if self.cfg.logprob_chunk_tokens is not None or self.lm_head_fp32:
            enable_chunked_logprobs(model, fp32=self.lm_head_fp32)
        if find_routers(model):
            self.router_tap = RouterTap(model)
        elif self.moe_aux_coef:
            raise ValueError("rl.moe_aux_coef is set but the model has no mixture-of-experts router")
        if self.lora:
            model = add_adapters(model, self.cfg.lora)
            if self.cfg.gradient_checkpointing:  # frozen embeddings: a checkpointed layer's input needs a grad
                model.enable_input_require_grads()
        return ValueHeadLM(model) if self.value_head else model

    def trainable(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        """The parameters the optimizer steps: all of them, or with LoRA the adapters (and a value head)."""
        return [p for p in model.parameters() if p.requires_grad]

    def forward(self, micro_batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.router_tap is not None:
            self.router_tap.start()
        return completion_forward(self.model, micro_batch, self.device, self.temperature,
                                  self.cfg.logprob_chunk_tokens)

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def accumulate(self, micro_batches: list[MicroBatch], loss_fn: LossFn) -> list[dict]:
        """Forward + loss + backward over this rank's micro-batches, padded to the ranks' maximum count.
        loss_fn(micro_batch, new_logprobs_N, values_N) -> (loss share, stats); values_N is None without a
        value head, else aligned with new_logprobs_N (see `completion_forward`), and the loss must use it so
        that every rank reduces the head's gradients. Returns the real batches' stats."""
        count = max(all_reduce_max(len(micro_batches)), 1)  # >= 1 pass: the optimizer step needs gradients
        first = micro_batches[0] if micro_batches else None
        pad = padding_micro_batch(first.fields_N, first.seq_fields_S) if first else padding_micro_batch()
        step_tokens = all_reduce_sum([sum(mb.num_tokens for mb in micro_batches)])[0] if self.router_tap else 0
        stats = []
        for mb in micro_batches + [pad] * (count - len(micro_batches)):
            with self._routing(mb):
                new_N, values_N = self.forward(mb)
                if mb.is_padding:  # touches every parameter, adds nothing
                    loss = (new_N.sum() if values_N is None else new_N.sum() + values_N.sum()) * 0.0
                else:
                    loss, mb_stats = loss_fn(mb, new_N, values_N)
                    if self.router_tap is not None:
                        loss = loss + self._router_terms(mb_stats, mb.num_tokens / max(step_tokens, 1))
                    stats.append(mb_stats)
                self.backward(loss)
        return stats

    def _routing(self, mb: MicroBatch):
        """The servers' routing of the micro-batch's completion tokens, replayed (r3) or compared, through its
        forward and backward; nothing to do without a router tap or routing."""
        routed_NW = mb.fields_N.get("routed_experts")
        if self.router_tap is None or routed_NW is None:
            return contextlib.nullcontext()
        ids_TLk = replay_ids(self.router_tap, mb, routed_NW)
        return self.router_tap.replaying(ids_TLk.to(self.device), apply=self.routing_replay == "r3")

    def _router_terms(self, mb_stats: dict, share: float) -> torch.Tensor:
        """A micro-batch's router statistics (added to mb_stats) and its share of the load-balancing loss."""
        aux = load_balancing_loss(self.router_tap) * share
        mb_stats.update(router_stats(self.router_tap, aux.detach().double()))
        return aux * self.moe_aux_coef


    def weight_groups(self) -> Iterator[WeightGroup]:
        """The LM's weights (HF names, no value head) as groups of parameters gathered together, in a fixed
        order shared by metas and tensors; with LoRA an adapted layer's group gives its merged weight."""
        return weight_groups(self.lm, self.lora)

    def full_shape(self, p: torch.nn.Parameter) -> torch.Size:
        """A parameter's full shape, whatever this rank holds of it (no collective)."""
        raise NotImplementedError

    def wire_dtype(self, p: torch.nn.Parameter) -> torch.dtype:
        """The dtype a parameter's full tensor leaves the trainer in (the one servers load)."""
        raise NotImplementedError

    def gathered_groups(self, groups: Iterator[WeightGroup]) -> Iterator[tuple[WeightGroup, list[torch.Tensor]]]:
        """Each group with the full tensors of its params, one group at a time: a collective every rank must
        exhaust. The tensors are valid until the next group is requested."""
        raise NotImplementedError

    def named_shapes(self) -> list[tuple[str, str, list[int]]]:
        """(HF name, dtype on the wire, full shape) of every LM weight, without gathering."""
        return [(name, dtype_name(self.wire_dtype(p)), list(self.full_shape(p)))
                for group in self.weight_groups() for name, p in zip(group.names, group.shapes_of)]

    def gathered_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full LM weights in named_shapes' order and dtypes, one group at a time: a collective every rank
        must exhaust. Each tensor is valid until the next one is requested."""
        for group, full in self.gathered_groups(self.weight_groups()):
            for name, p, tensor in zip(group.names, group.shapes_of, group.outputs(full)):
                yield name, tensor.to(self.wire_dtype(p))

    def publish_weights(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        tensors = (t for _, t in self.gathered_parameters())
        if self.dist.is_main and self.publisher is not None:
            from pipelinerl.weights import TensorMeta

            metas = [TensorMeta(name=n, dtype=d, shape=s) for n, d, s in self.named_shapes()]
            nbytes = float(self.publisher.publish(version, metas, tensors).bytes)
        else:
            nbytes = float(sum(t.numel() * t.element_size() for t in tensors))
        return {"bytes": nbytes, "publish_s": time.perf_counter() - start}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """CPU copies of all LM weights (merged with LoRA) on rank 0 (empty elsewhere); a collective."""
        return self._gathered_state()[0]

    def _gathered_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """full_state_dict, and with LoRA the adapter's tensors in peft's names (rank 0; a collective)."""
        state, adapters = {}, []
        for group, full in self.gathered_groups(self.weight_groups()):
            if not self.dist.is_main:
                continue
            for name, p, tensor in zip(group.names, group.shapes_of, group.outputs(full)):
                state[name] = tensor.detach().to("cpu", self.wire_dtype(p), copy=True)
            if group.scaling is not None:
                adapters.append((group, [t.detach().to("cpu", copy=True) for t in full]))
        return state, adapter_tensors(adapters)

    def save_hf(self, out_dir: Path) -> None:
        """HF folder loadable by transformers and vLLM: gathered weights (merged with LoRA) + the source's
        config/tokenizer (its `architectures` too: a wrapped model's class name is the framework's, which vLLM
        does not know). With LoRA, also the adapter alone in peft's format beside it (`adapter/`: load it
        over the run's base model with peft.PeftModel.from_pretrained)."""
        state, adapters = self._gathered_state()
        if not self.dist.is_main:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        for src in self.model_path.iterdir():
            if src.is_file() and not any(src.match(p) for p in _WEIGHT_FILES):
                shutil.copy2(src, out_dir / src.name)
        self.lm.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
        source = json.loads((self.model_path / "config.json").read_text())
        written = json.loads((out_dir / "config.json").read_text())
        if "architectures" in source and written.get("architectures") != source["architectures"]:
            written["architectures"] = source["architectures"]
            (out_dir / "config.json").write_text(json.dumps(written, indent=2) + "\n")
        if self.lora:
            self.save_adapter(out_dir.with_name("adapter"), adapters)

    def save_adapter(self, out_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
        """peft's adapter folder: adapter_config.json (the run's trainer.lora, base = model.path) and
        adapter_model.safetensors."""
        from safetensors.torch import save_file

        from pipelinerl.trainer.lora import peft_config

        out_dir.mkdir(parents=True, exist_ok=True)
        config = peft_config(self.cfg.lora)
        config.base_model_name_or_path = str(self.model_path)
        config.save_pretrained(str(out_dir))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "adapter_model.safetensors"))

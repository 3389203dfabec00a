"""The trainer contract on PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`): NCCL on GPUs, gloo on CPU.

Sharding. Each decoder layer (the classes the HF model lists in `_no_split_modules`) is one FSDP unit, and
the root holds the rest: embeddings, final norm, LM head and any value head. A unit's parameters are
all-gathered around its forward and its backward and resharded after; the root's stay gathered from its
forward to its backward, so the chunked LM head (model.LogprobHead), called after the LM's forward, sees its
full weight and its gradient is reduced with the root's.

Precision. Master weights of what the optimizer steps and its state are float32 shards (DTensors) on every
device; the units compute in model.dtype (bfloat16 on GPUs) and reduce gradients in float32
(MixedPrecisionPolicy). A frozen parameter (LoRA's base, trainer.lora) has no master copy: its shard stays in
model.dtype, half the bytes in bfloat16 (FSDP2 all-gathers a unit of mixed dtypes once param_dtype casts
them all to model.dtype). Buffers (rotary frequencies) are float32. With model.dtype float32 (CPU)
everything is float32.

Loading. Every rank reads the HF checkpoint into host memory in model.dtype (a 7B model: 15 GB), then casts
and shards it one unit at a time: each rank keeps its float32 shard on its device and frees the rest.

Loss weighting (base.py): every unit reduce-scatters with a plain sum (divide factor 1, sum reduction), which
is the contract's sum over ranks; gradients are reduced on every micro-batch's backward.

Weights leave one parameter at a time: `full_tensor()` all-gathers it (every rank, same order), cast to
model.dtype, the dtype the servers load; the whole model is never gathered on one rank.

State. torch.distributed.checkpoint (DCP) writes each rank's shards of the weights (value head included) and
of the optimizer state, and the schedule, under `state/`; loading reshards to the current world size.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipelinerl.dtypes import torch_dtype
from pipelinerl.trainer.base import BackendBase
from pipelinerl.trainer.model import attention_implementation, lr_factor

STATE = "state"  # DCP's folder inside the backend's state folder


class FSDP2Trainer(BackendBase):
    """contract.Trainer on FSDP2 (constructor and shared members: base.BackendBase)."""

    # non-reentrant checkpointing: FSDP2's hooks see each recomputed unit call
    checkpointing_kwargs = {"use_reentrant": False}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._model = self.optimizer = self.scheduler = None

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    def init(self, model_path: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
        from torch.optim.lr_scheduler import LambdaLR
        from transformers import AutoModelForCausalLM

        self.model_path = Path(model_path)
        lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype(self.dtype),
                                                  attn_implementation=attention_implementation(
                                                      self.cfg.attn_implementation, self.device, self.dtype))
        units = tuple(getattr(lm, "_no_split_modules", None) or ())
        if not units:
            raise ValueError(f"{type(lm).__name__} names no decoder-layer class (_no_split_modules): FSDP2 "
                             "shards one unit per layer; use trainer.backend=deepspeed")
        model = self.prepare(lm)
        mesh = init_device_mesh(self.device.type, (self.dist.world_size,))
        policy = MixedPrecisionPolicy(param_dtype=torch_dtype(self.dtype), reduce_dtype=torch.float32)
        for module in [m for m in model.modules() if type(m).__name__ in units]:
            fully_shard(_float32_masters(module), mesh=mesh, mp_policy=policy)
        fully_shard(_float32_masters(model), mesh=mesh, mp_policy=policy)  # the root's own (units: no-op)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        self._model = model
        cfg = self.cfg
        self.optimizer = torch.optim.AdamW(self.trainable(model), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.adam_eps,
                                           weight_decay=cfg.weight_decay)
        self.scheduler = LambdaLR(self.optimizer, lambda step: lr_factor(step, cfg))

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self) -> dict[str, float]:
        from torch.distributed.tensor import DTensor

        lr = float(self.scheduler.get_last_lr()[0])
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip or float("inf"))
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(norm), "lr": lr}

    def full_shape(self, p: torch.nn.Parameter) -> torch.Size:
        return p.shape  # a DTensor's shape is the full one

    def wire_dtype(self, p: torch.nn.Parameter) -> torch.dtype:
        return torch_dtype(self.dtype)  # float32 master weights leave in model.dtype, what the servers load

    def gathered_groups(self, groups):
        """`full_tensor()` all-gathers one parameter (every rank, same order)."""
        from torch.distributed.tensor import DTensor

        for group in groups:
            yield group, [p.detach().full_tensor() if isinstance(p, DTensor) else p.detach() for _, p in group.params]

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        weights, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": weights, "optimizer": optimizer, "schedule": self.scheduler.state_dict()}

    def save_state(self, out_dir: Path) -> None:
        """Collective: each rank writes its shards (DCP)."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(), checkpoint_id=str(out_dir / STATE))

    def load_state(self, in_dir: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if not (in_dir / STATE / ".metadata").is_file():
            raise FileNotFoundError(f"no FSDP2 state under {in_dir / STATE}")
        state = self._state()
        dcp.load(state, checkpoint_id=str(in_dir / STATE))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        self.scheduler.load_state_dict(state["schedule"])


def _float32_masters(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with its trainable parameters and floating buffers in float32; frozen parameters as loaded."""
    masters = [p for p in module.parameters() if p.requires_grad]
    for t in masters + [b for b in module.buffers() if b.is_floating_point()]:
        t.data = t.data.float()
    return module

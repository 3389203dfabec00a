"""The trainer contract on DeepSpeed ZeRO (stages 0-3): NCCL + bf16 on GPUs, gloo + float32 on CPU.

Loss weighting (base.py). DeepSpeed averages gradients over data-parallel ranks; `backward` multiplies by
world_size to undo that exactly. Gradient accumulation is unmanaged (`managed_gradient_accumulation:
false`): the number of micro-batches varies with packing, and `optimizer_step` is the only accumulation
boundary. ZeRO-2/3 reduce gradients (and ZeRO-3 gathers parameters) on every micro-batch.

Value head (rl.value_function): the engine wraps model.ValueHeadLM, whose head is trained and checkpointed
with the DeepSpeed state; weights that leave the trainer are the LM's alone.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipelinerl.config import TrainerConfig
from pipelinerl.dtypes import torch_dtype
from pipelinerl.trainer.base import BackendBase
from pipelinerl.trainer.model import attention_implementation, lr_factor


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def deepspeed_config(cfg: TrainerConfig, dtype: str, world_size: int) -> dict:
    """The DeepSpeed JSON config; cfg.deepspeed_config is merged over it (cluster tuning)."""
    zero = {"stage": cfg.zero_stage}
    if cfg.zero_stage == 3:
        # Weights are gathered module by module for broadcasts and checkpoints, never as one 16-bit copy.
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    base = {
        "train_batch_size": world_size,  # bookkeeping only: accumulation is unmanaged (module docstring)
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": cfg.grad_clip or 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": dtype == "float16"},
        "zero_allow_untested_optimizer": True,  # torch AdamW: DeepSpeed's FusedAdam is JIT-compiled CUDA, absent on CPU
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if dtype == "bfloat16" and cfg.zero_stage >= 1:
        # A step accumulates every micro-batch's gradient (~100 per rank with the 7B config): in float32, not
        # bfloat16 (DeepSpeed's default is the model's dtype). ZeRO-2/3 keep the float32 accumulation partition
        # (4 B per parameter / ranks: pipelinerl plan counts it), ZeRO-1 DeepSpeed's BF16_Optimizer; without
        # ZeRO DeepSpeed refuses the mix, so stage 0 accumulates in bfloat16.
        base["data_types"] = {"grad_accum_dtype": "fp32"}
    return _merge(base, cfg.deepspeed_config)


class DeepSpeedTrainer(BackendBase):
    """contract.Trainer on DeepSpeed (constructor and shared members: base.BackendBase)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.engine = None
        self._hf_ds_config = None  # must outlive from_pretrained for ZeRO-3 (transformers keeps a weakref)

    @property
    def model(self) -> torch.nn.Module:
        return self.engine

    @property
    def lm(self) -> torch.nn.Module:
        return self.engine.module.lm if self.value_head else self.engine.module

    def init(self, model_path: str) -> None:
        import deepspeed
        from torch.optim.lr_scheduler import LambdaLR
        from transformers import AutoModelForCausalLM
        from transformers.integrations import HfDeepSpeedConfig

        self.model_path = Path(model_path)
        ds_config = deepspeed_config(self.cfg, self.dtype, self.dist.world_size)
        if self.cfg.zero_stage == 3:
            # Alive while from_pretrained runs, it makes transformers load each tensor straight into its ZeRO-3
            # shard (deepspeed.zero.Init) instead of materialising the whole model on every rank.
            self._hf_ds_config = HfDeepSpeedConfig(ds_config)
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch_dtype(self.dtype),
            attn_implementation=attention_implementation(self.cfg.attn_implementation, self.device, self.dtype))
        # A value head is created outside zero.Init: under ZeRO-3 deepspeed.initialize partitions it like the LM.
        model = self.prepare(model)
        cfg = self.cfg
        offload = (ds_config["zero_optimization"].get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")

        def make_optimizer(params):
            if offload:  # ZeRO-Offload steps on the CPU: DeepSpeed's vectorised CPU Adam (a JIT-built C++ op)
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                return DeepSpeedCPUAdam(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.adam_eps,
                                        weight_decay=cfg.weight_decay, adamw_mode=True)
            return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.adam_eps,
                                     weight_decay=cfg.weight_decay)

        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=self.trainable(model), optimizer=make_optimizer, config=ds_config,
            lr_scheduler=lambda opt: LambdaLR(opt, lambda step: lr_factor(step, cfg)))

    def backward(self, loss: torch.Tensor) -> None:
        # DeepSpeed divides by the data-parallel size when it reduces; the loss is already this rank's
        # share of a sum, so scale it back (exact for power-of-two world sizes).
        self.engine.backward(loss * self.dist.world_size, scale_wrt_gas=False)

    def optimizer_step(self) -> dict[str, float]:
        lr = float(self.engine.get_lr()[0])
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return {"grad_norm": float(norm) if norm is not None else float("nan"), "lr": lr}

    def full_shape(self, p: torch.nn.Parameter) -> torch.Size:
        """ZeRO-3 keeps each partitioned parameter's full shape as ds_shape."""
        return getattr(p, "ds_shape", p.shape)

    def wire_dtype(self, p: torch.nn.Parameter) -> torch.dtype:
        return p.dtype  # the engine's 16-bit (or float32) copy, model.dtype

    def gathered_groups(self, groups):
        """Under ZeRO-3 each group's parameters are gathered together and re-partitioned when the next
        group's are requested."""
        import deepspeed

        for group in groups:
            with deepspeed.zero.GatheredParameters([p for _, p in group.params], modifier_rank=None):
                yield group, [p.data for _, p in group.params]

    def save_state(self, out_dir: Path) -> None:
        """DeepSpeed engine state (sharded weights with the value head, optimizer, schedule); every rank writes
        its shard."""
        self.engine.save_checkpoint(str(out_dir), tag="state", save_latest=False)

    def load_state(self, in_dir: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(in_dir), tag="state")
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed state under {in_dir}/state")

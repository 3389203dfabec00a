"""The trainer contract on DeepSpeed ZeRO (stages 0-3): NCCL + bf16 on GPUs, gloo + float32 on CPU.

Loss weighting. A micro-batch's loss is its share of the step's loss (sum over its tokens / sequences in
the whole step), so the step's gradient is the plain sum of micro-batch gradients over every rank.
DeepSpeed instead averages gradients over data-parallel ranks; `backward` multiplies by world_size to
undo that exactly. Gradient accumulation is unmanaged (`managed_gradient_accumulation: false`): the
number of micro-batches varies with packing, and `optimizer_step` is the only accumulation boundary.
ZeRO-2/3 reduce gradients (and ZeRO-3 gathers parameters) on every micro-batch, so every rank must run
the same number of them: `accumulate` pads the shorter ranks with zero-loss micro-batches.

Value head (rl.value_function): the engine wraps model.ValueHeadLM, whose head is trained and checkpointed
with the DeepSpeed state; weights that leave the trainer are the LM's alone.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from pipelinerl.config import TrainerConfig
from pipelinerl.dtypes import dtype_name, torch_dtype
from pipelinerl.trainer.contract import LossFn, WeightPublisher
from pipelinerl.trainer.dist import DistInfo, all_reduce_max
from pipelinerl.trainer.model import ValueHeadLM, completion_forward, enable_chunked_logprobs, lr_factor
from pipelinerl.trainer.packing import MicroBatch, padding_micro_batch

# Files of an HF folder that describe weights; everything else (config, tokenizer) is copied as-is.
_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


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
    return _merge(base, cfg.deepspeed_config)


class DeepSpeedTrainer:
    """contract.Trainer on DeepSpeed (constructor as the contract says). `publisher` (rank 0 only) is a
    contract.WeightPublisher, or None to gather without publishing (benchmarks, tests). `value_head`: train a critic
    head beside the LM (ValueHeadLM); `forward` and `accumulate` then also give the values. `temperature`: the
    rollouts' sampling temperature (actor.sampling.temperature); completion log-probs are scored at it, like
    the behaviour log-probs, cfg.logprob_chunk_tokens rows at a time (model.LogprobHead: scoring is a call of
    the LM head module, so under ZeRO-3 its own hooks gather its weight and reduce its gradient).
    `lm_head_fp32` (model.lm_head_fp32): the LM head's logits in float32, as on the servers."""

    def __init__(self, cfg: TrainerConfig, dist: DistInfo, dtype: str = "float32",
                 publisher: WeightPublisher | None = None, value_head: bool = False, temperature: float = 1.0,
                 lm_head_fp32: bool = False):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r} (actor.sampling.temperature)")
        self.cfg, self.dist, self.dtype, self.publisher = cfg, dist, dtype, publisher
        self.value_head, self.temperature, self.lm_head_fp32 = value_head, temperature, lm_head_fp32
        self.engine = None
        self.model_path: Path | None = None
        self._hf_ds_config = None  # must outlive from_pretrained for ZeRO-3 (transformers keeps a weakref)

    @property
    def device(self) -> torch.device:
        return torch.device(f"cuda:{self.dist.local_rank}") if self.dist.backend == "nccl" else torch.device("cpu")

    @property
    def lm(self) -> torch.nn.Module:
        """The HF causal LM (without the value head)."""
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
            model_path, dtype=torch_dtype(self.dtype), attn_implementation=self.cfg.attn_implementation)
        model.config.use_cache = False
        if self.cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if self.cfg.logprob_chunk_tokens is not None or self.lm_head_fp32:
            enable_chunked_logprobs(model, fp32=self.lm_head_fp32)
        if self.value_head:
            # Created outside zero.Init: under ZeRO-3 deepspeed.initialize partitions it like the LM.
            model = ValueHeadLM(model)
        cfg = self.cfg

        def make_optimizer(params):
            return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.adam_eps,
                                     weight_decay=cfg.weight_decay)

        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), optimizer=make_optimizer, config=ds_config,
            lr_scheduler=lambda opt: LambdaLR(opt, lambda step: lr_factor(step, cfg)))

    def forward(self, micro_batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        return completion_forward(self.engine, micro_batch, self.device, self.temperature,
                                  self.cfg.logprob_chunk_tokens)

    def backward(self, loss: torch.Tensor) -> None:
        # DeepSpeed divides by the data-parallel size when it reduces; the loss is already this rank's
        # share of a sum, so scale it back (exact for power-of-two world sizes).
        self.engine.backward(loss * self.dist.world_size, scale_wrt_gas=False)

    def optimizer_step(self) -> dict[str, float]:
        lr = float(self.engine.get_lr()[0])
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return {"grad_norm": float(norm) if norm is not None else float("nan"), "lr": lr}

    def accumulate(self, micro_batches: list[MicroBatch], loss_fn: LossFn) -> list[dict]:
        """Forward + loss + backward over this rank's micro-batches, padded to the ranks' maximum count.
        loss_fn(micro_batch, new_logprobs_N, values_N) -> (loss share, stats); values_N is None without a
        value head, else aligned with new_logprobs_N (see `completion_forward`), and the loss must use it so
        that every rank reduces the head's gradients. Returns the real batches' stats."""
        count = max(all_reduce_max(len(micro_batches)), 1)  # >= 1 pass: the optimizer step needs gradients
        first = micro_batches[0] if micro_batches else None
        pad = padding_micro_batch(first.fields_N, first.seq_fields_S) if first else padding_micro_batch()
        padded = micro_batches + [pad] * (count - len(micro_batches))
        stats = []
        for mb in padded:
            new_N, values_N = self.forward(mb)
            if mb.is_padding:  # touches every parameter, adds nothing
                loss = (new_N.sum() if values_N is None else new_N.sum() + values_N.sum()) * 0.0
            else:
                loss, mb_stats = loss_fn(mb, new_N, values_N)
                stats.append(mb_stats)
            self.backward(loss)
        return stats

    def _modules_with_params(self) -> Iterator[list[tuple[str, torch.nn.Parameter]]]:
        """The LM's parameters (HF names, no value head) grouped by owning module, in a fixed order shared
        by metas and tensors."""
        for prefix, module in self.lm.named_modules():
            own = [(f"{prefix}.{n}" if prefix else n, p) for n, p in module.named_parameters(recurse=False)]
            if own:
                yield own

    def named_shapes(self) -> list[tuple[str, str, list[int]]]:
        """(HF name, dtype, full shape) of every LM parameter, without gathering (ZeRO-3 keeps ds_shape)."""
        return [(name, dtype_name(p.dtype), list(getattr(p, "ds_shape", p.shape)))
                for own in self._modules_with_params() for name, p in own]

    def gathered_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full LM parameters, one module at a time. A collective under ZeRO-3: every rank must exhaust it.
        Each tensor is valid until the next one is requested (its module is then re-partitioned)."""
        import deepspeed

        for own in self._modules_with_params():
            with deepspeed.zero.GatheredParameters([p for _, p in own], modifier_rank=None):
                for name, p in own:
                    yield name, p.data

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
        """CPU copies of all LM weights on rank 0 (empty elsewhere); a collective under ZeRO-3."""
        return {name: t.detach().to("cpu", copy=True) for name, t in self.gathered_parameters()
                if self.dist.is_main}

    def save_hf(self, out_dir: Path) -> None:
        """HF folder loadable by transformers and vLLM: gathered weights + the source's config/tokenizer."""
        state = self.full_state_dict()
        if not self.dist.is_main:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        for src in self.model_path.iterdir():
            if src.is_file() and not any(src.match(p) for p in _WEIGHT_FILES):
                shutil.copy2(src, out_dir / src.name)
        self.lm.save_pretrained(out_dir, state_dict=state, safe_serialization=True)

    def save_state(self, out_dir: Path) -> None:
        """DeepSpeed engine state (sharded weights with the value head, optimizer, schedule); every rank writes
        its shard."""
        self.engine.save_checkpoint(str(out_dir), tag="state", save_latest=False)

    def load_state(self, in_dir: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(in_dir), tag="state")
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed state under {in_dir}/state")

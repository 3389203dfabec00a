"""The model shapes the memory plan (memory.py) computes with: a decoder-only transformer's dimensions and
parameter count, from a model folder's config.json, else the shipped configs' built-in table, else the
config's tiny-model section.

Apart from memory.py, whose arithmetic takes a ModelShape and reads no files: finding a model's shape is the
part that looks at model folders.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from pipelinerl.config import Config, ConfigError


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a decoder-only transformer (Qwen2 / Llama layout: q/k/v biases, SwiGLU MLP). A
    mixture of experts (experts > 0; Qwen3-MoE / Qwen2-MoE layout) has in every layer, instead of the MLP,
    `experts` SwiGLU experts of width expert_intermediate, a router (experts x hidden) choosing experts_per_token
    of them per token, and optionally a shared expert of width shared_intermediate with its one-logit gate."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def params(self) -> int:
        return self._count(self.experts)

    @property
    def active_params(self) -> int:
        """The parameters one token's forward uses: all of them for a dense model; for a mixture of experts, its
        experts_per_token routed experts (and the shared one) in each layer."""
        return self._count(self.experts_per_token)

    @property
    def ffn_width(self) -> int:
        """The FFN width one token passes through (activations): the MLP's, or its routed experts' together."""
        if not self.experts:
            return self.intermediate
        return self.experts_per_token * self.expert_intermediate + self.shared_intermediate

    @property
    def largest_tensor(self) -> int:
        """Elements of the largest weight tensor: the embeddings, an MLP matrix, or a layer's fused experts
        (transformers keeps them as one [experts, 2 x width, hidden] gate-up tensor, sent as one)."""
        ffn = (self.experts * 2 * self.expert_intermediate if self.experts else self.intermediate) * self.hidden
        return max(self.vocab * self.hidden, ffn)

    def _count(self, experts: int) -> int:
        h = self.hidden
        attention = h * self.q_dim + self.q_dim + 2 * (h * self.kv_dim + self.kv_dim) + self.q_dim * h
        if self.experts:
            ffn = experts * 3 * h * self.expert_intermediate + self.experts * h  # experts used + the router
            ffn += (3 * h * self.shared_intermediate + h) if self.shared_intermediate else 0
        else:
            ffn = 3 * h * self.intermediate
        return self.layers * (attention + ffn + 2 * h) + self.vocab * h * (1 if self.tied else 2) + h


# The shipped configs' models, for planning where the model folder is not at hand (e.g. on a laptop).
_LLAMA_31_8B = ModelShape(4096, 32, 14336, 32, 8, 128, 128256)  # no q/k/v biases: 0.01 % fewer than counted
BUILTIN_SHAPES = {
    "Qwen2.5-7B": ModelShape(3584, 28, 18944, 28, 4, 128, 152064),
    # no q/k/v biases, q/k norms: within 0.01 % of the count; 30.5B parameters, 3.3B active
    "Qwen3-30B-A3B": ModelShape(2048, 48, 6144, 32, 4, 128, 151936, experts=128, experts_per_token=8,
                                expert_intermediate=768),
    "Qwen2.5-32B": ModelShape(5120, 64, 27648, 40, 8, 128, 152064),
    "Llama-3.1-8B-Instruct": _LLAMA_31_8B,
    "Skywork-Reward-Llama-3.1-8B-v0.2": _LLAMA_31_8B,  # a reward model: reward_shape drops the LM head
}


def shape_from_hf_config(hf: dict) -> ModelShape:
    """The shape of an HF config.json (its dict)."""
    heads = hf["num_attention_heads"]
    moe, experts = {}, hf.get("num_experts") or hf.get("num_local_experts")  # transformers 5 writes the latter
    if experts:  # Qwen3-MoE / Qwen2-MoE layout, every layer sparse (decoder_sparse_step 1)
        moe = {"experts": experts, "experts_per_token": hf["num_experts_per_tok"],
               "expert_intermediate": hf.get("moe_intermediate_size") or hf["intermediate_size"],
               "shared_intermediate": hf.get("shared_expert_intermediate_size") or 0}
    return ModelShape(hf["hidden_size"], hf["num_hidden_layers"], hf["intermediate_size"], heads,
                      hf.get("num_key_value_heads", heads), hf.get("head_dim") or hf["hidden_size"] // heads,
                      hf["vocab_size"], bool(hf.get("tie_word_embeddings", False)), **moe)


def load_shape(cfg: Config) -> tuple[ModelShape, str]:
    """(shape, where it came from): model.path/config.json, else the built-in table by folder name, else the
    tiny model's config section when `run` would build it."""
    return shape_at(cfg.model.path, cfg.model.build_tiny_if_missing, cfg, "model.path")


def shape_at(path: str, tiny: bool, cfg: Config, key: str) -> tuple[ModelShape, str]:
    """load_shape for the model at `path` (`tiny`: built from model.tiny when missing; `key` names the field)."""
    config_json = Path(path) / "config.json"
    if config_json.is_file():
        return shape_from_hf_config(json.loads(config_json.read_text())), str(config_json)
    name = Path(path).name
    if name in BUILTIN_SHAPES:
        return BUILTIN_SHAPES[name], f"built-in shape of {name} ({config_json} not found)"
    if tiny:
        from pipelinerl.tiny.model import ALPHABET

        t = cfg.model.tiny
        vocab = 3 + len(ALPHABET)  # pad, bos, eos + one token per symbol (tiny_model.build_tokenizer)
        moe = {"experts": t.num_experts, "experts_per_token": t.experts_per_token,
               "expert_intermediate": t.moe_intermediate_size} if t.num_experts else {}
        return (ModelShape(t.hidden_size, t.num_layers, t.intermediate_size, t.num_attention_heads,
                           t.num_key_value_heads, t.hidden_size // t.num_attention_heads, vocab, **moe),
                "model.tiny (to be built)")
    raise ConfigError(f"config `{key}`: {config_json} not found and {name!r} has no built-in shape "
                      f"({', '.join(BUILTIN_SHAPES)}); point {key} at the HF model folder")


def reward_shape(cfg: Config, policy: ModelShape) -> tuple[ModelShape, str]:
    """The reward model's shape (reward.model_path, as load_shape), its one-logit head in place of the LM head;
    the policy's shape where the folder is not at hand (a reward model of the policy's family and size, as in
    seed 004), said in the note."""
    try:
        shape, source = shape_at(cfg.reward.model_path, cfg.reward.build_tiny_if_missing, cfg, "reward.model_path")
    except ConfigError:
        shape, source = policy, f"the policy's shape ({cfg.reward.model_path}/config.json not found)"
    if cfg.reward.kind == "judge":  # a judge is a whole language model
        return shape, source
    return dataclasses.replace(shape, tied=True), source  # a head of H x 1, not a second V x H matrix

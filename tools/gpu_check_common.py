"""What every part of tools/gpu_check.py shares: the model shapes, a table row, the offline model builder and the
check's config (the leaves: nothing here imports another gpu_check module)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASE_CONFIG = REPO / "configs" / "tiny_cpu.yaml"
GB = 1e9  # decimal, as the plan reports (the issue: 16384 x 152k x 4 B "= 10 GB")

# name -> (hidden, layers, heads, kv heads, FFN, vocab); vocab None keeps the tiny tokenizer's.
SHAPES = {
    "tiny": (128, 2, 4, 2, 512, None),
    "small": (512, 8, 8, 4, 1536, None),  # ~25M params: step times above the per-call overheads on CPU
    "base": (768, 14, 12, 4, 2048, None),  # ~88M params: the bench's larger CPU model
    "1.5b": (1536, 28, 12, 2, 8960, 151936),  # Qwen2.5-1.5B's shape (untied here, as every tiny build)
    "tiny_moe": (128, 2, 4, 2, 512, None),  # configs/tiny_moe.yaml's model
    # Qwen3-30B-A3B's layer (width 2048, 32 query / 4 KV heads of 128, 128 experts of width 768, top-8) x 4 of its
    # 48 layers, ~2.4B params: the experts, routers and attention at the flagship's size. The tiny vocabulary
    # keeps the served model decodable; the 1.5b row measures a real-size LM head.
    "a3b_4l": (2048, 4, 32, 4, 6144, None),
}
# MoE shapes -> (experts, experts per token, expert FFN width, head_dim or None for hidden / heads)
MOE_SHAPES = {"tiny_moe": (8, 2, 64, None), "a3b_4l": (128, 8, 768, 128)}


@dataclass
class Row:
    step: str
    result: str  # "ok" | "FAILED: <why>" | "skipped: <why>"
    numbers: str = ""
    values: dict = field(default_factory=dict)  # the numbers, raw (--json)

    @property
    def failed(self) -> bool:
        return self.result.startswith("FAILED")


def importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# ---- models and configs -------------------------------------------------------------------------------

def build_model(out_dir: Path, shape: str, device: str):
    """The project's tiny-model builder at another shape; a real-size vocabulary where the shape has one
    (ids past the character tokenizer's are never decoded: the check feeds token ids)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipelinerl.config import TinyModelConfig
    from pipelinerl.tiny.model import build_tokenizer, save_model, tiny_config

    hidden, layers, heads, kv, ffn, vocab = SHAPES[shape]
    experts, top_k, expert_ffn, head_dim = MOE_SHAPES.get(shape, (0, 2, 64, None))
    tiny = TinyModelConfig(hidden_size=hidden, num_layers=layers, num_attention_heads=heads,
                           num_key_value_heads=kv, intermediate_size=ffn, max_position_embeddings=4096,
                           num_experts=experts, experts_per_token=top_k, moe_intermediate_size=expert_ffn)
    tokenizer = build_tokenizer()
    config = tiny_config(tiny, tokenizer)
    if vocab is not None:
        config.vocab_size = vocab
    if head_dim is not None:
        config.head_dim = head_dim
    torch.manual_seed(tiny.seed)
    # A 1.5B model initialises in seconds on the GPU, minutes on CPU; bf16 halves what is written.
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    save_model(model, tokenizer, out_dir)
    return sum(p.numel() for p in model.parameters())


def write_config(path: Path, model_dir: Path, run_dir: Path, args, extra: tuple[str, ...] = ()) -> Path:
    """configs/tiny_cpu.yaml with the check's model and trainer settings, resolved and saved: the one file
    that the trainer child, `pipelinerl plan` and the server all read."""
    from pipelinerl.config import load_config, save_config

    overrides = [f"run_dir={run_dir}", f"model.path={model_dir}", "model.build_tiny_if_missing=false",
                 f"model.dtype={args.dtype}", "trainer.zero_stage=3", "trainer.num_gpus=1",
                 f"trainer.backend={'fsdp2' if args.trainer == 'fsdp2' else 'deepspeed'}",
                 f"trainer.micro_batch_tokens={args.tokens}", f"trainer.logprob_chunk_tokens={args.chunk}",
                 f"trainer.broadcast_bucket_mb={args.bucket_mb}", "actor.sampling.min_new_tokens=0", *extra]
    save_config(load_config(BASE_CONFIG, overrides), path)
    return path

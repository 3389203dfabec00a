"""Reference computations shared by tests (imported as `helpers`: pytest puts tests/ on sys.path)."""

import torch


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """n tokens of plain argmax decoding with transformers' forward: no EOS handling (like vLLM's
    ignore_eos), and unlike `generate(min_new_tokens=...)`, no logit is suppressed."""
    x, out = torch.tensor([ids]), []
    for _ in range(n):
        nxt = int(model(x).logits[0, -1].argmax())
        out.append(nxt)
        x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
    return out

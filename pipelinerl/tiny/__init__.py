"""The offline tiny models (no model hub here): the tiny Qwen2 or Qwen3-MoE policy and its character tokenizer
(model.py), its supervised warm start on a tiny task (warm_start.py), and the tiny reward model (reward_model.py)."""

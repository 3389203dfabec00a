import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipelinerl.config import TinyModelConfig
from pipelinerl.tiny.model import ALPHABET, build_tiny_model

HERE = Path(__file__).resolve().parent


def test_tokenizer_round_trips_and_chat_template(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok("37+48=").input_ids
    assert ids[0] == tok.bos_token_id and len(ids) == 1 + len("37+48=")
    assert tok.decode(ids, skip_special_tokens=True) == "37+48="
    assert tok.decode(tok(ALPHABET, add_special_tokens=False).input_ids) == ALPHABET
    chat = tok.apply_chat_template([{"role": "user", "content": "37+48="}], add_generation_prompt=True,
                                   tokenize=True)
    assert list(chat["input_ids"]) == ids  # the chat route and the plain route give the same prompt


def test_model_is_untied_deterministic_and_vllm_compatible(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = model.config
    assert cfg.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert cfg.hidden_size // cfg.num_attention_heads in (32, 64)
    again, _ = build_tiny_model(tmp_path / "again", TinyModelConfig(seed=0))
    other, _ = build_tiny_model(tmp_path / "other", TinyModelConfig(seed=1))
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)


def _hf_greedy(model_dir, prompt, n):
    """Plain argmax decoding with transformers' forward (no EOS handling, like vLLM's ignore_eos)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = tok(prompt, return_tensors="pt").input_ids
    margins = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(ids).logits[0, -1]
            top2 = torch.topk(logits, 2).values
            margins.append(float(top2[0] - top2[1]))
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    # The smallest gap between the top two logits: greedy is only well defined if it is > 0.
    return ids[0, -n:].tolist(), min(margins)


@pytest.mark.slow
def test_transformers_and_vllm_cpu_agree_on_greedy_continuation(tiny_model_dir):
    prompts, n = ["37+48=", "5*5-1="], 12
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    run = subprocess.run([sys.executable, str(HERE / "vllm_greedy.py"), str(tiny_model_dir), str(n), *prompts],
                         capture_output=True, text=True, env=env, timeout=600, check=False)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    vllm_ids = json.loads(lines[-1][len("RESULT "):])
    for prompt, got in zip(prompts, vllm_ids):
        expected, margin = _hf_greedy(tiny_model_dir, prompt, n)
        assert margin > 1e-4, "greedy path has a near-tie; pick another prompt"
        assert got == expected, prompt

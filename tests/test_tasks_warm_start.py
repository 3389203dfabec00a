"""The tiny model's supervised warm start: loss goes down, the saved folder loads, greedy success is
measured like transformers' own generate; a multi-turn task's, on its demonstrated episodes."""

import asyncio
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipelinerl.config import TaskConfig, TinyModelConfig
from pipelinerl.envs.runner import run_episode
from pipelinerl.tasks import get_task
from pipelinerl.tiny.warm_start import (
    _Greedy,
    encode_episodes,
    encode_examples,
    greedy_completions,
    greedy_episodes,
    greedy_success,
    heldout_greedy,
    warm_start,
)


def test_encoding_puts_loss_on_answer_and_eos_only(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = get_task(TaskConfig())
    item = next(i for i in task.train_items if i.id == "99+98")
    ids, labels = encode_examples(tok, [item])
    assert tok.decode(ids[0]) == "<bos>99+98=791<eos>"
    assert tok.decode(labels[0][labels[0] >= 0]) == "791<eos>"


def hf_generate_completions(model, tok, items):
    """Reference: transformers' generate, one prompt at a time, up to the longest answer + EOS."""
    completions, max_new = [], max(len(item.answer) for item in items) + 1
    for item in items:
        ids = tok(item.prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=max_new, do_sample=False)[0, ids.shape[1]:].tolist()
        finished = tok.eos_token_id in out
        completions.append((tok.decode(out[:out.index(tok.eos_token_id)] if finished else out,
                                       skip_special_tokens=True), finished))
    return completions


def test_warm_start_reduces_loss_and_saves_a_loadable_model(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, model_dir)
    task = get_task(TaskConfig(seed=0, eval_fraction=0.01))  # 81 held-out items: quick checks
    shape = TinyModelConfig(warm_start_steps=24, warm_start_target=1.0)  # the target is never reached
    result = warm_start(model_dir, task, shape)
    assert result["steps"] == 24 and result["last_loss"] < 0.6 * result["first_loss"]
    assert not (tmp_path / "tiny.tmp").exists()
    assert heldout_greedy(model_dir, task) == result["heldout_greedy"]  # the saved weights are the trained ones
    model, tok = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert not torch.equal(model.lm_head.weight, AutoModelForCausalLM.from_pretrained(tiny_model_dir).lm_head.weight)
    items = task.eval_items[:24]
    completions = greedy_completions(model, tok, items)
    assert completions == hf_generate_completions(model, tok, items)
    assert any(text for text, _ in completions)  # a non-trivial comparison: the model writes digits
    assert greedy_success(model, tok, task, items) == sum(
        task.reward(item, *done) for item, done in zip(items, completions)) / len(items)


def test_zero_steps_leaves_the_model_untouched(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, model_dir)
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    result = warm_start(model_dir, get_task(TaskConfig(eval_fraction=0.01)), TinyModelConfig(warm_start_steps=0))
    assert result["steps"] == 0 and result["heldout_greedy"] == 0.0
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_greedy_completions_of_long_traces_equal_generate_one_at_a_time(tiny_model_dir):
    model, tok = AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    task = get_task(TaskConfig(name="arithmetic"))
    items = [i for i in task.train_items if i.id in ("99-2", "23-5", "10-9", "57-3")]  # 1 to 49 terms
    assert greedy_completions(model, tok, items) == hf_generate_completions(model, tok, items)


def test_a_task_without_exact_completions_is_refused(tiny_model_dir, tmp_path):
    class Graded(type(get_task(TaskConfig()))):
        name, exact_completions = "graded", False

    with pytest.raises(ValueError, match="exact completions.*'graded'"):
        warm_start(tiny_model_dir, Graded(TaskConfig()), TinyModelConfig(warm_start_steps=1))


def test_a_multi_turn_task_warm_starts_on_its_demonstrated_episodes(tiny_model_dir, tmp_path):
    """tool_sums: the examples are the environment's own episodes (loss on model tokens), and held-out greedy
    episodes, batched turn by turn, equal episodes run one at a time with transformers' generate."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = get_task(TaskConfig(name="tool_sums", eval_fraction=0.01))
    item = task.train_items[0]
    ids, labels = encode_episodes(tok, task, [item])
    expr, total = item.prompt[:-1], item.answer
    assert tok.decode(ids[0]) == f"<bos>{item.prompt}=={expr}=<eos>{total}{total}<eos>"
    model_tokens = [int(t) for t in labels[0] if t >= 0]
    assert tok.decode(model_tokens) == f"=={expr}=<eos>{total}<eos>"  # the tool's answer has no loss
    model_dir = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, model_dir)
    shape = TinyModelConfig(warm_start_steps=40, warm_start_target=1.0, warm_start_check_every=40)
    result = warm_start(model_dir, task, shape)
    assert result["steps"] == 40 and result["last_loss"] < 0.6 * result["first_loss"]
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    items = task.eval_items[:24]
    batched = greedy_episodes(model, tok, task, items)

    async def one_at_a_time(prefix, max_tokens):
        out = model.generate(torch.tensor([prefix]), max_new_tokens=max_tokens, do_sample=False)[0, len(prefix):]
        out = out.tolist()
        finished = tok.eos_token_id in out
        out = out[:out.index(tok.eos_token_id) + 1] if finished else out
        return _Greedy(out, [0.0] * len(out), [0] * len(out), finished)

    with torch.no_grad():
        reference = [asyncio.run(run_episode(one_at_a_time, task.environment(i), tok, task.episode_limits, 10))
                     for i in items]
    assert [r.episode.token_ids for r in batched] == [r.episode.token_ids for r in reference]
    assert [r.reward for r in batched] == [r.reward for r in reference]
    assert any(len(r.episode.model_turns) > 1 for r in batched)  # the model calls the tool: a real comparison
    assert greedy_success(model, tok, task, items) == sum(r.reward for r in batched) / len(items)


def test_the_warm_start_of_a_slow_tool_task_runs_its_episodes_without_the_delay(tmp_path, monkeypatch):
    """task.tool_sums.latency_s delays the actor's tool calls; the warm start (which only teaches the format)
    builds its task without it, the busy answers kept."""
    from pipelinerl.config.actor import ToolSumsConfig
    from pipelinerl.tiny import warm_start as module

    seen = []
    monkeypatch.setattr(module, "warm_start", lambda model_dir, task, shape: seen.append(task) or {})
    module.build_warm_tiny_model(tmp_path / "tiny", TinyModelConfig(seed=0),
                                 TaskConfig(name="tool_sums", tool_sums=ToolSumsConfig(max_busy=5, latency_s=2.0)))
    (task,) = seen
    assert (task.latency_s, task.max_busy) == (0.0, 5)

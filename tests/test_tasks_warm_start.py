"""The tiny model's supervised warm start: loss goes down, the saved folder loads, greedy success is
measured like transformers' own generate."""

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipelinerl.config import TaskConfig, TinyModelConfig
from pipelinerl.tasks import get_task
from pipelinerl.tasks.warm_start import (
    encode_examples,
    greedy_completions,
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

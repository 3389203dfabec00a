"""The `reward` section: where a completion's reward comes from."""

from __future__ import annotations

from dataclasses import dataclass

from pipelinerl.config.fields import check, check_choice, check_positive, doc

REWARD_KINDS = ("verify", "model", "judge")
DEFAULT_RUBRIC = (
    "You grade an assistant's answer to a user's request.\n\nRequest:\n{prompt}\n\nAnswer:\n{completion}\n\n"
    "Is the answer correct, helpful and complete? Reason briefly, then end with one line of the form "
    "SCORE: <a whole number from 0 to 10>")


@dataclass
class RewardConfig:
    """The task's own check, a served reward model (seed 004's RLHF), or a served judge."""

    kind: str = doc("verify", "verify (the task's own check: exact answer, math-verify) | model (the score of a "
                              "reward model served by `serve --reward` on (prompt + completion)) | judge (an instruct "
                              "model served by `serve --reward` grades each completion against `rubric`; with "
                              "task.name=verifiers, it answers the environment's own judges at JUDGE_URL instead: "
                              "pipelinerl/envs/verifiers_judge.py); with model or judge the task's check is still "
                              "logged, as actor/verified_success, and evaluation still uses it")
    model_path: str | None = doc(None, "HF folder of the reward model: kind=model, a sequence classifier with one "
                                       "logit (e.g. Qwen2ForSequenceClassification, LlamaForSequenceClassification) "
                                       "served by vLLM's pooling runner (`POST /classify`); kind=judge, an instruct "
                                       "model with a chat template, served for generation (`/v1/chat/completions`)",
                                 null="none (kind=verify)")
    build_tiny_if_missing: bool = doc(False, "build and train the tiny reward model of task.name into model_path when "
                                             "it has no config.json (as `pipelinerl make-tiny-model --reward-model`)")
    servers: int = doc(1, "reward servers (kind=model or judge): locally on inference.base_port + num_servers + "
                          "reference servers + i, on Slurm in server slots of the first inference node after the "
                          "reference servers'")
    input: str = doc("tokens", "kind=model: what a reward server scores: tokens (the policy's prompt + completion "
                               "token ids, EOS included: exact, for a reward model with the policy's tokenizer, "
                               "checked at the actor's start) | text (their text, special tokens kept but a leading "
                               "BOS, which the server's tokenizer adds again: a reward model with a tokenizer of its "
                               "own)")
    score: str = doc("probability", "kind=model: the reward: probability (the server's sigmoid of the logit, in "
                                    "[0, 1]) | logit (the raw score, as Bradley-Terry reward models are usually read)")
    rubric: str | None = doc(None, "kind=judge: the judge's user message, with {prompt} and {completion} filled in; "
                                   "it must ask for a last line `SCORE: <number>` (read strictly: anything else "
                                   "scores 0 and is counted as actor/judge_unparsed_frac)",
                             null="DEFAULT_RUBRIC of pipelinerl/config/reward.py: correct, helpful and complete, "
                                  "a short reasoning, then SCORE: 0-10")
    judge_max_score: float = doc(10.0, "kind=judge: the highest SCORE the rubric allows; the reward is SCORE / this")
    judge_max_tokens: int = doc(512, "kind=judge: the judge's longest answer (reasoning and the SCORE line)",
                                unit="tokens")
    success_threshold: float = doc(0.5, "a score above it counts as a success in actor/success and the curriculum "
                                        "(the task's own check is logged apart, as actor/verified_success)")

    def __post_init__(self) -> None:
        check_choice(self.kind, REWARD_KINDS, "reward.kind")
        check_choice(self.input, ("tokens", "text"), "reward.input")
        check_choice(self.score, ("probability", "logit"), "reward.score")
        check_positive(self.servers, "reward.servers")
        check(self.kind == "verify" or bool(self.model_path), "reward.model_path",
              f"reward.kind={self.kind} needs the {'judge' if self.kind == 'judge' else 'reward model'}'s folder")
        check(self.kind != "judge" or ("{prompt}" in self.judge_rubric and "{completion}" in self.judge_rubric),
              "reward.rubric",
              "the judge must see the request and the answer: put {prompt} and {completion} in it")
        check(self.judge_max_score > 0, "reward.judge_max_score", "must be > 0")
        check_positive(self.judge_max_tokens, "reward.judge_max_tokens")

    @property
    def judge_rubric(self) -> str:
        """The rubric a judge is given: `rubric`, else DEFAULT_RUBRIC."""
        return self.rubric or DEFAULT_RUBRIC

    @property
    def servers_started(self) -> int:
        """How many reward servers a run starts: `servers` with kind=model or judge, else none."""
        return self.servers if self.kind != "verify" else 0

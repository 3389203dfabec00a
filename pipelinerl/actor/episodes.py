"""Multi-turn episodes in the actor: their stream rows and their statistics.

An episode (envs/runner.py) becomes one rollout row: `prompt_token_ids` are the prompt's tokens, and
`completion_token_ids` everything after, model and environment tokens in order, with `loss_mask` 1 on the
model's. Environment tokens carry version -1 and log-prob 0 (envs/episode.py), so no statistic of the
trainer counts them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from pipelinerl.envs.episode import NO_VERSION
from pipelinerl.envs.runner import EpisodeResult
from pipelinerl.streams import Rollout
from pipelinerl.tasks import PromptItem


def episode_rollout(run_id: str, group_id: str, k: int, item: PromptItem, result: EpisodeResult, task: str,
                    actor_id: str, metadata: dict) -> Rollout:
    """The stream row of the k-th episode of a group."""
    ep, n = result.episode, result.episode.prompt_length
    return Rollout(run_id=run_id, group_id=group_id, sample_id=f"{group_id}/{k}/{uuid.uuid4().hex[:12]}",
                   prompt_token_ids=ep.token_ids[:n], completion_token_ids=ep.token_ids[n:],
                   behaviour_logprobs=ep.logprobs[n:], versions=ep.versions[n:], loss_mask=ep.loss_mask[n:],
                   reward=result.reward, finished=result.end_reason == "finished",
                   truncated=ep.truncated and result.error is None, task=task, actor_id=actor_id,
                   turns=len(ep.model_turns), tool_calls=result.tool_calls, tool_errors=result.tool_errors,
                   end_reason=result.end_reason,
                   metadata={"prompt_id": item.id, **metadata, **({"env_error": result.error} if result.error else {})})


def model_versions(result: EpisodeResult) -> set[int]:
    """The policy versions that produced the episode's model tokens."""
    return {v for v in result.episode.versions if v != NO_VERSION}


@dataclass
class EpisodeStats:
    """Counts over the episodes finished since the last `scalars(reset=True)`: TensorBoard's actor/episode/*."""

    episodes: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_errors: int = 0
    truncated: int = 0
    straddling: int = 0  # episodes whose model tokens come from more than one policy version
    env_tokens: int = 0
    model_tokens: int = 0

    def add(self, results: list[EpisodeResult]) -> None:
        for r in results:
            ep = r.episode
            model = sum(ep.loss_mask)
            self.episodes += 1
            self.turns += len(ep.model_turns)
            self.tool_calls += r.tool_calls
            self.tool_errors += r.tool_errors
            self.env_errors += r.error is not None
            self.truncated += ep.truncated and r.error is None
            self.straddling += len(model_versions(r)) > 1
            self.model_tokens += model
            self.env_tokens += len(ep.token_ids) - ep.prompt_length - model

    def scalars(self) -> dict[str, float]:
        """actor/episode/*: means per episode, tool-call success, and the fractions that ended badly or
        straddled a weight update (empty when no episode finished)."""
        n = self.episodes
        if not n:
            return {}
        out = {"actor/episode/turns": self.turns / n, "actor/episode/tool_calls": self.tool_calls / n,
               "actor/episode/env_errors": float(self.env_errors), "actor/episode/truncated": self.truncated / n,
               "actor/episode/straddling": self.straddling / n, "actor/episode/model_tokens": self.model_tokens / n,
               "actor/episode/env_tokens": self.env_tokens / n}
        if self.tool_calls:
            out["actor/episode/tool_call_success"] = 1 - self.tool_errors / self.tool_calls
        return out

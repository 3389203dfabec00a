"""Multi-turn episodes in the actor: their stream rows and their statistics.

An episode (envs/runner.py) becomes one rollout row: `prompt_token_ids` are the prompt's tokens, and
`completion_token_ids` everything after, model and environment tokens in order, with `loss_mask` 1 on the
model's. Environment tokens carry version -1 and log-prob 0 (envs/episode.py), so no statistic of the
trainer counts them.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

import httpx

from pipelinerl.actor.client import Completion, CompletionsClient
from pipelinerl.actor.pacing import take_turn
from pipelinerl.config import Config
from pipelinerl.envs.episode import NO_VERSION, EpisodeLimits
from pipelinerl.envs.runner import EpisodeResult, run_episode
from pipelinerl.eval.metrics import ItemOutcome
from pipelinerl.streams import Rollout
from pipelinerl.tasks import PromptItem, Task


def episode_limits(cfg: Config) -> EpisodeLimits:
    """actor.episode's limits; an episode never outgrows what a server holds (inference.max_model_len)."""
    e = cfg.actor.episode
    per_turn = e.max_tokens_per_turn or cfg.actor.sampling.max_new_tokens
    total = min(e.max_total_tokens, cfg.inference.max_model_len or e.max_total_tokens)
    return EpisodeLimits(max_turns=e.max_turns, max_tokens_per_turn=per_turn, max_total_tokens=total)


async def sample_episodes(client: CompletionsClient, http: httpx.AsyncClient, task: Task, tokenizer,
                          item: PromptItem, cfg: Config, n: int, greedy: bool, temperature: float | None = None,
                          min_version: int | None = None, name: str = "episode",
                          priority: int = 0) -> list[EpisodeResult]:
    """n episodes of `item`, side by side (envs/runner.py), every turn one request (`temperature`: None is
    actor.sampling's) at vLLM request `priority`. Each turn's request carries `min_version`: the lag bound
    taken at the episode's start. An episode waits for its turn on the loop (actor/pacing.py) before its first
    turn and after each completion."""
    async def generate(prefix: list[int], max_tokens: int, stop: tuple[str, ...] = ()) -> Completion:
        (done,) = await client.complete(http, prefix, greedy=greedy, n=1, temperature=temperature,
                                        min_version=min_version, max_tokens=max_tokens, priority=priority, stop=stop)
        await take_turn()
        return done

    async def episode(k: int) -> EpisodeResult:
        await take_turn()
        return await run_episode(generate, task.environment(item), tokenizer, limits, timeout_s, name=f"{name}/{k}")

    limits, timeout_s = episode_limits(cfg), cfg.actor.episode.step_timeout_s
    return list(await asyncio.gather(*map(episode, range(n))))


def episode_outcome(task: Task, item: PromptItem, results: list[EpisodeResult]) -> ItemOutcome:
    """An eval item's ItemOutcome from its episodes: the last model turn's text (the answer), the episode's
    reward, its model tokens as the length, and whether it ended as the environment decided (finished)."""
    texts = [r.episode.model_turns[-1].text for r in results]
    rewards = [r.reward for r in results]
    return ItemOutcome(item.id, texts, rewards, [task.is_success(x) for x in rewards],
                       [sum(r.episode.loss_mask) for r in results], [r.end_reason == "finished" for r in results])


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
                   metadata={"prompt_id": item.id, **metadata, **({"env_error": result.error} if result.error else {}),
                             **({"drift_tokens": result.drift_tokens} if result.drift_tokens else {})})


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
    drift_tokens: int = 0  # sampled, then cut off or masked by a program's branch (EpisodeResult.drift_tokens)
    scores: dict[str, list[float]] = field(default_factory=dict)  # name -> [sum, episodes that report it]

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
            self.drift_tokens += r.drift_tokens
            self.env_tokens += len(ep.token_ids) - ep.prompt_length - model
            for name, value in r.scores.items():
                total = self.scores.setdefault(name, [0.0, 0])
                total[0] += value
                total[1] += 1

    def scalars(self) -> dict[str, float]:
        """actor/episode/*: means per episode, tool-call success, the fractions that ended badly or straddled
        a weight update, and score/<name>: each reward part's mean over the episodes that report it (empty
        when no episode finished); actor/agent_drift_tokens: the model tokens branches took out of training."""
        n = self.episodes
        if not n:
            return {}
        out = {"actor/episode/turns": self.turns / n, "actor/episode/tool_calls": self.tool_calls / n,
               "actor/episode/env_errors": float(self.env_errors), "actor/episode/truncated": self.truncated / n,
               "actor/episode/straddling": self.straddling / n, "actor/episode/model_tokens": self.model_tokens / n,
               "actor/episode/env_tokens": self.env_tokens / n, "actor/agent_drift_tokens": float(self.drift_tokens)}
        if self.tool_calls:
            out["actor/episode/tool_call_success"] = 1 - self.tool_errors / self.tool_calls
        out.update({f"actor/episode/score/{name}": total / count for name, (total, count) in self.scores.items()})
        return out

"""What an environment adapter costs the actor: the tiny tool task's episodes run natively (`tool_sums`), as a
verifiers environment (`task.name=verifiers`, tests/verifiers_envs/vf_tiny_sums.py) and as a black-box agent on
the `openai` client through the agent gateway (`task.name=agent`, tests/agent_programs/calculator_agent.py), side by
side in one run, each through the actor's episode runner with an instant scripted policy (a calculator call,
then the sum), so that only the environment's side is timed: the actor's CPU ms per episode and per model
turn (the agent's own client included), and each adapter's overhead per turn over native.

    python tools/bench_env_adapters.py [--episodes 512] [--concurrency 64]

Needs the verifiers extra (`pip install -e '.[verifiers]'`). One warm-up batch runs before each measured run
(the verifiers environment's tool server and the gateway start then: not timed).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_summary import Summary  # noqa: E402

from pipelinerl.config import TaskConfig  # noqa: E402
from pipelinerl.config.actor import AgentTaskConfig, VerifiersConfig  # noqa: E402
from pipelinerl.envs.episode import EpisodeLimits  # noqa: E402
from pipelinerl.envs.runner import run_episode  # noqa: E402
from pipelinerl.tasks import get_task  # noqa: E402
from pipelinerl.tiny.model import build_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LIMITS = EpisodeLimits(max_turns=3, max_tokens_per_turn=20, max_total_tokens=96)


@dataclass
class Sampled:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finished: bool


def policy(tok, item):
    """The k-th call answered with the k-th turn of the item's solved episode, at once."""
    texts = ["==" + item.prompt[:-1] + "=", item.answer]
    calls = []

    async def generate(prefix: list[int], max_tokens: int) -> Sampled:
        ids = tok.encode(texts[min(len(calls), 1)], add_special_tokens=False) + [tok.eos_token_id]
        calls.append(1)
        return Sampled(ids, [-0.1] * len(ids), [0] * len(ids), True)

    return generate


async def run_batches(task, tok, items, concurrency: int) -> tuple[float, float, int, float]:
    """(CPU s, wall s, model turns, mean reward) of every item's episode, `concurrency` at a time."""
    cpu, wall, turns, rewards = time.process_time(), time.perf_counter(), 0, []
    for start in range(0, len(items), concurrency):
        batch = items[start:start + concurrency]
        results = await asyncio.gather(*[run_episode(policy(tok, i), task.environment(i), tok, LIMITS, 60.0)
                                         for i in batch])
        turns += sum(len(r.episode.model_turns) for r in results)
        rewards += [r.reward for r in results]
    return time.process_time() - cpu, time.perf_counter() - wall, turns, sum(rewards) / len(rewards)


async def measure(task, tok, n: int, concurrency: int) -> dict:
    items = task.train_items[:n + concurrency]
    await run_batches(task, tok, items[:concurrency], concurrency)  # warm-up (and the adapter's serving start)
    cpu, wall, turns, reward = await run_batches(task, tok, items[concurrency:], concurrency)
    return {"cpu_ms_per_episode": 1000 * cpu / n, "cpu_ms_per_turn": 1000 * cpu / turns, "wall_s": wall,
            "turns": turns, "reward": reward}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=64, help="episodes at once (a step's groups in flight)")
    p.add_argument("--summary", default=None, help="write the rows for tools/bench_all.py here")
    args = p.parse_args()
    tok = build_tokenizer()
    native = get_task(TaskConfig(name="tool_sums"))
    adapted = get_task(TaskConfig(name="verifiers", verifiers=VerifiersConfig(
        env="vf_tiny_sums", path=str(REPO / "tests" / "verifiers_envs"), args={"num_rows": 4 * args.episodes},
        tool_format="compact")))
    agent = get_task(TaskConfig(name="agent", agent=AgentTaskConfig(
        program="calculator_agent:agent", path=str(REPO / "tests" / "agent_programs"), tool_format="compact")))
    loop = asyncio.new_event_loop()
    try:
        rows = {"native (tool_sums)": loop.run_until_complete(measure(native, tok, args.episodes, args.concurrency)),
                "verifiers (vf_tiny_sums)": loop.run_until_complete(
                    measure(adapted, tok, args.episodes, args.concurrency)),
                "agent gateway (calculator_agent)": loop.run_until_complete(
                    measure(agent, tok, args.episodes, args.concurrency))}
        loop.run_until_complete(adapted.stop_serving())
        loop.run_until_complete(agent.gateway.stop())
    finally:
        loop.close()
    print(f"{args.episodes} episodes, {args.concurrency} at a time, instant scripted policy\n")
    print("| environment | actor CPU ms / episode | ms / model turn | turns | wall s | mean reward |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['cpu_ms_per_episode']:.2f} | {r['cpu_ms_per_turn']:.2f} | {r['turns']} | "
              f"{r['wall_s']:.2f} | {r['reward']:.2f} |")
    base = rows["native (tool_sums)"]
    summary = Summary("env_adapters")
    summary.add("native episode, actor CPU", base["cpu_ms_per_episode"], "ms")
    print()
    for name, r in list(rows.items())[1:]:
        extra = r["cpu_ms_per_turn"] - base["cpu_ms_per_turn"]
        print(f"{name}: {r['cpu_ms_per_episode'] / base['cpu_ms_per_episode']:.1f}x native's CPU per episode; "
              f"overhead per model turn {extra:.2f} ms")
        summary.add(f"{name.split(' (')[0]} episode, actor CPU", r["cpu_ms_per_episode"], "ms")
        summary.add(f"{name.split(' (')[0]} overhead per model turn", extra, "ms")
    if args.summary:
        summary.write(args.summary)


if __name__ == "__main__":
    main()

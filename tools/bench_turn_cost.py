"""What one turn of a long episode costs the actor as the episode grows (issue 46 item 3): a tool-calling
episode on a Qwen2.5-style chat template (the test suite's, on a byte-level BPE trained here) grows to
`--turns` model turns, each answered by two tool messages; the CPU ms of each turn's bookkeeping (appending the
sampled tokens, rendering and encoding the environment's reply) is recorded at turns 1, 10, 100, ... Side by
side in one run: the Episode as it renders (only the end of the conversation) and the same Episode rendering
the whole history every turn (what it falls back to for a template whose messages depend on the whole
history), with the ratio at the last turn.

    python tools/bench_turn_cost.py [--turns 200] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO / "tests"))
from bench_summary import Summary  # noqa: E402
from test_envs_episode import CALC, call_text, qwen_style_tokenizer, qwen_turn  # noqa: E402

from pipelinerl.envs import episode as episode_module  # noqa: E402
from pipelinerl.envs.episode import Episode, EpisodeLimits  # noqa: E402


def turn_costs(tok, turns: int) -> tuple[list[float], int]:
    """CPU ms of each turn (model turn + environment reply) of one episode, and its final token count."""
    episode = Episode(tok, [{"role": "user", "content": "What is 12*34+5? Use the calculator."}],
                      tools=[CALC.template_entry()], limits=EpisodeLimits(max_turns=turns + 1, max_total_tokens=10**8))
    sampled = qwen_turn(tok, "Let me compute it with the calculator.\n" + call_text("12*34"))
    reply = [{"role": "tool", "content": "408, and the answer is 413."}, {"role": "tool", "content": "413"}]
    costs = []
    for _ in range(turns):
        start = time.process_time()
        episode.add_model_turn(sampled, [0.0] * len(sampled), [0] * len(sampled), finished=True)
        episode.add_env_turn(reply)
        costs.append((time.process_time() - start) * 1000)
    return costs, len(episode.token_ids)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3, help="episodes per mode; the median turn cost is kept")
    parser.add_argument("--summary", type=Path, default=None)
    args = parser.parse_args()
    tok = qwen_style_tokenizer()
    marks = sorted({t for t in (1, 10, 100, 1000) if t < args.turns} | {args.turns})
    results = {}
    for mode in ("end of the conversation", "whole history"):
        episode_module._WHOLE_TEMPLATES.clear()
        if mode == "whole history":
            episode_module._WHOLE_TEMPLATES.add(str(tok.chat_template))
        runs = [turn_costs(tok, args.turns) for _ in range(args.repeats)]
        per_turn = [sorted(r[0][t - 1] for r in runs)[len(runs) // 2] for t in marks]
        results[mode] = per_turn
        print(f"{mode:>24}: " + ", ".join(f"turn {t}: {c:.2f} ms" for t, c in zip(marks, per_turn, strict=True))
              + f" ({runs[0][1]} tokens at turn {args.turns})")
    ratio = results["whole history"][-1] / results["end of the conversation"][-1]
    flat = results["end of the conversation"][-1] / results["end of the conversation"][0]
    print(f"turn {marks[-1]}: {ratio:.1f}x cheaper than rendering the whole history; {flat:.2f}x turn 1's cost")
    summary = Summary("turn_cost")
    summary.add(f"turn {marks[-1]} vs turn 1, CPU", flat, "x", "<= 2")
    summary.add(f"turn {marks[-1]}, whole history / end only", ratio, "x")
    summary.write(args.summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""reward.kind=judge: an instruct model served by `serve --reward` grades each completion against reward.rubric.

The actor sends one chat request per completion (the rubric with {prompt} and {completion} filled in, greedy, at
most reward.judge_max_tokens) to a reward server, and reads the verdict strictly: the answer's last non-empty line
must be `SCORE: <number>` with the number in [0, reward.judge_max_score]; the reward is number / judge_max_score.
Anything else (no such line, a number out of range, text after it) scores 0 and is counted, never guessed at: a
judge that drifts from the format shows as actor/judge_unparsed_frac, not as silently wrong rewards.
"""

from __future__ import annotations

import re

_VERDICT = re.compile(r"SCORE:[ \t]*([0-9]+(?:\.[0-9]+)?)")


def judge_messages(rubric: str, prompt: str, completion: str) -> list[dict]:
    """The judge's chat: one user message, the rubric with the request and the answer filled in (str.replace, so
    braces in either text are kept as they are)."""
    return [{"role": "user", "content": rubric.replace("{prompt}", prompt).replace("{completion}", completion)}]


def parse_verdict(text: str, max_score: float) -> float | None:
    """SCORE / max_score from the judge's last non-empty line, which must be exactly `SCORE: <number>` (spaces
    around allowed) with 0 <= number <= max_score; None when it is not."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    match = _VERDICT.fullmatch(lines[-1]) if lines else None
    if match is None:
        return None
    score = float(match.group(1))
    return score / max_score if score <= max_score else None

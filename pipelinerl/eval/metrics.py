"""Evaluation metrics of the actor's eval sets and `pipelinerl eval`, pure: per-item outcomes in, pass@k, mean
length, truncation rate, TensorBoard scalars and the printed table out. No I/O, no servers
(pipelinerl/eval/sets.py samples and grades the outcomes).

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code"):
with n samples of a prompt of which c succeed, the chance that k drawn without replacement include a
success is 1 - C(n-c, k) / C(n, k); the set's pass@k is its mean over prompts. (1 - (1 - c/n)^k, the
with-replacement version, is biased low.)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass
class ItemOutcome:
    """Every completion of one eval prompt, in the order the server returned them."""

    id: str  # PromptItem.id
    texts: list[str]
    rewards: list[float]  # task.reward of each text
    successes: list[bool]  # task.is_success of each reward
    lengths: list[int]  # completion tokens
    finished: list[bool]  # ended by EOS; False: cut at actor.sampling.max_new_tokens

    def __post_init__(self) -> None:
        n = len(self.texts)
        assert n > 0 and all(len(x) == n for x in (self.rewards, self.successes, self.lengths, self.finished)), \
            f"item {self.id}: per-completion lists of unequal lengths"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt: n samples, c of them successes, k drawn without replacement."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k includes a success
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # exact integers: no overflow for large n


def ks_for(n: int) -> list[int]:
    """The k reported for n samples a prompt: the powers of two up to n (1, 2, 4, ...) and n itself."""
    assert n >= 1, n
    return sorted({2 ** i for i in range(n.bit_length()) if 2 ** i <= n} | {n})


def summarize(items: list[ItemOutcome]) -> dict:
    """One mode's metrics over a set's items (every item with the same number of samples n):
    {"n", "items", "pass@k": {k: mean pass@k}, "mean_reward", "mean_length", "truncation_rate"}."""
    if not items:
        raise ValueError("no eval items to summarize (is actor.eval_samples 0?)")
    n = len(items[0].texts)
    assert all(len(i.texts) == n for i in items), "items of one mode have different sample counts"
    rewards = [r for i in items for r in i.rewards]
    lengths = [x for i in items for x in i.lengths]
    finished = [f for i in items for f in i.finished]
    return {
        "n": n,
        "items": len(items),
        "pass@k": {str(k): sum(pass_at_k(n, sum(i.successes), k) for i in items) / len(items) for k in ks_for(n)},
        "mean_reward": sum(rewards) / len(rewards),
        "mean_length": sum(lengths) / len(lengths),
        "truncation_rate": 1.0 - sum(finished) / len(finished),
    }


def scalars(name: str, summary: dict) -> dict[str, float]:
    """The actor's TensorBoard scalars of one eval set's summary: eval/<name>/pass@1, pass@<n> (n: the set's
    samples per prompt), mean_length (tokens) and truncation_rate."""
    n, pass_at = summary["n"], summary["pass@k"]
    return {f"eval/{name}/pass@1": pass_at["1"], f"eval/{name}/pass@{n}": pass_at[str(n)],
            f"eval/{name}/mean_length": summary["mean_length"],
            f"eval/{name}/truncation_rate": summary["truncation_rate"]}


def mode_report(items: list[ItemOutcome], temperature: float) -> dict:
    """A mode's section of the JSON report: its summary, its temperature and every item's outcomes."""
    return {**summarize(items), "temperature": temperature, "outcomes": [asdict(i) for i in items]}


def format_table(report: dict) -> str:
    """The report as a text table: one row per (set, mode), a column per k."""
    rows = [(name, mode, m) for name, modes in report["sets"].items() for mode, m in modes.items()]
    ks = sorted({int(k) for _, _, m in rows for k in m["pass@k"]})
    head = ["set", "mode", "n", "items", *(f"pass@{k}" for k in ks), "mean_len", "trunc"]
    body = [[name, mode, str(m["n"]), str(m["items"]),
             *(f"{m['pass@k'][str(k)]:.3f}" if str(k) in m["pass@k"] else "-" for k in ks),
             f"{m['mean_length']:.1f}", f"{m['truncation_rate']:.3f}"] for name, mode, m in rows]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = [f"model {report['model']} (policy version {report['policy_version']})"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [head, *body]]
    return "\n".join(lines)

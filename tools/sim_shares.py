"""How evenly a step's groups reach the trainer ranks: the per-segment rule the trainer used before
(each rank kept group `index` of segment `seq` of writer `w` when (index + seq + crc32(w)) % W == rank)
against rank 0's exact split (pipelinerl/trainer/step_data.py), simulated on one actor's stream.

A segment holds a random 1..max_groups groups (a writer publishes on rows, bytes or age). Per batch of
`groups` groups the table gives the largest share difference between two ranks, how many batches left
some rank short of its groups/W (with max_lag 0 or conventional mode the actor then stops at its bound
and that rank waits for groups that never come), and the largest cumulative drift of a rank's position
over the run (with a lag slack the drift is trained, so the lag bound breaks). The exact split's
token balance over a long-tailed length distribution is reported against plain round-robin.

    python tools/sim_shares.py [--ranks 8] [--groups 1024] [--batches 200] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import sys
import zlib

from pipelinerl.trainer.step_data import split_groups


def old_rule_owners(n_groups: int, world: int, max_groups: int, rng: random.Random,
                    writer: str = "actor0") -> list[int]:
    """The rank that owned each group of the stream under the per-segment rule."""
    owners, seq, salt = [], 0, zlib.crc32(writer.encode())
    while len(owners) < n_groups:
        size = rng.randint(1, max_groups)
        owners += [(index + seq + salt) % world for index in range(size)]
        seq += 1
    return owners[:n_groups]


def exact_split_owners(n_groups: int, world: int, groups: int, rng: random.Random) -> list[int]:
    """The rank each group goes to under rank 0's split, batch by batch (token counts random)."""
    owners = [0] * n_groups
    for start in range(0, n_groups, groups):
        tokens = [rng.randint(1, 1000) for _ in range(groups)]
        for rank, share in enumerate(split_groups(tokens, world)):
            for i in share:
                owners[start + i] = rank
    return owners


def share_stats(owners: list[int], world: int, groups: int, batches: int) -> dict:
    per_rank = groups // world
    worst_gap, short_batches, worst_drift = 0, 0, 0
    counts = [0] * world
    for b in range(batches):
        batch = [0] * world
        for owner in owners[b * groups:(b + 1) * groups]:
            batch[owner] += 1
            counts[owner] += 1
        worst_gap = max(worst_gap, max(batch) - min(batch))
        need = per_rank * (b + 1)
        short_batches += min(counts) < need
        worst_drift = max(worst_drift, max(abs(c - need) for c in counts))
    return {"largest share gap (groups)": worst_gap, "batches with a short rank": short_batches,
            "largest cumulative drift (groups)": worst_drift}


def token_balance(world: int, groups: int, batches: int, rng: random.Random) -> tuple[float, float]:
    """Mean over batches of max rank tokens / mean rank tokens: (exact split, round-robin)."""
    ratios = ([], [])
    for _ in range(batches):
        tokens = [int(rng.paretovariate(1.5) * 200) for _ in range(groups)]  # most short, a few very long
        mean = sum(tokens) / world
        round_robin = [list(range(r, groups, world)) for r in range(world)]
        for k, shares in enumerate((split_groups(tokens, world), round_robin)):
            ratios[k].append(max(sum(tokens[i] for i in s) for s in shares) / mean)
    return sum(ratios[0]) / batches, sum(ratios[1]) / batches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--groups", type=int, default=1024, help="groups per optimizer step (S / G)")
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--max-segment-groups", type=int, default=16, help="segment_max_rows / G (256 / 16)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    n = args.groups * args.batches
    old = share_stats(old_rule_owners(n, args.ranks, args.max_segment_groups, rng), args.ranks, args.groups,
                      args.batches)
    new = share_stats(exact_split_owners(n, args.ranks, args.groups, rng), args.ranks, args.groups, args.batches)
    exact, round_robin = token_balance(args.ranks, args.groups, min(args.batches, 50), rng)
    print(f"{args.ranks} ranks, {args.groups}-group steps, {args.batches} steps, "
          f"segments of 1..{args.max_segment_groups} groups")
    print(f"{'':36}{'per-segment rule':>18}{'exact split':>14}")
    for key, value in old.items():
        print(f"{key:36}{value:>18}{new[key]:>14}")
    print(f"{'max rank tokens / mean (long tail)':36}{round_robin:>18.3f}{exact:>14.3f}  (round-robin vs balanced)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

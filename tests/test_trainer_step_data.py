"""Each step's groups split exactly over trainer ranks (trainer/step_data.py): the balanced split alone,
then 3 real gloo processes reading a stream whose segments hold 1, 2, 1, 3, ... groups (the shape that
made per-rank shares drift), a starved step, and a stop signal while rank 0 waits for data
(every rank names it)."""

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from pipelinerl.config import StreamsConfig, load_config
from pipelinerl.launch.procs import free_port
from pipelinerl.streams import StreamWriter
from pipelinerl.trainer.step_data import split_groups

G, WORLD, GROUPS_PER_RANK = 4, 3, 2
GROUPS_PER_STEP = WORLD * GROUPS_PER_RANK


def test_split_gives_every_rank_exactly_its_count_balanced_by_tokens():
    tokens = [100, 1, 1, 1, 1, 1, 50, 50, 1, 1, 1, 1]  # long-tailed: two long groups and one very long
    shares = split_groups(tokens, 3)
    assert [len(s) for s in shares] == [4, 4, 4]
    assert sorted(i for s in shares for i in s) == list(range(12))  # disjoint and complete
    assert all(s == sorted(s) for s in shares)  # stream order within a rank
    loads = sorted(sum(tokens[i] for i in s) for s in shares)
    assert loads == [53, 53, 103]  # 100 alone; the two 50s apart; the ones fill up (hand-computed)
    assert split_groups(tokens, 3) == shares  # deterministic
    assert split_groups([5, 5, 5, 5], 2) == [[0, 2], [1, 3]]  # ties: lower index to the lower rank
    with pytest.raises(AssertionError):
        split_groups([1, 2, 3], 2)


def _row(g: int, a: int) -> dict:
    n = 1 + (g * 5 + a) % 7
    return {"run_id": "t", "group_id": f"g{g}", "sample_id": f"g{g}/{a}", "prompt_token_ids": [1, 2, 3],
            "completion_token_ids": [4] * n, "behaviour_logprobs": [-1.0] * n, "versions": [0] * n,
            "reward": float(a == 0), "finished": True, "truncated": False, "task": "addition", "actor_id": "w"}


def write_uneven_segments(run_dir: Path, groups: int) -> None:
    """Segments of 1, 2, 1, 3, 1, 2, 1, 3, ... groups."""
    sizes, in_segment = [1, 2, 1, 3], 0
    with StreamWriter(run_dir, "rollouts", "actor0", StreamsConfig(segment_max_seconds=3600)) as writer:
        for g in range(groups):
            writer.write_group([_row(g, a) for a in range(G)])
            in_segment += 1
            if in_segment == sizes[0]:
                writer.flush()
                sizes, in_segment = sizes[1:] + sizes[:1], 0


def _rank_main(rank: int, port: int, run_dir: str, out_dir: str, steps: int, data_timeout_s: float) -> None:
    import torch.distributed as dist

    from pipelinerl.trainer.checkpoints import StopSignals
    from pipelinerl.trainer.dist import DistInfo
    from pipelinerl.trainer.step_data import StepData, StreamStarved

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    cfg = load_config(None, [f"run_dir={run_dir}", "model.path=unused", f"actor.attempts={G}",
                             f"trainer.samples_per_step={G * GROUPS_PER_STEP}",
                             f"trainer.data_timeout_s={data_timeout_s}",
                             "trainer.dist_timeout_s=120", "streams.poll_interval_s=0.05"])
    signals = StopSignals()
    signals.install()
    data = StepData(cfg, DistInfo(rank, WORLD, rank, "gloo"), None, lambda: signals.received is not None)
    got, outcome = [], "done"
    for step in range(steps):
        Path(out_dir, f"waiting{rank}_{step}").touch()
        try:
            batches = data.next_step(step)
        except StreamStarved as err:
            outcome = f"starved: {err}"
            break
        if batches is None:
            outcome = f"stop {signals.requested()}"  # the signal's number, agreed over ranks (loop.py logs it)
            break
        got.append([b.column("group_id")[0].as_py() for b in batches])
    result = {"got": got, "outcome": outcome, "ended": time.time(), "cursor": data.cursor()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _run_ranks(tmp_path: Path, steps: int, data_timeout_s: float, signal_rank0_at_step: int | None = None):
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, str(tmp_path), str(tmp_path), steps, data_timeout_s))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    signalled_at = None
    if signal_rank0_at_step is not None:
        marker = tmp_path / f"waiting0_{signal_rank0_at_step}"
        deadline = time.monotonic() + 120
        while not marker.exists():  # rank 0 is about to wait for data that never comes
            assert time.monotonic() < deadline and procs[0].is_alive(), "rank 0 never reached the step"
            time.sleep(0.05)
        signalled_at = time.time()
        os.kill(procs[0].pid, signal.SIGUSR1)
    for p in procs:
        p.join(timeout=180)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return results, signalled_at


def test_three_ranks_get_exact_shares_then_a_clear_starvation_error(tmp_path):
    write_uneven_segments(tmp_path, 4 * GROUPS_PER_STEP)
    started = time.monotonic()
    results, _ = _run_ranks(tmp_path, steps=5, data_timeout_s=2.0)
    for step in range(4):
        shares = [r["got"][step] for r in results]
        assert [len(s) for s in shares] == [GROUPS_PER_RANK] * WORLD, shares
        # Step t is exactly groups 6t .. 6t+5 of the stream, each once.
        assert sorted(g for s in shares for g in s) == sorted(f"g{g}" for g in range(6 * step, 6 * step + 6))
    for r in results:  # the fifth step never came: every rank says so, naming the stream and the cursor
        assert r["outcome"].startswith("starved: trainer step 4 waited 2 s")
        assert str(tmp_path / "streams" / "rollouts") in r["outcome"] and "'actor0'" in r["outcome"]
        assert "got 0" in r["outcome"] and "stream cursor at the step's start" in r["outcome"]
    assert time.monotonic() - started < 120
    assert results[0]["cursor"]["next"]["actor0"][1] >= 0 and results[1]["cursor"] is None


def test_a_stop_signal_while_rank0_waits_for_data_stops_every_rank_within_seconds(tmp_path):
    write_uneven_segments(tmp_path, GROUPS_PER_STEP)  # one step's worth, then nothing
    results, signalled_at = _run_ranks(tmp_path, steps=3, data_timeout_s=100.0, signal_rank0_at_step=1)
    # Not starved (the 100 s never ran out); ranks 1 and 2, never signalled, name rank 0's SIGUSR1.
    assert [r["outcome"] for r in results] == [f"stop {int(signal.SIGUSR1)}"] * WORLD
    assert all(len(r["got"]) == 1 for r in results)
    delays = [r["ended"] - signalled_at for r in results]
    print(f"stop signal -> every rank out of next_step: {max(delays):.2f} s")
    assert max(delays) < 30

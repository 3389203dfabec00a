"""tools/bench_pipeline_vs_conventional.py's CPU time per role, on a fake run: a `pipelinerl.cli run` process
that starts an actor and a server (each leading a process group of its own, as the launcher starts roles),
the server with an engine-core child named as vLLM names it. Each burns a known amount of CPU time. Then its
episode statistics, from a hand-written stream."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))

from bench_pipeline_vs_conventional import (  # noqa: E402
    ENGINE_CORE,
    EVAL_SERVER,
    RoleCpuSampler,
    _stream_stats,
    cpu_per_role,
    mean_success,
    role_of,
    seed_rows,
    spread,
)

# burns `cpu_s` of its own CPU time, then waits for the file `stop`
BURN = """
import sys, time
cpu_s, stop = float(sys.argv[1]), sys.argv[2]
t = time.process_time()
while time.process_time() - t < cpu_s:
    pass
while not __import__("os").path.exists(stop):
    time.sleep(0.05)
"""
LAUNCHER = """
import subprocess, sys
burn, stop = sys.argv[1], sys.argv[2]
engine = "open('/proc/self/comm', 'w').write('VLLM::EngineCore')\\n" + burn
server = ("import subprocess, sys\\n"
          f"subprocess.run([sys.executable, '-c', {engine!r}, '0.6', {stop!r}])")
roles = [subprocess.Popen([sys.executable, "-c", burn, "1.0", stop, "pipelinerl.cli", "actor"], start_new_session=True),
         subprocess.Popen([sys.executable, "-c", server, "pipelinerl.cli", "serve"], start_new_session=True)]
for role in roles:
    role.wait()
"""


@contextlib.contextmanager
def sampling(argv: list[str], stop: Path):
    """Start the fake launcher and a sampler of its tree; on exit, let its processes end (the file `stop`) and
    stop the sampler."""
    launcher = subprocess.Popen(argv)
    sampler = RoleCpuSampler(launcher.pid, period_s=0.05)
    sampler.start()
    try:
        yield sampler
    finally:
        stop.touch()
        launcher.wait(timeout=60)
        sampler.stop.set()
        sampler.join()


def test_cpu_time_is_split_by_role(tmp_path):
    stop = tmp_path / "stop"
    with sampling([sys.executable, "-c", LAUNCHER, BURN, str(stop), "pipelinerl.cli", "run"], stop) as sampler:
        # every role sampled, and each burner's CPU time burnt, before its processes are let go (bounded: a
        # loaded machine is slower)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            latest = sampler.samples[-1][1] if sampler.samples else {}
            if ("server API" in latest and "launcher" in latest and latest.get("actor", 0) >= 1.0
                    and latest.get(ENGINE_CORE, 0) >= 0.6):
                break
            time.sleep(0.1)
    first, last = sampler.samples[0], sampler.samples[-1]
    totals = last[1]
    assert 1.0 <= totals["actor"] < 1.5
    assert 0.6 <= totals[ENGINE_CORE] < 1.0
    assert totals["server API"] < 0.5 and totals["launcher"] < 0.5  # they only start processes and wait
    assert set(totals) == {"actor", ENGINE_CORE, "server API", "launcher"}
    # a role seen stays, through the roles' exits too (an exiting process keeps its last sample: its command
    # line is gone by then, and its parents' would count it as the launcher's)
    roles_seen = [set(t) for _, t in sampler.samples]
    assert all(a <= b for a, b in zip(roles_seen, roles_seen[1:]))
    # over a window: the difference of the samples nearest to its ends
    window = cpu_per_role(sampler.samples, first[0], last[0])
    assert window == {role: cpu_s - first[1].get(role, 0.0) for role, cpu_s in totals.items()}
    assert cpu_per_role([], 0, 1) == {}


class FakeProc:
    """A psutil.Process stand-in: its command line reads, one per call (the last repeats), and its parent."""

    def __init__(self, *reads: list[str], parent: FakeProc | None = None):
        self.reads, self._parent = list(reads), parent

    def cmdline(self) -> list[str]:
        return self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]

    def name(self) -> str:
        return self.reads[0][0] if self.reads[0] and self.reads[0][0].startswith("VLLM::") else "python"

    def parent(self) -> FakeProc | None:
        return self._parent


def test_a_role_exiting_between_reads_is_not_passed_to_its_parent():
    """A process whose command line is gone by a second read (it is exiting) keeps its own role, or none:
    never its parent's (the launcher's, which replaced a role the sampler had seen, and lost it)."""
    launcher = FakeProc(["python", "-c", "...", "pipelinerl.cli", "run"])
    actor = FakeProc(["python", "-c", "...", "pipelinerl.cli", "actor"], [], parent=launcher)
    assert role_of(actor) == "actor"
    assert role_of(actor) is None  # exiting by now
    # a child of an exiting role: its parent's role can't be told, and the grandparent's isn't its own
    server = FakeProc([], parent=launcher)
    assert role_of(FakeProc(["python", "-c", "..."], parent=server)) is None
    assert role_of(FakeProc(["python", "-c", "..."], parent=launcher)) == "launcher"
    assert role_of(FakeProc(["python", "-c", "..."])) is None  # outside the run


def test_an_evaluation_server_is_a_role_of_its_own_engine_core_included():
    """`serve --eval` (inference.eval_servers) and the engine core vLLM starts under it count as the evaluation
    server; a training server's engine core stays apart from its API server."""
    launcher = FakeProc(["python", "-m", "pipelinerl.cli", "run", "c.yaml"])
    train = FakeProc(["python", "-m", "pipelinerl.cli", "serve", "c.yaml", "--port", "1"], parent=launcher)
    evaluation = FakeProc(["python", "-m", "pipelinerl.cli", "serve", "c.yaml", "--eval", "--port", "2"],
                          parent=launcher)
    assert role_of(train) == "server API" and role_of(FakeProc(["VLLM::EngineCore"], parent=train)) == ENGINE_CORE
    assert role_of(evaluation) == EVAL_SERVER == role_of(FakeProc(["VLLM::EngineCore"], parent=evaluation))


def test_processes_outside_the_roles_are_not_counted(tmp_path):
    stop = tmp_path / "stop"
    other = textwrap.dedent("""
        import subprocess, sys
        subprocess.run([sys.executable, "-c", sys.argv[1], "0.3", sys.argv[2]])
    """)
    with sampling([sys.executable, "-c", other, BURN, str(stop)], stop) as sampler:  # no `pipelinerl.cli` role
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(sampler.samples) < 20:
            time.sleep(0.1)
    assert len(sampler.samples) >= 20 and all(totals == {} for _, totals in sampler.samples)


def test_stream_statistics_count_model_tokens_turns_and_straddling(tmp_path):
    from pipelinerl.config import StreamsConfig
    from pipelinerl.streams import Rollout, StreamWriter

    def row(k: int, mask: list[int], versions: list[int], turns: int) -> Rollout:
        n = len(mask)
        return Rollout(run_id="r", group_id="g", sample_id=f"g/{k}", prompt_token_ids=[1], completion_token_ids=[5] * n,
                       behaviour_logprobs=[0.0] * n, versions=versions, loss_mask=mask, reward=0.0, finished=True,
                       truncated=False, task="t", actor_id="a", turns=turns, created_at=100.0,
                       end_reason="finished" if k else "env_error")

    with StreamWriter(tmp_path, "rollouts", "a", StreamsConfig()) as writer:
        writer.write_group([row(0, [1, 1, 0, 0, 1], [3, 3, -1, -1, 4], 2), row(1, [1, 1, 1], [4, 4, 4], 1)])
    stats = _stream_stats(tmp_path, 0.0, 200.0)
    assert stats["tokens"] == 6 and stats["lengths"] == [3, 3] and stats["turn_lengths"] == [2, 1, 3]
    assert stats["turns"] == [2, 1] and stats["straddling"] == [True, False]
    assert stats["end_reasons"] == {"env_error": 1, "finished": 1}
    assert _stream_stats(tmp_path, 0.0, 50.0)["tokens"] == 0  # received before the window


def test_the_mean_held_out_success_is_the_area_under_the_curve_over_the_budget():
    """Each evaluated version counts from the end of its step until the next one's, 0 before the first: by hand,
    0 for 10 s, 0.2 for 20 s, 0.6 for the last 10 s of a 40 s budget (a later evaluation is past it)."""
    curve = [(10.0, 0.2), (30.0, 0.6), (50.0, 0.9)]
    assert abs(mean_success(curve, 40.0) - (0.2 * 20 + 0.6 * 10) / 40) < 1e-12
    assert mean_success([], 10.0) == 0.0 and mean_success([(0.0, 0.5)], 10.0) == 0.5


def test_the_repeats_give_each_ratio_its_median_and_range():
    runs = [{"pipeline": {"samples_per_s": p, "mean_success": 0.5, "time_to_target_s": tp},
             "conventional": {"samples_per_s": c, "mean_success": 0.25, "time_to_target_s": tc}}
            for p, c, tp, tc in ((30.0, 10.0, 10.0, 20.0), (20.0, 10.0, 10.0, 40.0), (40.0, 10.0, None, 30.0))]
    rows = {label: ratios for label, _, _, ratios in seed_rows(runs, [0.5])}
    assert rows["samples trained / s"] == [3.0, 2.0, 4.0] and spread(rows["samples trained / s"]) == "3.00 [2.00, 4.00]"
    assert rows["mean held-out success"] == [2.0, 2.0, 2.0]
    assert rows["s to held-out 0.50"] == [2.0, 4.0, None] and spread(rows["s to held-out 0.50"]) == "n/a"

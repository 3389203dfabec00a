"""Slurm launch: the sbatch scripts' rendered srun lines and headers (fast), then real jobs on a
throw-away Slurm cluster on this machine (tests/slurm/start_cluster.sh, slow): the tiny pipeline as a
heterogeneous job, a requeue mid-run that must neither lose nor repeat a sample, and a submitit sweep.

The cluster runs as root with state under /tmp; its daemons are stopped when the session ends.
"""

import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pipelinerl.config import StreamsConfig, load_config
from pipelinerl.launch.slurm import check_config, dry_run_allocation, plan_roles
from pipelinerl.launch.slurm_node import _node_gpus, node_server_roles
from pipelinerl.metrics import read_token_stats
from pipelinerl.streams import StreamReader

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = {"run_7b.sh": "configs/qwen7b_orz.yaml", "run_32b.sh": "configs/qwen32b_orz.yaml",
           "run_tiny.sh": "configs/tiny_cpu.yaml"}
CLUSTER_STATE = "/tmp/pipelinerl-slurm-tests"
SAMPLES_PER_STEP = 32


def _tiny_overrides(run_dir: Path, model_dir: Path, max_steps: int, port: int = 18400) -> list[str]:
    """A shortened tiny run on ports of this test module's range (18400-18499)."""
    return [f"run_dir={run_dir}", f"model.path={model_dir}", "model.build_tiny_if_missing=false",
            f"trainer.max_steps={max_steps}", f"trainer.samples_per_step={SAMPLES_PER_STEP}",
            "actor.sampling.max_new_tokens=8", "actor.eval_every_steps=0", "actor.max_groups_in_flight=8",
            "inference.max_model_len=64", "streams.segment_max_seconds=0.5", "checkpoints.every_steps=null",
            f"inference.base_port={port}", f"trainer.broadcast_port={port + 10}", f"launch.slurm.master_port={port + 20}"]


# -- rendered commands and script headers (no cluster) -----------------------------------------------------

def _dry_run(script: str) -> dict[str, tuple[dict[str, str], list[str]]]:
    """role -> (environment, srun argv) as `bash slurm/<script> --dry-run` prints them."""
    out = subprocess.run(["bash", f"slurm/{script}", "--dry-run"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PIPELINERL_PYTHON=sys.executable), check=True).stdout
    roles, lines = {}, out.splitlines()
    for header, command in itertools.pairwise(lines):
        if found := re.match(r"# (\w+) \(log ", header):
            argv = shlex.split(command)
            env = dict(a.split("=", 1) for a in argv[:argv.index("srun")])
            roles[found.group(1)] = (env, argv[argv.index("srun"):])
    assert set(roles) == {"servers", "trainer", "actor"}, out
    return roles


def _rank_command(trainer: list[str]) -> str:
    """The per-task shell command of the trainer step: Slurm's task variables -> torch.distributed's."""
    assert trainer[-3:-1] == ["bash", "-c"]
    command = trainer[-1]
    assert command.startswith('RANK="$SLURM_PROCID" WORLD_SIZE="$SLURM_NTASKS" LOCAL_RANK="$SLURM_LOCALID" exec ')
    return command


def test_7b_script_renders_one_inference_and_one_training_node():
    roles = _dry_run("run_7b.sh")
    servers = roles["servers"][1]
    assert servers[:7] == ["srun", "--het-group=0", "--nodes=1", "--nodelist=inference0", "--ntasks=1",
                           "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert "--gpus-per-node=8" in servers  # the node's servers agent splits them, one GPU per server
    assert servers[-7:] == ["slurm", "servers", "runs/qwen7b_orz/config.yaml", "--model", "/models/Qwen2.5-7B",
                            "--version", "0"]
    env, trainer = roles["trainer"]
    assert trainer[1:6] == ["--het-group=1", "--nodes=1", "--nodelist=training0", "--ntasks=8", "--ntasks-per-node=8"]
    assert "--gpus-per-node=8" in trainer and "--overlap" in trainer
    assert _rank_command(trainer).endswith("-m pipelinerl.cli train runs/qwen7b_orz/config.yaml")
    assert env["MASTER_ADDR"] == "training0" and env["MASTER_PORT"].isdigit()
    actor = roles["actor"][1]
    assert actor[1:6] == ["--het-group=1", "--nodes=1", "--nodelist=training0", "--ntasks=1", "--ntasks-per-node=1"]
    assert "--overlap" in actor and not any(a.startswith("--gpus") for a in actor)


def test_32b_script_renders_two_inference_and_two_training_nodes():
    roles = _dry_run("run_32b.sh")
    assert roles["servers"][1][1:6] == ["--het-group=0", "--nodes=2", "--nodelist=inference0,inference1",
                                        "--ntasks=2", "--ntasks-per-node=1"]
    env, trainer = roles["trainer"]
    assert trainer[1:6] == ["--het-group=1", "--nodes=2", "--nodelist=training0,training1", "--ntasks=16",
                            "--ntasks-per-node=8"]
    assert "--gpus-per-node=8" in trainer and env["MASTER_ADDR"] == "training0"
    _rank_command(trainer)
    assert roles["actor"][1][1:4] == ["--het-group=1", "--nodes=1", "--nodelist=training0"]
    # Each inference node splits its 8 GPUs into two tensor-parallel groups of 4, one server each.
    cfg = load_config(REPO / "configs/qwen32b_orz.yaml")
    os.environ["CUDA_VISIBLE_DEVICES"] = "0,1,2,3,4,5,6,7"
    try:
        assert _node_gpus(cfg) == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
    finally:
        del os.environ["CUDA_VISIBLE_DEVICES"]


def _sbatch_components(script: str) -> tuple[dict[str, str], list[dict[str, str]]]:
    """(job-wide #SBATCH options, per-component options) of a het-job script."""
    job, components = {}, [{}]
    for line in (REPO / "slurm" / script).read_text().splitlines():
        if not line.startswith("#SBATCH"):
            continue
        if line.split()[1] == "hetjob":
            components.append({})
            continue
        for opt in line.split()[1:]:
            key, _, value = opt.lstrip("-").partition("=")
            per_component = ("nodes", "ntasks-per-node", "gpus-per-node", "exclusive", "mem")
            target = components[-1] if key in per_component else job
            target[key] = value
    return job, components


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_sbatch_lines_match_the_script_config(script):
    cfg = load_config(REPO / SCRIPTS[script])
    check_config(cfg)
    s = cfg.launch.slurm
    job, (inference, training) = _sbatch_components(script)
    assert job["signal"] == f"B:USR1@{s.signal_seconds}" and "requeue" in job and job["time"] == s.time
    assert int(inference["nodes"]) == s.inference_nodes and int(training["nodes"]) == s.training_nodes
    for component in (inference, training):
        assert component.get("gpus-per-node") == (None if s.gpus_per_node is None else str(s.gpus_per_node))
    # One task per node for the servers agent; one per trainer rank (per GPU) on the training nodes.
    assert inference["ntasks-per-node"] == "1" and training["ntasks-per-node"] == str(s.gpus_per_node or 1)


def _shellcheck() -> str:
    if shutil.which("shellcheck") is None:  # CI starts from a bare Debian: install it like the cluster packages
        subprocess.run(["apt-get", "update", "-qq"], check=True, timeout=300)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "shellcheck"], check=True,
                       timeout=600, env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    return "shellcheck"


def test_scripts_pass_bash_n_and_shellcheck():
    scripts = sorted(str(p.relative_to(REPO)) for p in [*(REPO / "slurm").glob("*.sh"),
                                                         *(REPO / "tests" / "slurm").glob("*.sh")])
    for script in scripts:
        subprocess.run(["bash", "-n", script], cwd=REPO, check=True, timeout=60)
    out = subprocess.run([_shellcheck(), "-x", *scripts], check=False, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout


def test_trainer_ranks_must_match_the_training_gpus():
    cfg = load_config(REPO / "configs/qwen7b_orz.yaml", ["trainer.num_gpus=16"])
    with pytest.raises(ValueError, match="trainer.num_gpus=16 .* gives 8 trainer ranks"):
        check_config(cfg)


def test_reference_servers_take_the_first_slots_of_the_first_inference_node(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    plain = load_config(REPO / "configs/qwen32b_orz.yaml")
    cfg = load_config(REPO / "configs/qwen32b_orz.yaml", ["rl.kl_coef=0.05"])
    check_config(cfg)
    path = Path(cfg.run_dir) / "config.yaml"
    assert "--reference-node" not in plan_roles(plain, dry_run_allocation(plain), path)["servers"].argv
    assert plan_roles(cfg, dry_run_allocation(cfg), path)["servers"].argv[-2:] == ["--reference-node", "inference0"]
    base, n = cfg.inference.base_port, cfg.inference.num_servers
    reference, policy = node_server_roles(cfg, str(path), "/ckpt/hf", 7, "inference0", references=1)
    assert (reference.name, reference.env["CUDA_VISIBLE_DEVICES"]) == ("reference0", "0,1,2,3")
    assert reference.argv[reference.argv.index("serve") + 1:] == ["--config", str(path), "--reference", "--port",
                                                                  str(base + n)]
    assert (policy.name, policy.env["CUDA_VISIBLE_DEVICES"]) == ("server1", "4,5,6,7")
    assert policy.argv[policy.argv.index("--model"):][:6] == ["--model", "/ckpt/hf", "--port", str(base + 1),
                                                              "--version", "7"]
    assert [r.name for r in node_server_roles(cfg, str(path), "/ckpt/hf", 7, "inference1", references=0)] == [
        "server0", "server1"]


def test_reference_servers_must_fit_the_first_node_and_leave_a_policy_server():
    with pytest.raises(ValueError, match="take all 1 server slots .* and leave no policy server"):
        check_config(load_config(REPO / "configs/tiny_cpu.yaml", ["rl.kl_coef=0.1"]))
    check_config(load_config(REPO / "configs/tiny_cpu.yaml", ["rl.kl_coef=0.1", "inference.num_servers=2"]))
    with pytest.raises(ValueError, match="which has inference.num_servers=8"):
        check_config(load_config(REPO / "configs/qwen7b_orz.yaml", ["rl.kl_coef=0.1", "inference.reference_servers=9"]))


# -- real jobs on the local cluster (slow) ------------------------------------------------------------------

@pytest.fixture(scope="session")
def slurm_env():
    """A throw-away cluster for this session (installs slurm-wlm, munge, MariaDB when missing)."""
    env = dict(os.environ, PIPELINERL_SLURM_STATE=CLUSTER_STATE, PIPELINERL_SLURM_PORT="16900")
    stop = [str(REPO / "tests/slurm/stop_cluster.sh")]
    subprocess.run(stop, env=env, check=True, timeout=300)  # what an interrupted session may have left
    started = time.monotonic()
    out = subprocess.run([str(REPO / "tests/slurm/start_cluster.sh")], check=False, env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    print(f"slurm cluster up in {time.monotonic() - started:.0f} s")
    bin_dir = str(Path(sys.executable).parent)  # the job's `python3` and torchrun: this environment's
    try:
        yield dict(env, SLURM_CONF=f"{CLUSTER_STATE}/slurm.conf", HF_HUB_OFFLINE="1",
                   PATH=f"{bin_dir}:{env['PATH']}", PIPELINERL_PYTHON=sys.executable)
    finally:
        subprocess.run(stop, env=env, check=True, timeout=300)


def _slurm(env: dict, *argv: str) -> str:
    return subprocess.run(argv, env=env, capture_output=True, text=True, check=True, timeout=60).stdout


def _sbatch(env: dict, tmp_path: Path, overrides: list[str]) -> str:
    """Submit slurm/run_tiny.sh from the repository root (as users do); returns the job id."""
    out = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/slurm-%j.out", "slurm/run_tiny.sh",
                          *overrides], env=env, cwd=REPO, capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.strip()


def _wait_until(what: str, ready, timeout_s: float, poll_s: float = 1.0, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
            raise TimeoutError(f"{what} not seen after {timeout_s:.0f} s\n{tail}")
        time.sleep(poll_s)


def _job_finished(env: dict, job_id: str) -> bool:
    return not _slurm(env, "squeue", "-h", "-j", job_id, "-o", "%i").strip()


def _sacct(env: dict, job_id: str) -> list[dict]:
    """Accounting rows of a job (every restart: -D), once slurmdbd has the finished components."""
    fields = ["JobID", "JobName", "NodeList", "State"]

    def rows() -> list[dict]:
        out = _slurm(env, "sacct", "-D", "-n", "-P", "-j", job_id, "-o", ",".join(fields))
        return [dict(zip(fields, line.split("|"))) for line in out.splitlines()]

    _wait_until(f"sacct records of job {job_id}", lambda: sum(r["State"] == "COMPLETED" and "." not in r["JobID"]
                                                                for r in rows()) >= 2, timeout_s=60)
    return rows()


def _meta(run_dir: Path) -> dict:
    latest = max((run_dir / "checkpoints").glob("step_*[0-9]"))
    return json.loads((latest / "meta.json").read_text())


@pytest.mark.slow
def test_tiny_het_job_completes_with_checkpoint_and_tensorboard(slurm_env, tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    job = _sbatch(slurm_env, tmp_path, _tiny_overrides(run_dir, tiny_model_dir, max_steps=6))
    _wait_until(f"the end of job {job}", lambda: _job_finished(slurm_env, job), timeout_s=420,
                log=tmp_path / f"slurm-{job}.out")
    print(f"tiny het job: {time.monotonic() - started:.0f} s from sbatch to its end")
    rows = _sacct(slurm_env, job)
    components = {r["JobID"]: r for r in rows if "." not in r["JobID"]}
    assert {c["State"] for c in components.values()} == {"COMPLETED"}, rows
    inference_node, training_node = components[f"{job}+0"]["NodeList"], components[f"{job}+1"]["NodeList"]
    assert inference_node != training_node
    # srun steps ran inside each component: the servers in 0, the trainer and the actor in 1.
    steps = [r for r in rows if "." in r["JobID"] and not r["JobID"].endswith(".batch")]
    assert sum(r["JobID"].startswith(f"{job}+0.") for r in steps) == 1, rows
    assert sum(r["JobID"].startswith(f"{job}+1.") for r in steps) == 2, rows
    assert (run_dir / "logs" / f"{inference_node}_server0.log").is_file()  # named by the node it ran on
    meta = _meta(run_dir)
    assert meta["step"] == 6 and meta["samples_seen"] == 6 * SAMPLES_PER_STEP
    acc = EventAccumulator(str(run_dir / "tb" / "trainer"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("grpo_loss")][-1] == 6


def _consumed_samples(run_dir: Path, samples: int) -> list[dict]:
    """The first `samples` samples of the stream in reading order: what the trainer consumed."""
    reader = StreamReader(run_dir, "rollouts", StreamsConfig())
    rows: list[dict] = []
    while len(rows) < samples:
        for group in reader.read_groups(max_groups=64, timeout_s=5.0):
            rows.extend(group.to_pylist())
    assert len(rows) == samples, "the trainer consumes whole groups only"
    return rows


@pytest.mark.slow
def test_requeue_mid_run_resumes_without_losing_or_repeating_samples(slurm_env, tiny_model_dir, tmp_path):
    run_dir, max_steps = tmp_path / "run", 60
    job = _sbatch(slurm_env, tmp_path, _tiny_overrides(run_dir, tiny_model_dir, max_steps=max_steps, port=18430))
    trainer_log, slurm_log = run_dir / "logs" / "trainer.log", tmp_path / f"slurm-{job}.out"
    _wait_until("trainer step 3", lambda: trainer_log.is_file() and "step 3:" in trainer_log.read_text(),
                timeout_s=420, poll_s=0.3, log=slurm_log)
    # What Slurm sends signal_seconds before the time limit: USR1 to the batch shell only.
    _slurm(slurm_env, "scancel", "--batch", "--signal=USR1", job)
    signalled = time.monotonic()
    _wait_until(f"the end of requeued job {job}", lambda: _job_finished(slurm_env, job), timeout_s=540,
                log=slurm_log)
    print(f"requeue: {time.monotonic() - signalled:.0f} s from the signal to the end of the resumed run")
    states = [r["State"] for r in _sacct(slurm_env, job) if r["JobID"] == f"{job}+0"]
    assert states == ["REQUEUED", "COMPLETED"], states
    text = trainer_log.read_text()
    stopped = int(re.search(r"stop signal 10: checkpointed at step (\d+)", text).group(1))
    assert 3 <= stopped < max_steps and f"resumed from {run_dir}/checkpoints/step_{stopped:08d}" in text
    meta = _meta(run_dir)
    assert meta["step"] == max_steps and meta["samples_seen"] == max_steps * SAMPLES_PER_STEP
    rows = _consumed_samples(run_dir, max_steps * SAMPLES_PER_STEP)
    assert len({r["sample_id"] for r in rows}) == len(rows)
    # One per-token entry for every trained token: the same multiset of behaviour log-probs as the consumed
    # samples (a lost or repeated step would change it), and every one of the max_steps steps present.
    stats = read_token_stats(run_dir)
    stream_logprobs = np.concatenate([np.asarray(r["behaviour_logprobs"], dtype=np.float32) for r in rows])
    np.testing.assert_array_equal(np.sort(stats["behaviour_logprobs"]), np.sort(stream_logprobs))
    assert len(np.unique(stats["step"])) == max_steps


@pytest.mark.slow
def test_submitit_sweep_of_two_points_prints_its_table(slurm_env, tiny_model_dir, tmp_path):
    overrides = _tiny_overrides(tmp_path / "sweep", tiny_model_dir, max_steps=6, port=18460)
    out = subprocess.run([sys.executable, "tools/sweep.py", "configs/tiny_cpu.yaml", "--grid", "trainer.lr=1e-4,2e-4",
                          "--folder", str(tmp_path / "submitit"), "--timeout-s", "540", *overrides],
                         check=False, env=slurm_env, cwd=REPO, capture_output=True, text=True, timeout=660)
    assert out.returncode == 0, out.stdout + out.stderr[-5000:]
    table = out.stdout.splitlines()[-3:]
    assert table[0].split()[:6] == ["point", "job", "state", "steps", "samples_seen", "reward_mean"]
    for line, lr in zip(table[1:], ("1e-4", "2e-4")):
        assert line.split()[0] == f"trainer.lr={lr}" and line.split()[2:5] == ["COMPLETED", "6", "192"], line
        assert (tmp_path / "sweep" / f"trainer.lr={lr}" / "checkpoints" / "step_00000006").is_dir()


class _SilentJob:
    """A submitit job as seen without accounting after a hard crash: never done, no result."""

    def __init__(self, job_id: str):
        self.job_id, self.paths = job_id, type("Paths", (), {"stdout": f"/logs/{job_id}.out"})()

    def done(self, force_check: bool = False) -> bool:
        return False


def test_waiting_on_a_crashed_job_without_accounting_ends(monkeypatch):
    from pipelinerl.launch import slurm

    monkeypatch.setattr(slurm, "_in_queue", lambda job_id: False)  # gone from squeue, never a result
    outcomes = slurm.wait_jobs([_SilentJob("7_0")], timeout_s=30, poll_s=0.05, vanish_grace_s=0.3)
    assert outcomes == [("CRASHED", "left the queue without a result; log: /logs/7_0.out")]
    monkeypatch.setattr(slurm, "_in_queue", lambda job_id: True)  # still queued: the deadline names it
    with pytest.raises(TimeoutError, match="Slurm job.s. 7_1 not finished after 0 s"):
        slurm.wait_jobs([_SilentJob("7_1")], timeout_s=0.2, poll_s=0.05)

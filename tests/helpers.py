"""Reference computations shared by tests (imported as `helpers`: pytest puts tests/ on sys.path)."""

import contextlib
import glob
import os

import torch

# `make test` runs the modules on parallel pytest-xdist workers (gw0, gw1, ...). Every TCP port a test picks
# goes through worker_port(): worker k's ports are shifted by k * PORT_SHIFT, so workers never compete for one
# (the tests' ranges lie in 18000-19999; the trainer ranks' in PIPELINERL_MASTER_PORT_BASE, set in conftest).
PORT_SHIFT = 2000
WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))


def worker_port(n: int) -> int:
    return n + WORKER * PORT_SHIFT


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """n tokens of plain argmax decoding with transformers' forward: no EOS handling (like vLLM's
    ignore_eos), and unlike `generate(min_new_tokens=...)`, no logit is suppressed."""
    x, out = torch.tensor([ids]), []
    for _ in range(n):
        nxt = int(model(x).logits[0, -1].argmax())
        out.append(nxt)
        x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
    return out


@contextlib.contextmanager
def deepspeed_shm_removed(port: int):
    """DeepSpeed's CPU shared-memory comm op leaves /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>
    behind: remove those of the job whose rank 0 listened on `port` (never another worker's: other ports)."""
    try:
        yield
    finally:
        for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def consumed_rows(run_dir) -> tuple[list[dict], int]:
    """The stream rows the run's final checkpoint consumed (its samples_seen, in stream order), and its step."""
    import json
    from pathlib import Path

    from pipelinerl.config import StreamsConfig
    from pipelinerl.streams import ROLLOUT_TOPIC, StreamReader
    from pipelinerl.trainer.checkpoints import latest_checkpoint

    run_dir = Path(run_dir)
    meta = json.loads((latest_checkpoint(run_dir / "checkpoints") / "meta.json").read_text())
    reader, rows = StreamReader(run_dir, ROLLOUT_TOPIC, StreamsConfig()), []
    while len(rows) < meta["samples_seen"]:
        for group in reader.read_groups(max_groups=64, timeout_s=5.0):
            rows.extend(group.to_pylist())
    return rows[:meta["samples_seen"]], meta["step"]

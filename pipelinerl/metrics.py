"""TensorBoard scalars per role (RUN_DIR/tb/<role>) and per-token zarr statistics (RUN_DIR/stats).

TensorBoard event files are written with torch's SummaryWriter and read back in tests with
TensorBoard's own EventAccumulator. The zarr arrays are 1-D and appendable while training: one entry
per trained completion token (the model's: an episode's environment tokens are not trained), aligned across
arrays, so `lag[i]`, `behaviour_logprobs[i]`, `current_logprobs[i]` and `step[i]` describe the same token.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

TOKEN_ARRAYS = {  # name -> dtype of the per-token statistics
    "step": "int32",  # policy version of the weights the token was trained with (lag = step - its version)
    "lag": "int32",  # step - version of the policy that generated the token
    "behaviour_logprobs": "float32",  # log-prob under the generating policy (from vLLM)
    "current_logprobs": "float32",  # log-prob under the trainer's policy at that step
}
_CHUNK = 1 << 16  # tokens per zarr chunk: ~256 KiB of float32, few files even on long runs


class Scalars:
    """One role's TensorBoard writer."""

    def __init__(self, run_dir: str | Path, role: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tb" / role), flush_secs=10)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, float(value), global_step=step)

    def histogram(self, step: int, name: str, values: np.ndarray) -> None:
        if len(values):
            self.writer.add_histogram(name, np.asarray(values), global_step=step)

    def close(self) -> None:
        self.writer.close()


def read_scalars(folder: str | Path) -> dict[str, list]:
    """Every scalar of one role's TensorBoard folder (RUN_DIR/tb/<role>), read with TensorBoard's own
    EventAccumulator: tag -> its events (.step, .value, .wall_time) in write order; {} where the folder is missing."""
    import logging

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not Path(folder).is_dir():
        return {}
    logging.getLogger("tensorboard").setLevel(logging.WARNING)  # its per-file INFO lines bury a tool's output
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}


class TokenStats:
    """Appendable per-token arrays under RUN_DIR/stats/<writer> (one writer per trainer rank)."""

    def __init__(self, run_dir: str | Path, writer: str = "rank0"):
        import zarr

        root = Path(run_dir) / "stats" / writer
        self.arrays = {}
        for name, dtype in TOKEN_ARRAYS.items():
            path = root / name
            if path.exists():
                self.arrays[name] = zarr.open_array(str(path), mode="r+")
            else:
                self.arrays[name] = zarr.create_array(store=str(path), shape=(0,), chunks=(_CHUNK,), dtype=dtype)

    def __len__(self) -> int:
        return min(a.shape[0] for a in self.arrays.values())

    def append(self, step: int, lag: np.ndarray, behaviour_logprobs: np.ndarray,
               current_logprobs: np.ndarray) -> None:
        n = len(lag)
        assert len(behaviour_logprobs) == n and len(current_logprobs) == n
        columns = {"step": np.full(n, step), "lag": lag, "behaviour_logprobs": behaviour_logprobs,
                   "current_logprobs": current_logprobs}
        for name, values in columns.items():
            self.arrays[name].append(np.asarray(values, dtype=TOKEN_ARRAYS[name]))

    def truncate_to_step(self, step: int) -> None:
        """Drop tokens trained at `step` or later: a resumed trainer redoes those steps."""
        steps = self.arrays["step"][: len(self)]
        keep = int(np.searchsorted(steps, step, side="left"))  # steps are appended in order
        for array in self.arrays.values():
            array.resize((keep,))


def read_token_stats(run_dir: str | Path, writer: str | None = None) -> dict[str, np.ndarray]:
    """Per-token arrays as numpy (for analysis and tests): one writer's, or with `writer=None` every
    trainer rank's concatenated in rank order, plus a `rank` array saying whose each token is."""
    import zarr

    root = Path(run_dir) / "stats"
    writers = [writer] if writer is not None else sorted(
        (p.name for p in root.glob("rank*")), key=lambda name: int(name[4:]))
    if not writers:
        raise FileNotFoundError(f"no per-token statistics under {root}")
    parts = [{name: zarr.open_array(str(root / w / name), mode="r")[:] for name in TOKEN_ARRAYS} for w in writers]
    out = {name: np.concatenate([p[name] for p in parts]) for name in TOKEN_ARRAYS}
    out["rank"] = np.concatenate([np.full(len(p["step"]), int(w[4:]) if w.startswith("rank") else -1, dtype=np.int32)
                                  for p, w in zip(parts, writers)])
    return out

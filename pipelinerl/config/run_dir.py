"""The `streams`, `checkpoints` and `logging` sections: what a run writes under RUN_DIR."""

from __future__ import annotations

from dataclasses import dataclass

from pipelinerl.config.fields import check_choice, check_positive, doc


@dataclass
class StreamsConfig:
    """Arrow rollout streams under RUN_DIR/streams: whole segments published by rename, readers poll
    (pipelinerl/streams/__init__.py describes the protocol)."""

    segment_max_rows: int = doc(256, "a writer publishes its segment at this many samples (whole groups)...")
    segment_max_bytes: int = doc(64 * 2**20, "...or at this many bytes of Arrow data...", unit="bytes")
    segment_max_seconds: float = doc(5.0, "...or when its oldest buffered group is this old", unit="s")
    poll_interval_s: float = doc(0.2, "time between a waiting reader's directory listings", unit="s")
    fsync: bool = doc(True, "fsync each segment before its rename and its folder after; false = faster, but a "
                            "machine crash may lose (and a restarted writer renumber) recent segments")
    dedup_window: int | None = doc(100_000, "sample ids a reader remembers to drop duplicates (~120 bytes each)",
                                   null="all of them (memory grows with the run)")
    retention: str = doc("keep", "consumed segments: keep | delete (by `release`, once a checkpoint covers them)")

    def __post_init__(self) -> None:
        check_positive(self.segment_max_rows, "streams.segment_max_rows")
        check_positive(self.segment_max_bytes, "streams.segment_max_bytes")
        check_positive(self.segment_max_seconds, "streams.segment_max_seconds")
        check_positive(self.poll_interval_s, "streams.poll_interval_s")
        check_positive(self.dedup_window, "streams.dedup_window", allow_null=True)
        check_choice(self.retention, ("keep", "delete"), "streams.retention")


@dataclass
class CheckpointConfig:
    """Checkpoints under RUN_DIR/checkpoints: HF weights + DeepSpeed state + stream cursor + version."""

    every_steps: int | None = doc(100, "save every N optimizer steps", unit="steps",
                                  null="only on signals and at the end")
    keep_last: int = doc(2, "complete checkpoints kept on disk (older ones are deleted)")
    save_on_signal: bool = doc(True, "save on SIGTERM / SIGUSR1 (Slurm's pre-time-limit signal), then exit")

    def __post_init__(self) -> None:
        check_positive(self.every_steps, "checkpoints.every_steps", allow_null=True)
        check_positive(self.keep_last, "checkpoints.keep_last")


@dataclass
class LoggingConfig:
    """TensorBoard event files under RUN_DIR/tb and per-token zarr statistics under RUN_DIR/stats."""

    tensorboard: bool = doc(True, "write TensorBoard scalars and histograms")
    zarr_stats: bool = doc(True, "append per-token lag and log-probs to zarr arrays")
    every_steps: int = doc(1, "log trainer scalars every N optimizer steps", unit="steps")
    progress_bar: bool = doc(True, "console progress bar (the launcher's); off in batch jobs")

    def __post_init__(self) -> None:
        check_positive(self.every_steps, "logging.every_steps")

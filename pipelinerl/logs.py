"""One logging setup for every role: each line names its time, level, role and (trainer) rank.

    2026-11-30 12:00:01,234 INFO train[rank 1] pipelinerl.trainer: step 12 ...

The level is `PIPELINERL_LOG_LEVEL` (DEBUG, INFO, WARNING, ...; default INFO).
"""

from __future__ import annotations

import logging
import os

LEVEL_ENV = "PIPELINERL_LOG_LEVEL"
QUIET_LOGGERS = ("httpx", "httpcore")  # one line per request drowns the role logs


def role_label(role: str, rank: int | str | None = None) -> str:
    return role if rank is None else f"{role}[rank {rank}]"


def setup_logging(role: str, rank: int | str | None = None) -> None:
    """Configure the root logger of this process (once; later calls replace the format)."""
    level = os.environ.get(LEVEL_ENV, "INFO").upper()
    if not isinstance(logging.getLevelName(level), int):
        raise SystemExit(f"{LEVEL_ENV}={level!r} is not a logging level (DEBUG, INFO, WARNING, ERROR)")
    logging.basicConfig(level=level, force=True,
                        format=f"%(asctime)s %(levelname)s {role_label(role, rank)} %(name)s: %(message)s")
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))

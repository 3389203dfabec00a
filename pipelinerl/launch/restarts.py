"""A launcher's restart policy: a role that died is started again (procs.Supervisor.check), at most
launch.max_restarts times within any launch.restart_window_s; one more death stops the run as before
(procs.RoleFailed, naming the role and its log).

Every restart is a log line and TensorBoard scalars under RUN_DIR/tb/<folder> (`launch` for `pipelinerl
run` and the Slurm job launcher, `launch/<node>` for a Slurm node's servers agent), at step = the role's
restart number: `launch/restarts/<role>` (restarts so far) when it restarts, `launch/downtime_s/<role>`
once it is up again. Downtime runs from the death noticed to the role up again: a server once it has
published its discovery file anew (its /health answered; the dead one's file is removed at the restart),
any other role once its process started; a role that dies again before it is up keeps the downtime of
its first death.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict, deque
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipelinerl.config import Config

log = logging.getLogger(__name__)


class RestartBudget:
    """At most `max_restarts` restarts per role within any `window_s` (a sliding window)."""

    def __init__(self, max_restarts: int, window_s: float):
        self.max_restarts, self.window_s = max_restarts, window_s
        self._times: dict[str, deque[float]] = defaultdict(deque)

    def take(self, name: str, now: float) -> bool:
        """Count one restart of `name` at `now` (monotonic seconds) if the budget allows it."""
        times = self._times[name]
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if len(times) >= self.max_restarts:
            return False
        times.append(now)
        return True


class Restarts:
    """The budget, plus each role's restart count and downtime, logged and written to TensorBoard."""

    def __init__(self, budget: RestartBudget, run_dir: str | Path, folder: str = "launch"):
        self.budget, self.run_dir, self.folder = budget, run_dir, folder
        self.count: dict[str, int] = defaultdict(int)
        self.downtime_s: dict[str, float] = defaultdict(float)  # summed over the role's restarts that came up
        self._down_since: dict[str, float] = {}  # restarted roles not up yet: when their first death was noticed
        self._scalars = None  # opened at the first restart: TensorBoard's writer imports torch

    @classmethod
    def from_config(cls, cfg: Config, folder: str = "launch") -> Restarts | None:
        """The policy of cfg.launch; None when launch.max_restarts is 0 (any death stops the run)."""
        if cfg.launch.max_restarts == 0:
            return None
        return cls(RestartBudget(cfg.launch.max_restarts, cfg.launch.restart_window_s), cfg.run_dir, folder)

    def died(self, name: str, returncode: int, log_path: Path) -> bool:
        """Role `name` (its log at `log_path`) exited with `returncode`: True (and counted) when it may restart
        now."""
        now = time.monotonic()
        if not self.budget.take(name, now):
            return False
        self.count[name] += 1
        since = self._down_since.setdefault(name, now)
        log.warning("role `%s` exited with code %d; restarting it (restart %d; down %.1f s, %.1f s before in all); "
                    "its log: %s", name, returncode, self.count[name], now - since, self.downtime_s[name], log_path)
        self._write(f"launch/restarts/{name}", self.count[name], self.count[name])
        return True

    def down_s(self, name: str) -> float | None:
        """How long a restarted role has been down (None: up, or never restarted)."""
        since = self._down_since.get(name)
        return None if since is None else time.monotonic() - since

    def check_up(self, up: list[str]) -> None:
        """Record the downtime of every restarted role among `up` (the names of the roles up now)."""
        for name in up:
            if name not in self._down_since:
                continue
            seconds = time.monotonic() - self._down_since.pop(name)
            self.downtime_s[name] += seconds
            log.info("role `%s` is up again after %.1f s (restart %d; %.1f s down in all)", name, seconds,
                     self.count[name], self.downtime_s[name])
            self._write(f"launch/downtime_s/{name}", self.count[name], seconds)

    def _write(self, tag: str, step: int, value: float) -> None:
        from pipelinerl.metrics import Scalars

        if self._scalars is None:
            self._scalars = Scalars(self.run_dir, self.folder)
        self._scalars.log(step, {tag: value})
        self._scalars.writer.flush()  # restarts are rare; a launcher killed later keeps them

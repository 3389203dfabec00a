"""Run model-written Python code in a confined, resource-limited process: `PythonSandbox.run(code, stdin)`.

Each run is a fresh `python -I` launcher (pipelinerl/envs/tools/confine/) with an environment built from
an allowlist, in a fresh work directory that is deleted afterwards; the launcher confines itself and
forks the code's process. Nothing is forked from the caller (the actor has threads and may hold CUDA):
asyncio's subprocess spawn execs at once. At most `pool_size` runs are in flight; more wait their turn (the
waiters are the episodes that called, so the queue is as bounded as the episodes in flight), their wall clock
starts only when their launcher does, and while any waits, one line per `wait_log_s` says how many wait and
for how long the oldest has.

Confinement tiers (confine/launcher.py says what each does): A (namespaces), B (Landlock), C (rlimits + seccomp
only, where file reads cannot be blocked: refused unless `allow_unconfined_fs`). The strongest tier that
runs a trivial program on this machine is chosen at construction and logged once.

Limits and who enforces them: wall clock (the launcher kills the code and everything it started; the
caller kills the launcher `BACKSTOP_S` later if it has not reported), CPU seconds (the call's processes
together, added up every 0.05 s by the launcher, which kills them all once over; RLIMIT_CPU
stops each process at the same number), memory (RLIMIT_AS per process: allocations fail, Python raises
MemoryError; and the call's processes' proportional set sizes together, polled like CPU: over the limit,
all are killed, "memory"), processes (RLIMIT_NPROC: tier A counts the code's processes alone, in its own
user namespace, and so does a launcher started as root, which runs the code under a uid of its own
(`run_as_uid_base`); otherwise the kernel counts per real uid, so tiers B and C allow max_processes more
than the user runs at launch and concurrent runs share that headroom), file size (RLIMIT_FSIZE: EFBIG),
output (the caller keeps the first `max_output_bytes` of stdout and of stderr and stops the run when
either overflows). Between two polls a call can exceed the CPU and memory limits by what its processes use
in that time, each bounded by its own rlimits; the job's cgroup (Slurm) remains the hard ceiling.

In tier C the code can read this process's /proc files unless it is made non-dumpable, which the sandbox
does when it settles on tier C (so the environment and memory of the actor are closed to it; a same-user
debugger such as py-spy then needs root).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

from pipelinerl.waits import WaitLog

log = logging.getLogger(__name__)

LAUNCHER = Path(__file__).resolve().parent / "confine" / "launcher.py"
TIERS = ("A", "B", "C")
PR_SET_DUMPABLE = 4  # prctl(2)
BACKSTOP_S = 5.0  # how long after its wall clock a launcher that has not reported is killed
CHUNK = 1 << 16
# The code's environment: nothing inherited (no tokens, no proxies, no CUDA devices). One thread per
# numeric library: on a many-core node each would otherwise start one thread per core.
CODE_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
DEV_FILES = ["/dev/null", "/dev/zero", "/dev/urandom"]
TIER_NAMES = {"A": "user, mount, PID and network namespaces + seccomp + rlimits",
              "B": "Landlock + seccomp + rlimits", "C": "seccomp + rlimits only: every file of the user is readable"}


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """What one run may use, and how the sandbox is built. Units are in the names; defaults suit short
    tool calls of a reasoning episode (arithmetic, sympy, numpy)."""

    wall_s: float = 10.0  # wall-clock limit per run, from the launcher's start
    cpu_s: float = 5.0  # CPU-time limit (RLIMIT_CPU, whole seconds, rounded up), user + system
    memory_bytes: int = 1 << 30  # address-space limit per process (RLIMIT_AS); numpy needs ~256 MiB
    max_processes: int = 32  # processes (and threads) the code may run at once; see the module docstring
    max_output_bytes: int = 1 << 16  # kept of stdout and of stderr each; more stops the run ("output_limit")
    max_file_bytes: int = 16 << 20  # largest file the code may write (RLIMIT_FSIZE)
    scratch_bytes: int = 64 << 20  # size of tier A's scratch tmpfs (counts as memory); tiers B/C: not bounded
    pool_size: int = 4  # runs in flight at once; further runs wait
    wait_log_s: float = 30.0  # while runs wait for a worker, a line this often (checked when a run arrives or ends)
    tier: Literal["auto", "A", "B", "C"] = "auto"  # "auto": the strongest that works; else exactly that one
    allow_unconfined_fs: bool = False  # accept tier C, where the code can read every file the user can
    python: str | None = None  # interpreter for the code (and the launcher); None: this process's own
    work_root: str | None = None  # where per-run work directories are made; None: the system temp dir
    # Started as root: the code of each run takes a uid of [base, base + 4096) that it alone uses meanwhile
    # (locked), so the process limit holds per run and no root process is open to it; these uids (and gids)
    # must belong to no one on the node, and the interpreter must be readable by them (one under /root,
    # mode 0700, is not: the code then runs as root, with a warning). None: the code runs as root, where
    # RLIMIT_NPROC does not apply.
    run_as_uid_base: int | None = 2_100_000_000

    def __post_init__(self):
        for name in ("wall_s", "cpu_s", "memory_bytes", "max_processes", "max_output_bytes", "max_file_bytes",
                     "scratch_bytes", "pool_size", "wait_log_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limit {name} must be > 0, got {getattr(self, name)!r}")
        if self.tier not in ("auto",) + TIERS:
            raise ValueError(f"sandbox tier must be one of auto, A, B, C; got {self.tier!r}")
        if self.run_as_uid_base is not None and not 0 < self.run_as_uid_base <= 2**32 - 2 - 4096:
            raise ValueError(f"sandbox run_as_uid_base must be in (0, 2**32 - 4098], got {self.run_as_uid_base}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """One run. `reason`: "ok", "timeout" (wall clock), "cpu_limit", "memory" (MemoryError, or the run's
    processes together over the limit),
    "output_limit", "killed: SIGNAME" (a signal, or "killed: close" when the sandbox closed), or
    "error: ..." (a nonzero exit, e.g. an uncaught exception: its traceback is in stderr; or the sandbox
    failed to start the code)."""

    ok: bool
    stdout: str
    stderr: str
    reason: str
    exit_code: int | None
    duration_s: float
    truncated: bool  # stdout or stderr was cut at max_output_bytes


class PythonSandbox:
    """Runs code under `limits`; safe to call concurrently from one asyncio loop. Probes the tiers when
    built (a trivial run in each candidate, ~0.1 s); raises ValueError if the wanted tier does not work."""

    def __init__(self, limits: SandboxLimits | None = None):
        self.limits = limits or SandboxLimits()
        self.python = self.limits.python or sys.executable
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None
        self._running: set[asyncio.subprocess.Process] = set()
        self._waits = WaitLog(self.limits.wait_log_s, log, self._wait_line)
        self._closed = False
        self._probe = self._run_probe()
        self._run_as = self.limits.run_as_uid_base if os.geteuid() == 0 else None  # the launcher's uids
        self._tier = self._choose_tier()
        if self._tier == "C":  # code of this uid could otherwise read our environ and write our memory
            ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        log.info("python sandbox: tier %s (%s), landlock ABI %d, pool of %d", self._tier, TIER_NAMES[self._tier],
                 self._probe["landlock_abi"], self.limits.pool_size)

    def tier(self) -> str:
        """The confinement tier in effect: "A", "B" or "C"."""
        return self._tier

    async def run(self, code: str, stdin: str = "") -> SandboxResult:
        """Run `code` as a script with `stdin`; never raises for anything the code does."""
        if self._closed:
            raise RuntimeError("python sandbox is closed")
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:  # a semaphore serves one event loop
            self._slots, self._slots_loop = asyncio.Semaphore(self.limits.pool_size), loop
        self._waits.poll(time.monotonic())
        with self._waits.waiting(time.monotonic()):
            await self._slots.acquire()
        try:
            return await self._run(code, stdin, self._tier)
        finally:
            self._slots.release()
            self._waits.poll(time.monotonic())

    def _wait_line(self, oldest_s: float, count: int, _need: object) -> str:
        return (f"python sandbox: {count} tool call(s) wait for one of its {self.limits.pool_size} workers, the "
                f"oldest for {oldest_s:.0f} s (task.sandbox.workers)")

    async def close(self) -> None:
        """Stop runs in flight (they end "killed: close") and refuse new ones."""
        self._closed = True
        for proc in list(self._running):
            _signal(proc, signal.SIGTERM)
        while self._running:
            await asyncio.sleep(0.01)

    # ------------------------------------------------------------ tiers

    def _run_probe(self) -> dict:
        out = subprocess.run([self.python, "-I", "-B", str(LAUNCHER), "--probe"], capture_output=True, text=True,
                             env=CODE_ENV, timeout=60, check=False)
        if out.returncode != 0:
            raise ValueError(f"python sandbox: the launcher did not start with {self.python}: {out.stderr[-2000:]}")
        return json.loads(out.stdout)

    def _choose_tier(self) -> str:
        if not self._probe["arch_supported"]:
            raise ValueError("python sandbox: seccomp syscall numbers are known for x86_64 and aarch64 only")
        wanted = TIERS if self.limits.tier == "auto" else (self.limits.tier,)
        failures = []
        for tier in wanted:
            if tier == "C" and not self.limits.allow_unconfined_fs:
                failures.append("C: refused, since the code could read every file this user can (run "
                                "directories' auth_token included); set allow_unconfined_fs to accept it")
                continue
            if tier == "B" and self._probe["landlock_abi"] == 0:
                failures.append("B: this kernel has no Landlock")
                continue
            result = self._trial(tier)
            if not result.ok and self._run_as is not None:  # root: is it the uid that cannot run?
                self._run_as = None
                if self._trial(tier).ok:
                    log.warning("python sandbox: the code runs as root, without a process limit: a uid of its own "
                                "cannot run %s (%s); install the interpreter where every user can read it",
                                self.python, result.stderr[-300:].strip() or result.reason)
                    return tier
                self._run_as = self.limits.run_as_uid_base
            if result.ok:
                return tier
            failures.append(f"{tier}: {result.reason} {result.stderr[-500:]}".strip())
        raise ValueError("python sandbox: no confinement tier works here:\n  " + "\n  ".join(failures))

    def _trial(self, tier: str) -> SandboxResult:
        """A trivial program run in `tier`; ok only if it printed what it should."""
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # works inside a running event loop too
            result = pool.submit(asyncio.run, self._run("print('ok')", "", tier)).result()
        return result if result.stdout == "ok\n" or not result.ok else dataclasses.replace(result, ok=False)

    # ------------------------------------------------------------ one run

    def _job(self, work: Path, code: str, tier: str) -> dict:
        scratch = str(work / "scratch")
        env = dict(CODE_ENV, HOME=scratch, TMPDIR=scratch)
        return {"code": code, "tier": tier, "python": self.python, "scratch": scratch, "root": str(work / "root"),
                "read_paths": self._probe["read_paths"], "dev_files": DEV_FILES, "env": env,
                "landlock_abi": self._probe["landlock_abi"], "limits": dataclasses.asdict(self.limits),
                "run_as_uid_base": self._run_as}

    async def _run(self, code: str, stdin: str, tier: str) -> SandboxResult:
        start = time.monotonic()
        work = Path(tempfile.mkdtemp(prefix="pipelinerl-sbx-", dir=self.limits.work_root))
        try:
            for name in ("scratch", "root"):
                (work / name).mkdir()
            (work / "job.json").write_text(json.dumps(self._job(work, code, tier)))
            (work / "stdin").write_text(stdin, encoding="utf-8")
            status, out, err, cut = await self._launch(work)
        finally:
            _remove(work)
        return _result(status, out, err, cut, self.limits, time.monotonic() - start)

    async def _launch(self, work: Path) -> tuple[dict | None, bytes, bytes, bool]:
        status_r, status_w = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                self.python, "-I", "-S", "-B", str(LAUNCHER), str(work), str(status_w), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=CODE_ENV, pass_fds=(status_w,),
                start_new_session=True)
        finally:
            os.close(status_w)
        self._running.add(proc)
        try:
            out, err, cut = await self._collect(proc)
        finally:
            self._running.discard(proc)
        os.set_blocking(status_r, False)
        try:
            raw = os.read(status_r, 1 << 16)
        except BlockingIOError:
            raw = b""
        finally:
            os.close(status_r)
        status = json.loads(raw) if raw else None
        if status is not None and self._closed and status.get("stopped"):
            status["closed"] = True
        return status, out, err, cut

    async def _collect(self, proc: asyncio.subprocess.Process) -> tuple[bytes, bytes, bool]:
        """Read stdout and stderr up to the cap each (then SIGTERM the launcher, which kills the code) until
        the launcher exits; kill its whole session if it outlives the wall clock by BACKSTOP_S."""
        cap, over = self.limits.max_output_bytes, []

        async def read(stream: asyncio.StreamReader) -> bytes:
            kept, seen = bytearray(), 0
            while chunk := await stream.read(CHUNK):
                seen += len(chunk)
                if len(kept) < cap:
                    kept += chunk[:cap - len(kept)]
                if seen > cap and not over:
                    over.append(True)
                    _signal(proc, signal.SIGTERM)
            return bytes(kept)

        readers = asyncio.gather(read(proc.stdout), read(proc.stderr), proc.wait())
        try:
            out, err, _ = await asyncio.wait_for(asyncio.shield(readers), self.limits.wall_s + BACKSTOP_S)
        except asyncio.TimeoutError:
            log.warning("python sandbox: launcher %d did not report %.0f s past its wall clock; killed",
                        proc.pid, BACKSTOP_S)
            _signal(proc, signal.SIGKILL, group=True)
            try:
                out, err, _ = await asyncio.wait_for(readers, 2.0)
            except asyncio.TimeoutError:  # a process that left the session still holds the pipes
                readers.cancel()
                await proc.wait()
                out, err = b"", b""
        return out, err, bool(over)


def _signal(proc: asyncio.subprocess.Process, sig: int, group: bool = False) -> None:
    try:
        if group:
            os.killpg(proc.pid, sig)  # the launcher and every process of its session
        else:
            proc.send_signal(sig)
    except ProcessLookupError:
        pass


def _remove(work: Path) -> None:
    """Delete a work directory, also where the code took away its own permissions (tiers B and C); a
    symbolic link is removed, never followed (os.walk lists links to directories among the directories)."""
    for top, dirs, _ in os.walk(work):
        for name in dirs:
            path = os.path.join(top, name)
            if not os.path.islink(path):
                try:
                    os.chmod(path, 0o700)
                except OSError:
                    pass
    shutil.rmtree(work, ignore_errors=True)
    if os.path.lexists(work):
        log.warning("python sandbox: could not remove the work directory %s", work)


def _reason(status: dict | None, cut: bool, stderr: str, limits: SandboxLimits) -> str:
    if status is None:
        return "error: the sandbox launcher ended without a report"
    if status.get("error"):
        return f"error: sandbox: {status['error']}"
    if cut:
        return "output_limit"
    if status.get("closed"):
        return "killed: close"
    if status["timed_out"]:
        return "timeout"
    if status.get("limit"):  # the call's processes together
        return {"cpu": "cpu_limit", "memory": "memory"}[status["limit"]]
    sig = status["signal"]
    cpu_limit = -(-limits.cpu_s // 1)
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and status["cpu_s"] >= cpu_limit - 0.1):
        return "cpu_limit"
    if sig is not None:
        return f"killed: {signal.Signals(sig).name}"
    if status.get("stopped"):
        return "killed: stopped"
    if status["exit_code"] == 0:
        return "ok"
    last = stderr.rstrip().rpartition("\n")[2]
    if last.startswith("MemoryError"):
        return "memory"
    return f"error: exit code {status['exit_code']}"


def _result(status: dict | None, out: bytes, err: bytes, cut: bool, limits: SandboxLimits,
            duration_s: float) -> SandboxResult:
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    reason = _reason(status, cut, stderr, limits)
    return SandboxResult(ok=reason == "ok", stdout=stdout, stderr=stderr, reason=reason,
                         exit_code=None if status is None else status.get("exit_code"),
                         duration_s=duration_s, truncated=cut)

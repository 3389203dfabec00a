"""The sandbox launcher: a fresh `python -I` process that confines and runs one piece of model-written code.

Run as a script by pipelinerl/envs/tools/sandbox.py (never imported there), so it and its two modules
beside it (kernel.py, processes.py) are standard library only and it starts single-threaded, which
unshare(CLONE_NEWUSER) and Landlock's per-thread rules need:

    python -I -B launcher.py WORKDIR STATUS_FD    run WORKDIR/job.json, write a JSON report to STATUS_FD

Tiers, from strongest (all of them work as an ordinary user: no root, no setuid helper):
  A  user + mount + PID + network + IPC namespaces: the code sees a fresh root holding only the Python
     installation, a few system paths and its scratch tmpfs, read-only except scratch; no network but a
     downed loopback; it is PID 1's child in its own PID namespace, so everything it starts dies with it.
  B  Landlock (kernel >= 5.13): file access only beneath the same paths; TCP bind/connect denied (ABI >= 4);
     signals and abstract unix sockets outside the sandbox denied (ABI >= 6). The launcher is a child
     subreaper and kills every descendant left when the code's main process ends.
  C  rlimits and seccomp only: time, memory, processes, file size and network are bounded, file reads are
     not (the caller must opt in).
Every tier adds rlimits (CPU, address space, processes, file size, open files, no core dumps) and a seccomp
filter that refuses socket/socketpair (this is what stops UDP under Landlock), ptrace, process_vm_*,
io_uring, namespaces, mounts, bpf, perf_event_open, userfaultfd, keyrings and open_by_handle_at, and
signals aimed at the launcher, its caller, its process group or every process (kill(-1)).

Per call, not per process: the supervisor (the launcher, or tier A's PID 1) adds up the CPU time and the
proportional set size of every process the code started, every POLL_S, and kills them all once either is
over the call's limit. The launcher makes itself non-dumpable, so code of its uid can neither read its
/proc/<pid>/environ nor write its /proc/<pid>/mem.

Started as root, the launcher runs the code under a uid of its own (job "run_as_uid_base"): one it locks
for the call from a range no user owns, after killing whatever an earlier call left under it. Root is exempt
from RLIMIT_NPROC; that uid is not, and it runs nothing else, so the process limit is exact per call, the
code cannot signal or read any root process, and every process of the uid is killed when the call ends.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves a script's own folder off sys.path
import kernel  # noqa: E402 - after the path
import processes  # noqa: E402
from kernel import SetupError, check, libc  # noqa: E402

POLL_S = 0.05  # how often the supervisor adds up the call's CPU time and memory


class _Stop(Exception):
    """SIGTERM from the sandbox's owner: kill the code now (output cap reached, or the pool closing)."""


# ---------------------------------------------------------------- the code's process

def _limits(job: dict, tier: str) -> None:
    lim = job["limits"]
    cpu = int(-(-lim["cpu_s"] // 1))
    # RLIMIT_NPROC counts every task of the real uid, except inside a user namespace of its own (tier A);
    # in tiers B and C the user's other processes (the actor's threads, servers) would use it up, so the
    # code gets max_processes more than the user runs now; under a uid of its own (root's launcher) nothing
    # else counts.
    nproc = lim["max_processes"] + (0 if tier == "A" or job.get("uid") is not None else processes.user_tasks())
    for which, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS,) + (lim["memory_bytes"],) * 2,
                              (resource.RLIMIT_NPROC, nproc, nproc),
                              (resource.RLIMIT_FSIZE,) + (lim["max_file_bytes"],) * 2,
                              (resource.RLIMIT_NOFILE, 256, 256), (resource.RLIMIT_CORE, 0, 0)):
        resource.setrlimit(which, (soft, hard))


def _child_setup(job: dict, tier: str, keep_fd: int) -> None:
    """In the forked child: stdin, descriptors, limits, then the confinement of `tier`; raises on failure."""
    os.dup2(job["stdin_fd"], 0)
    os.closerange(3, keep_fd)
    os.closerange(keep_fd + 1, 65536)
    os.chdir(job["scratch"])
    if tier == "A" or os.geteuid() == 0:
        kernel.drop_capabilities()
    if tier != "A" and job.get("uid") is not None:  # tier A's launcher took it before entering its namespaces
        processes.become(job["uid"])
    libc.prctl(kernel.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _limits(job, tier)
    # Landlock and seccomp both need no_new_privs unless the caller holds CAP_SYS_ADMIN (root does)
    check(libc.prctl(kernel.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    if tier in ("A", "B") and job["landlock_abi"] > 0:
        reads = job["read_paths"] + (["/proc"] if tier == "A" else [])
        kernel.apply_landlock(job["landlock_abi"], reads, [job["scratch"]], job["dev_files"])
    # tier A's code sees neither pid (its own PID namespace); elsewhere the launcher and its caller are protected
    kernel.apply_seccomp([] if tier == "A" else [os.getppid(), job["caller_pid"]])


def spawn_code(job: dict, tier: str) -> int:
    """Fork the process that runs the code; return its pid once it has exec'd Python (or raise SetupError)."""
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(err_r)
            for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(sig, signal.SIG_DFL)
            _child_setup(job, tier, err_w)
            argv = [job["python"], "-I", "-B", "-X", "utf8", job["scratch"] + "/main.py"]
            os.execve(argv[0], argv, job["env"])
        except BaseException as error:  # noqa: BLE001 - reported to the launcher, never raised past exec
            os.write(err_w, f"{type(error).__name__}: {error}".encode()[:4000])
        os._exit(127)
    os.close(err_w)
    message = b""
    while chunk := os.read(err_r, 4096):  # EOF at exec (close-on-exec) or after the error
        message += chunk
    os.close(err_r)
    if message:
        os.waitpid(pid, 0)
        raise SetupError(message.decode(errors="replace"))
    return pid


def _write_code(job: dict) -> None:
    with open(job["scratch"] + "/main.py", "w", encoding="utf-8") as f:
        f.write(job["code"])


# ---------------------------------------------------------------- supervision

def _over(limits: dict | None) -> str | None:
    """"cpu" or "memory" when the call is over that limit of `limits` (the job's), else None."""
    if limits is None:
        return None
    cpu, memory = processes.call_usage()
    if cpu > limits["cpu_s"]:
        return "cpu"
    return "memory" if memory > limits["memory_bytes"] else None


def _wait_until(pid: int, deadline: float, limits: dict | None) -> tuple[bool, str | None]:
    """Wait until `pid` (our child) exits (it is not reaped), the deadline passes, or (with `limits`) the
    call goes over one. Returns (exited, the limit it went over)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # kernels before 5.3
        fd = None
    step = POLL_S if limits is not None else float("inf")
    try:
        while (left := deadline - time.monotonic()) > 0:
            if fd is not None:
                if select.select([fd], [], [], min(left, step))[0]:
                    return True, None
            elif os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True, None
            else:
                time.sleep(min(left, 0.01))
            if over := _over(limits):
                return False, over
        return False, None
    finally:
        if fd is not None:
            os.close(fd)


def supervise(pid: int, deadline: float, limits: dict | None = None) -> dict:
    """Wait for the code's process (or, in the launcher of tier A, PID 1) until the deadline; kill it if
    it is late, the call goes over `limits` (cpu_s, memory_bytes: all its processes together) or SIGTERM
    came. Returns its report: exit code or signal, CPU seconds, why it ended."""
    stopped, over = False, None
    try:
        finished, over = _wait_until(pid, deadline, limits)
    except _Stop:
        finished, stopped = False, True
    if not finished:
        os.kill(pid, signal.SIGKILL)
    _, status, usage = os.wait4(pid, 0)
    return {"exit_code": os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "cpu_s": usage.ru_utime + usage.ru_stime, "timed_out": not finished and not stopped and not over,
            "stopped": stopped, "limit": over, "error": None}


# ---------------------------------------------------------------- tiers

def _pid1(job: dict, report_w: int, deadline: float) -> None:
    """PID 1 of tier A's namespaces: build the root, run the code, report, exit (which kills what remains)."""
    try:
        libc.prctl(kernel.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        kernel.build_root(job["root"], job["read_paths"], job["dev_files"], job["scratch"],
                          job["limits"]["scratch_bytes"])
        _write_code(job)
        report = supervise(spawn_code(job, "A"), deadline, job["limits"])
    except BaseException as error:  # noqa: BLE001 - reported as a setup error
        report = {"error": f"{type(error).__name__}: {error}"}
    os.write(report_w, json.dumps(report).encode())
    os._exit(0)


def run_tier_a(job: dict, deadline: float) -> dict:
    if job.get("uid") is not None:  # the namespaces of an ordinary user: the uid of the call's own
        processes.become(job["uid"])
        # a uid change made us non-dumpable, which gives our /proc/self/uid_map to root: we could not write it
        libc.prctl(kernel.PR_SET_DUMPABLE, 1, 0, 0, 0)
    kernel.enter_namespaces()
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(report_r)
        _pid1(job, report_w, deadline)
    os.close(report_w)
    outer = supervise(pid, deadline + 1.0)  # PID 1 keeps the deadline itself; this is its backstop
    os.set_blocking(report_r, False)
    try:
        inner = json.loads(os.read(report_r, 1 << 16) or b"null")
    except BlockingIOError:
        inner = None
    if outer["stopped"] or outer["timed_out"]:
        return outer
    return inner or {**outer, "error": f"sandbox PID 1 ended without a report ({outer})"}


def run_tier_bc(job: dict, tier: str, deadline: float) -> dict:
    check(libc.prctl(kernel.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")
    libc.prctl(kernel.PR_SET_DUMPABLE, 0, 0, 0, 0)  # code of our uid may not read our environ or write our memory
    _write_code(job)
    try:
        return supervise(spawn_code(job, tier), deadline, job["limits"])
    finally:
        # A SIGTERM (output cap, close) landing here would raise _Stop half-way and leave processes to init:
        # it waits, blocked, until the clean-up is done (the launcher then exits without acting on it).
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        processes.kill_descendants()
        if job.get("uid") is not None:
            processes.sweep_uid(job["uid"])


def _on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second one must not cut the clean-up short
    raise _Stop


def _take_uid(job: dict, workdir: str) -> None:
    """Root's launcher: the call's own uid in job["uid"], its leftovers from an earlier call killed, and the
    work directory made the uid's (tier A's root and scratch are mount points the uid must reach)."""
    uid, job["uid_lock_fd"] = processes.claim_uid(job["run_as_uid_base"])
    processes.sweep_uid(uid)
    for path in (workdir, job["scratch"], job["root"]):
        os.chown(path, uid, uid)
    job["uid"] = uid


# ---------------------------------------------------------------- the launcher

def launch(workdir: str) -> dict:
    start = time.monotonic()
    with open(os.path.join(workdir, "job.json"), encoding="utf-8") as f:
        job = json.load(f)
    deadline = start + job["limits"]["wall_s"]
    job["stdin_fd"] = os.open(os.path.join(workdir, "stdin"), os.O_RDONLY | os.O_CLOEXEC)
    job["caller_pid"] = os.getppid()
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        if os.geteuid() == 0 and job["run_as_uid_base"] is not None:
            _take_uid(job, workdir)
        if job["tier"] == "A":
            return run_tier_a(job, deadline)
        return run_tier_bc(job, job["tier"], deadline)
    except SetupError as error:
        return {"error": str(error)}


def probe() -> dict:
    """What this kernel offers, for the caller's tier choice (it confirms a tier by running code in it)."""
    return {"landlock_abi": kernel.landlock_abi(), "arch_supported": kernel.ARCH is not None,
            "euid": os.geteuid(), "read_paths": default_read_paths()}


def default_read_paths() -> list[str]:
    """The Python installation running this script and the system's shared libraries: what a Python
    process needs to start and import its standard library and installed packages."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths = {os.path.realpath(p) for p in prefixes} | prefixes
    paths |= {"/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/etc/ld.so.cache"}
    return sorted(p for p in paths if os.path.lexists(p) and p != "/")


def main(argv: list[str]) -> int:
    if argv[1:] == ["--probe"]:
        print(json.dumps(probe()))
        return 0
    workdir, status_fd = argv[1], int(argv[2])
    os.set_inheritable(status_fd, False)
    try:
        report = launch(workdir)
    except _Stop:
        report = {"stopped": True, "error": None, "exit_code": None, "signal": None, "cpu_s": 0.0,
                  "timed_out": False}
    os.write(status_fd, json.dumps(report).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

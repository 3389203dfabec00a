"""The processes of one sandbox call: finding them (a supervisor's descendants, every process of a uid), adding
up what they use, killing them; and, for a launcher started as root, a uid of the call's own. Standard library
only (see launcher.py).
"""

from __future__ import annotations

import fcntl
import os
import resource
import signal
import stat
import time

from kernel import SetupError

UID_SPAN = 4096  # run_as uids tried: [base, base + UID_SPAN)
UID_LOCKS = "/tmp/pipelinerl-sandbox-uids"  # one lock file per run_as uid in use (root's, 0700)
PAGE = os.sysconf("SC_PAGE_SIZE")
TICKS = os.sysconf("SC_CLK_TCK")


def user_tasks() -> int:
    """How many tasks (threads included) this real uid runs now: what RLIMIT_NPROC compares with."""
    uid, total = str(os.getuid()), 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if line.startswith(("Uid:", "Threads:")))
            except (OSError, ValueError):
                continue
            if fields.get("Uid", "").split()[:1] == [uid]:
                total += int(fields.get("Threads", "1"))
    return total


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def kill_descendants(limit_s: float = 10.0) -> None:
    """Kill every descendant of this process (a child subreaper: orphans, setsid ones included, are
    re-parented to it) and reap them; repeat until no child is left, since a process may fork meanwhile."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        for pid in _descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            return
        time.sleep(0.002)


# ---------------------------------------------------------------- what the call uses

def _children(pid: int) -> list[int] | None:
    """`pid`'s children from /proc/<pid>/task/*/children (None where the kernel has no such file)."""
    kids = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                kids += map(int, f.read().split())
    except FileNotFoundError:
        return None if pid == os.getpid() else kids
    except OSError:
        pass
    return kids


def _memory_of(pid: int) -> int:
    """Bytes `pid` uses: its proportional set size (shared pages split among their users), or its resident
    set where smaps_rollup is missing or closed to us."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def call_usage() -> tuple[float, int]:
    """(CPU seconds, bytes) of the whole call: every live descendant of this supervisor (its CPU time, that of
    the children it reaped, its memory) plus the CPU time of the descendants this supervisor reaped."""
    own = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu, memory = own.ru_utime + own.ru_stime, 0
    kids = _children(os.getpid())
    try:
        todo = _descendants(os.getpid()) if kids is None else kids
    except OSError:  # tier A in a container that masks /proc: the code runs without one, and unmeasured
        return cpu, 0
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            cpu += sum(int(x) for x in fields[11:15]) / TICKS  # utime, stime, cutime, cstime
        except (OSError, IndexError, ValueError):
            continue
        memory += _memory_of(pid)
        if kids is not None:
            todo += _children(pid) or []
    return cpu, memory


# ---------------------------------------------------------------- a uid of the call's own (root only)

def become(uid: int) -> None:
    """Take `uid` (and the gid of the same number) for good, with no supplementary groups."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def claim_uid(base: int) -> tuple[int, int]:
    """Lock a uid of [base, base + UID_SPAN) that no other call of this node holds: (uid, the lock's fd,
    released when every process holding it has exited)."""
    os.makedirs(UID_LOCKS, mode=0o700, exist_ok=True)
    st = os.lstat(UID_LOCKS)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o077:
        raise SetupError(f"{UID_LOCKS} must be a directory of root's, mode 0700 (someone else made it?)")
    for uid in range(base, base + UID_SPAN):
        fd = os.open(f"{UID_LOCKS}/{uid}", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return uid, fd
        except BlockingIOError:
            os.close(fd)
    raise SetupError(f"every sandbox uid of [{base}, {base + UID_SPAN}) is in use")


def processes_of(uid: int) -> list[int]:
    """The live (not zombie) processes whose real uid is `uid`."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status", "rb") as f:
                    fields = dict(line.split(b":", 1) for line in f if line.startswith((b"State:", b"Uid:")))
            except (OSError, ValueError):
                continue
            zombie = fields.get(b"State", b"").strip().startswith(b"Z")
            if fields.get(b"Uid", b"").split()[:1] == [str(uid).encode()] and not zombie:
                found.append(int(name))
    return found


def sweep_uid(uid: int, limit_s: float = 10.0) -> None:
    """Kill every process of `uid`, wherever it was re-parented: a child that takes the uid kills every
    process it may signal (kill(-1)), until none is left."""
    end = time.monotonic() + limit_s
    while processes_of(uid) and time.monotonic() < end:
        pid = os.fork()
        if pid == 0:
            try:
                become(uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:  # the ones that were our own children
                pass
        except ChildProcessError:
            pass
        time.sleep(0.002)

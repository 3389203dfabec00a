"""The sandbox launcher: a fresh `python -I` process that confines and runs one piece of model-written code.

Run as a script by pipelinerl/envs/tools/sandbox.py (which imports it only for its constants), so it is
standard library only and starts single-threaded, which unshare(CLONE_NEWUSER) and Landlock's per-thread
rules need:

    python -I -B confine.py WORKDIR STATUS_FD    run WORKDIR/job.json, write a JSON report to STATUS_FD

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

import ctypes
import fcntl
import json
import os
import platform
import resource
import select
import signal
import stat
import struct
import sys
import time

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = (
    32, 1024, 2048, 4096, 16384, 1 << 18, 1 << 21)
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 1, 4, 24, 38, 36
INNER_UID = 1000  # the code's uid inside its user namespace: not 0, so exec() drops the namespace's capabilities
POLL_S = 0.05  # how often the supervisor adds up the call's CPU time and memory
UID_SPAN = 4096  # run_as uids tried: [base, base + UID_SPAN)
UID_LOCKS = "/tmp/pipelinerl-sandbox-uids"  # one lock file per run_as uid in use (root's, 0700)
PAGE = os.sysconf("SC_PAGE_SIZE")
TICKS = os.sysconf("SC_CLK_TCK")

# Syscall numbers per architecture (x86_64: asm/unistd_64.h; aarch64 uses the generic table,
# asm-generic/unistd.h). landlock_* and everything numbered >= 424 are the same on both.
ARCHES = {
    "x86_64": dict(audit=0xC000003E, clone=56, clone3=435, pivot_root=155, kill=62, by_pid=[200, 234, 129, 297, 434],
                   denied=[
        41, 53, 101, 310, 311, 425, 426, 427, 272, 308, 321, 298, 323, 250, 248, 249, 165, 166, 155,
        304, 428, 429, 430, 431, 432, 433, 442, 424]),
    "aarch64": dict(audit=0xC00000B7, clone=220, clone3=435, pivot_root=41, kill=129, by_pid=[130, 131, 138, 240, 434],
                    denied=[
        198, 199, 117, 270, 271, 425, 426, 427, 97, 268, 280, 241, 282, 219, 217, 218, 40, 39, 41,
        265, 428, 429, 430, 431, 432, 433, 442, 424]),
}
# by_pid: tkill, tgkill, rt_sigqueueinfo, rt_tgsigqueueinfo, pidfd_open (their first argument is the target);
# 424 (pidfd_send_signal) is denied outright: a /proc/<pid> directory is a pidfd too.
ARCH = ARCHES.get(platform.machine())
SYS_LANDLOCK_CREATE, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT = 444, 445, 446


class SetupError(Exception):
    """Confining failed: the code did not run."""


class _Stop(Exception):
    """SIGTERM from the sandbox's owner: kill the code now (output cap reached, or the pool closing)."""


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)}")
    return ret


# ---------------------------------------------------------------- probes

def landlock_abi() -> int:
    """Landlock's ABI version, 0 where the kernel has no Landlock (or it is not enabled at boot)."""
    ret = libc.syscall(SYS_LANDLOCK_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(int(ret), 0)


# ---------------------------------------------------------------- seccomp

def _bpf(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def _deny_targets(nr: int, targets: list[int]) -> list[bytes]:
    """Syscall `nr` fails with EPERM when its first argument (a pid_t: the low 32 bits) is one of `targets`;
    otherwise the accumulator holds the syscall number again, for the rules after this block."""
    ld_w, jeq, ja, ret, eperm = 0x20, 0x15, 0x05, 0x06, 0x00050000 | 1
    n = len(targets)
    prog = [_bpf(jeq, nr, 0, n + 4), _bpf(ld_w, 16)]  # seccomp_data.args[0], low word on little-endian
    prog += [_bpf(jeq, t & 0xFFFFFFFF, n + 1 - i, 0) for i, t in enumerate(targets)]  # a match: to the EPERM
    return prog + [_bpf(ld_w, 0), _bpf(ja, 1), _bpf(ret, eperm)]


def seccomp_filter(protected: list[int] = ()) -> bytes:
    """A classic-BPF program: a foreign architecture kills; each denied syscall fails with EPERM; clone with
    CLONE_NEWUSER fails with EPERM; clone3 (whose flags BPF cannot read) fails with ENOSYS, so libc falls back
    to clone; a signal (kill, tkill, tgkill, sigqueue) or pidfd_open aimed at a `protected` pid fails with
    EPERM, and so does kill() of the caller's own process group (0), of every process (-1) or of a protected
    process group (-pid); everything else is allowed."""
    ld_w, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06
    allow, kill, eperm, enosys = 0x7FFF0000, 0x80000000, 0x00050000 | 1, 0x00050000 | 38
    prog = [_bpf(ld_w, 4), _bpf(jeq, ARCH["audit"], 1, 0), _bpf(ret, kill), _bpf(ld_w, 0)]
    if platform.machine() == "x86_64":  # the x32 ABI reaches the same kernel code under other numbers
        prog += [_bpf(0x35, 0x40000000, 0, 1), _bpf(ret, eperm)]  # jge
    for nr in ARCH["denied"]:
        prog += [_bpf(jeq, nr, 0, 1), _bpf(ret, eperm)]
    if protected:
        prog += _deny_targets(ARCH["kill"], [0, -1, *protected, *(-p for p in protected)])
        for nr in ARCH["by_pid"]:
            prog += _deny_targets(nr, list(protected))
    prog += [_bpf(jeq, ARCH["clone3"], 0, 1), _bpf(ret, enosys)]
    prog += [_bpf(jeq, ARCH["clone"], 0, 3), _bpf(ld_w, 16), _bpf(jset, CLONE_NEWUSER, 0, 1), _bpf(ret, eperm)]
    prog.append(_bpf(ret, allow))
    return b"".join(prog)


def apply_seccomp(protected: list[int] = ()) -> None:
    code = seccomp_filter(protected)
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = ctypes.create_string_buffer(struct.pack("HxxxxxxP", len(code) // 8, ctypes.addressof(buf)))
    _check(libc.prctl(22, 2, ctypes.addressof(fprog), 0, 0), "prctl(PR_SET_SECCOMP)")  # SECCOMP_MODE_FILTER


# ---------------------------------------------------------------- Landlock

# Rights a rule on a file (not a directory) may carry, by ABI: EXECUTE, WRITE_FILE, READ_FILE (+TRUNCATE, +IOCTL_DEV)
FS_FILE_RIGHTS = {1: 0b111, 3: 0b111 | 1 << 14, 5: 0b111 | 1 << 14 | 1 << 15}


def _fs_rights(abi: int) -> tuple[int, int, int]:
    """(every right this ABI handles, read+execute, file rights) for Landlock rules."""
    handled = (1 << 13) - 1  # EXECUTE .. MAKE_SYM (ABI 1)
    if abi >= 2:
        handled |= 1 << 13  # REFER
    if abi >= 3:
        handled |= 1 << 14  # TRUNCATE
    if abi >= 5:
        handled |= 1 << 15  # IOCTL_DEV
    read_exec = 1 | 1 << 2 | 1 << 3  # EXECUTE, READ_FILE, READ_DIR
    file_rights = FS_FILE_RIGHTS[max(k for k in FS_FILE_RIGHTS if k <= abi)]
    return handled, read_exec, file_rights


def apply_landlock(abi: int, read_paths: list[str], write_paths: list[str], rw_files: list[str]) -> None:
    """Deny all file access but read+execute beneath read_paths and everything beneath write_paths; with
    ABI >= 4 deny TCP bind/connect; with ABI >= 6 deny signals and abstract unix sockets leaving the sandbox."""
    handled, read_exec, file_rights = _fs_rights(abi)
    if abi >= 6:
        attr = struct.pack("QQQ", handled, 0b11, 0b11)
    elif abi >= 4:
        attr = struct.pack("QQ", handled, 0b11)
    else:
        attr = struct.pack("Q", handled)
    ruleset = _check(libc.syscall(SYS_LANDLOCK_CREATE, attr, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0)),
                     "landlock_create_ruleset")
    try:
        rules = [(p, read_exec) for p in read_paths] + [(p, handled) for p in write_paths]
        rules += [(p, file_rights) for p in rw_files]
        for path, rights in rules:
            if not os.path.exists(path):
                continue
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                if not os.path.isdir(path):
                    rights &= file_rights
                rule = struct.pack("=Qi", rights, fd)
                _check(libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, 1, rule, 0), f"landlock_add_rule({path})")
            finally:
                os.close(fd)
        _check(libc.syscall(SYS_LANDLOCK_RESTRICT, ruleset, 0), "landlock_restrict_self")
    finally:
        os.close(ruleset)


# ---------------------------------------------------------------- namespaces (tier A)

def enter_namespaces() -> None:
    """Unshare user, mount, PID, network, IPC and UTS namespaces; map our uid/gid to INNER_UID."""
    uid, gid = os.geteuid(), os.getegid()
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    _check(libc.unshare(flags), "unshare(user, mount, pid, net namespaces)")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{INNER_UID} {uid} 1"), ("gid_map", f"{INNER_UID} {gid} 1")):
        try:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        except OSError as error:
            raise SetupError(f"writing /proc/self/{name}: {error.strerror}") from None


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    _check(libc.mount(enc[0], enc[1], enc[2], flags, enc[3]), f"mount {target}")


def _locked_flags(path: str) -> int:
    """The mount flags of `path` that a user namespace may not clear (so a read-only remount keeps them)."""
    st = os.statvfs(path).f_flag
    pairs = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
             (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))
    return sum(ms for st_flag, ms in pairs if st & st_flag)


def _bind(root: str, path: str, writable: bool = False) -> None:
    target = root + path
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(path, target, None, MS_BIND | MS_REC)
    if not writable:
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _locked_flags(path))


def build_root(root: str, read_paths: list[str], dev_files: list[str], scratch: str, scratch_bytes: int) -> None:
    """Make `root` a fresh tmpfs holding read_paths (read-only, same paths; symlinks copied as symlinks), the
    dev_files, a tmpfs of scratch_bytes at `scratch` and a /proc of the new PID namespace, then pivot into it."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    bound: list[str] = []
    for path in read_paths:
        if any(path.startswith(b + "/") for b in bound):
            continue  # already visible through a bound parent
        bound.append(path)
        if os.path.islink(path) and os.path.dirname(path) == "/":  # /lib -> usr/lib on merged-/usr systems
            os.symlink(os.readlink(path), root + path)
        elif os.path.exists(path):
            _bind(root, path)
    for path in dev_files:
        _bind(root, path, writable=True)
    os.makedirs(root + scratch)
    _mount("tmpfs", root + scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0700,size={scratch_bytes}")
    os.makedirs(root + "/proc")
    try:
        _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except SetupError:
        pass  # a container that masks /proc refuses new proc mounts: the code goes without /proc
    os.chdir(root)
    _check(libc.syscall(ARCH["pivot_root"], b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


# ---------------------------------------------------------------- the code's process

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


def _limits(job: dict, tier: str) -> None:
    lim = job["limits"]
    cpu = int(-(-lim["cpu_s"] // 1))
    # RLIMIT_NPROC counts every task of the real uid, except inside a user namespace of its own (tier A);
    # in tiers B and C the user's other processes (the actor's threads, servers) would use it up, so the
    # code gets max_processes more than the user runs now; under a uid of its own (root's launcher) nothing
    # else counts.
    nproc = lim["max_processes"] + (0 if tier == "A" or job.get("uid") is not None else user_tasks())
    for which, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS,) + (lim["memory_bytes"],) * 2,
                              (resource.RLIMIT_NPROC, nproc, nproc),
                              (resource.RLIMIT_FSIZE,) + (lim["max_file_bytes"],) * 2,
                              (resource.RLIMIT_NOFILE, 256, 256), (resource.RLIMIT_CORE, 0, 0)):
        resource.setrlimit(which, (soft, hard))


def _drop_capabilities() -> None:
    """Empty the bounding set, so that exec() leaves no capability even to uid 0 (root outside a user
    namespace, where it matters most: it would otherwise keep CAP_DAC_OVERRIDE and friends)."""
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 and ctypes.get_errno() == 22:  # EINVAL: past the last cap
            break


def _child_setup(job: dict, tier: str, keep_fd: int) -> None:
    """In the forked child: stdin, descriptors, limits, then the confinement of `tier`; raises on failure."""
    os.dup2(job["stdin_fd"], 0)
    os.closerange(3, keep_fd)
    os.closerange(keep_fd + 1, 65536)
    os.chdir(job["scratch"])
    if tier == "A" or os.geteuid() == 0:
        _drop_capabilities()
    if tier != "A" and job.get("uid") is not None:  # tier A's launcher took it before entering its namespaces
        become(job["uid"])
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _limits(job, tier)
    # Landlock and seccomp both need no_new_privs unless the caller holds CAP_SYS_ADMIN (root does)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    if tier in ("A", "B") and job["landlock_abi"] > 0:
        reads = job["read_paths"] + (["/proc"] if tier == "A" else [])
        apply_landlock(job["landlock_abi"], reads, [job["scratch"]], job["dev_files"])
    # tier A's code sees neither pid (its own PID namespace); elsewhere the launcher and its caller are protected
    apply_seccomp([] if tier == "A" else [os.getppid(), job["caller_pid"]])


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


def _over(limits: dict | None) -> str | None:
    """"cpu" or "memory" when the call is over that limit of `limits` (the job's), else None."""
    if limits is None:
        return None
    cpu, memory = call_usage()
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


# ---------------------------------------------------------------- tier A

def _pid1(job: dict, report_w: int, deadline: float) -> None:
    """PID 1 of tier A's namespaces: build the root, run the code, report, exit (which kills what remains)."""
    try:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        build_root(job["root"], job["read_paths"], job["dev_files"], job["scratch"], job["limits"]["scratch_bytes"])
        _write_code(job)
        report = supervise(spawn_code(job, "A"), deadline, job["limits"])
    except BaseException as error:  # noqa: BLE001 - reported as a setup error
        report = {"error": f"{type(error).__name__}: {error}"}
    os.write(report_w, json.dumps(report).encode())
    os._exit(0)


def run_tier_a(job: dict, deadline: float) -> dict:
    if job.get("uid") is not None:  # the namespaces of an ordinary user: the uid of the call's own
        become(job["uid"])
        # a uid change made us non-dumpable, which gives our /proc/self/uid_map to root: we could not write it
        libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    enter_namespaces()
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
    _check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # code of our uid may not read our environ or write our memory
    _write_code(job)
    try:
        return supervise(spawn_code(job, tier), deadline, job["limits"])
    finally:
        # A SIGTERM (output cap, close) landing here would raise _Stop half-way and leave processes to init:
        # it waits, blocked, until the clean-up is done (the launcher then exits without acting on it).
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        kill_descendants()
        if job.get("uid") is not None:
            sweep_uid(job["uid"])


def _on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second one must not cut the clean-up short
    raise _Stop


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


def _take_uid(job: dict, workdir: str) -> None:
    """Root's launcher: the call's own uid in job["uid"], its leftovers from an earlier call killed, and the
    work directory made the uid's (tier A's root and scratch are mount points the uid must reach)."""
    uid, job["uid_lock_fd"] = claim_uid(job["run_as_uid_base"])
    sweep_uid(uid)
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
    return {"landlock_abi": landlock_abi(), "arch_supported": ARCH is not None, "euid": os.geteuid(),
            "read_paths": default_read_paths()}


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

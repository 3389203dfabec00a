"""The kernel interfaces the sandbox launcher confines with: seccomp (classic BPF), Landlock, tier A's
namespaces and root file system, capabilities. Standard library only (see launcher.py); a failure to confine
is a SetupError.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct

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


def check(ret: int, what: str) -> int:
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
    check(libc.prctl(22, 2, ctypes.addressof(fprog), 0, 0), "prctl(PR_SET_SECCOMP)")  # SECCOMP_MODE_FILTER


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
    ruleset = check(libc.syscall(SYS_LANDLOCK_CREATE, attr, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0)),
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
                check(libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, 1, rule, 0), f"landlock_add_rule({path})")
            finally:
                os.close(fd)
        check(libc.syscall(SYS_LANDLOCK_RESTRICT, ruleset, 0), "landlock_restrict_self")
    finally:
        os.close(ruleset)


# ---------------------------------------------------------------- namespaces (tier A)

def enter_namespaces() -> None:
    """Unshare user, mount, PID, network, IPC and UTS namespaces; map our uid/gid to INNER_UID."""
    uid, gid = os.geteuid(), os.getegid()
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    check(libc.unshare(flags), "unshare(user, mount, pid, net namespaces)")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{INNER_UID} {uid} 1"), ("gid_map", f"{INNER_UID} {gid} 1")):
        try:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        except OSError as error:
            raise SetupError(f"writing /proc/self/{name}: {error.strerror}") from None


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    check(libc.mount(enc[0], enc[1], enc[2], flags, enc[3]), f"mount {target}")


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
    check(libc.syscall(ARCH["pivot_root"], b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


# ---------------------------------------------------------------- capabilities

def drop_capabilities() -> None:
    """Empty the bounding set, so that exec() leaves no capability even to uid 0 (root outside a user
    namespace, where it matters most: it would otherwise keep CAP_DAC_OVERRIDE and friends)."""
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 and ctypes.get_errno() == 22:  # EINVAL: past the last cap
            break

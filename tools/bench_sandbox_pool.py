"""The Python sandbox's pool under load (issue 46 item 4): calls/s against the pool size for a trivial script
(`print(i * i)`, each call a fresh confined process), then a burst of `--burst` queued calls with hostile ones
beside them (an endless loop, a sleep past the wall clock, a memory bomb, an output flood, a background
process), counting what is left afterwards: child processes, work directories, open descriptors, and the
resident memory the burst added to this process.

    python tools/bench_sandbox_pool.py [--calls 200] [--pools 1 2 4 8] [--burst 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_summary import Summary  # noqa: E402

from pipelinerl.envs.tools import PythonSandbox, SandboxLimits  # noqa: E402

HOSTILE = ["while True:\n    pass", "import time\ntime.sleep(60)", "b = bytearray(2 * 1024**3)",
           "while True:\n    print('x' * 1000)", "import os\nos.system('sleep 30 &')"]


def children() -> int:
    """This process's live child processes."""
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            n += int(open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[1]) == os.getpid()
        except OSError:
            pass
    return n


def rss_mb() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 2**20


async def rate(pool: int, calls: int, work_root: str) -> float:
    box = PythonSandbox(SandboxLimits(pool_size=pool, work_root=work_root))
    start = time.monotonic()
    results = await asyncio.gather(*(box.run(f"print({i} * {i})") for i in range(calls)))
    elapsed = time.monotonic() - start
    assert all(r.ok and r.stdout == f"{i * i}\n" for i, r in enumerate(results)), "a trivial call failed"
    return calls / elapsed


async def burst(n: int, pool: int, work_root: str) -> dict:
    box = PythonSandbox(SandboxLimits(wall_s=2, cpu_s=1, memory_bytes=512 << 20, max_output_bytes=1 << 12,
                                      pool_size=pool, work_root=work_root))
    codes = [HOSTILE[i // 10 % len(HOSTILE)] if i % 10 == 0 else f"print({i} * {i})" for i in range(n)]
    before = {"children": children(), "fds": len(os.listdir("/proc/self/fd")), "rss_mb": rss_mb()}
    start = time.monotonic()
    results = await asyncio.gather(*(box.run(code) for code in codes))
    elapsed = time.monotonic() - start
    wrong = sum(not r.ok or r.stdout != f"{i * i}\n" for i, r in enumerate(results) if i % 10)
    return {"seconds": elapsed, "wrong": wrong, "reasons": sorted({r.reason for r in results}),
            "children_left": children() - before["children"],
            "fds_left": len(os.listdir("/proc/self/fd")) - before["fds"],
            "work_dirs_left": len(os.listdir(work_root)), "rss_added_mb": rss_mb() - before["rss_mb"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="trivial calls per pool size")
    parser.add_argument("--pools", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--burst", type=int, default=1000, help="queued calls, one in ten hostile")
    parser.add_argument("--summary", type=Path, default=None)
    args = parser.parse_args()
    summary = Summary("sandbox_pool")
    print(f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as root:
        os.chmod(root, 0o755)  # as root, each call's code runs under a uid of its own, which must reach it
        for pool in args.pools:
            r = asyncio.run(rate(pool, args.calls, root))
            print(f"pool {pool}: {r:.1f} calls/s ({args.calls} trivial calls)")
            summary.add(f"calls/s, pool {pool}", r, "calls/s")
        pool = max(args.pools)
        got = asyncio.run(burst(args.burst, pool, root))
    print(f"burst of {args.burst} calls (one in ten hostile) on a pool of {pool}: {got['seconds']:.1f} s, "
          f"{got['wrong']} ordinary calls wrong; results {got['reasons']}")
    print(f"left after it: {got['children_left']} processes, {got['work_dirs_left']} work directories, "
          f"{got['fds_left']} descriptors; resident memory +{got['rss_added_mb']:.1f} MiB")
    summary.add(f"burst of {args.burst}, s", got["seconds"], "s")
    for name in ("wrong", "children_left", "work_dirs_left", "fds_left"):
        summary.add(f"burst: {name.replace('_', ' ')}", got[name], "", "<= 0")
    summary.add("burst: resident memory added", got["rss_added_mb"], "MiB")
    summary.write(args.summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())

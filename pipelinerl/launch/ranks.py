"""`pipelinerl train --nproc N`: N trainer ranks on this machine, started the way torchrun starts them.

torchrun is not used: it dies at once of SIGUSR1 (it forwards only SIGTERM to its workers), and a stop must
reach every rank together, since the ranks checkpoint collectively. This parent forwards SIGTERM,
SIGUSR1 and SIGINT to every rank, waits for all of them, and when one rank fails stops the others
(their next collective would fail or hang on the missing peer) and exits with the failed rank's code.
Ranks stay in the parent's process group, so a launcher that kills the group kills them all.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time

from pipelinerl.launch.procs import die_with_parent

log = logging.getLogger(__name__)

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def rank_env(rank: int, world: int, master_port: int, gpus: list[str] | None) -> dict[str, str]:
    """torch.distributed's variables for one local rank; with GPUs, every rank sees the trainer's GPUs
    and LOCAL_RANK picks its own (as torchrun does)."""
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(master_port)}
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return env


def run_ranks(argv: list[str], nproc: int, master_port: int, gpus: list[str] | None = None,
              grace_s: float = 30.0, poll_s: float = 0.2) -> int:
    """Run `argv` as ranks 0..nproc-1; the exit code: 0, or the first failed rank's."""
    if gpus is not None and len(gpus) < nproc:
        raise ValueError(f"{nproc} trainer ranks need {nproc} GPUs; got {','.join(gpus)}")
    procs: list[subprocess.Popen] = []
    received: list[int] = []

    def forward(signum, frame) -> None:
        received.append(signum)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    # Handlers first: a stop that comes while the ranks are being started must not kill this parent alone.
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    for r in range(nproc):
        procs.append(subprocess.Popen(argv, env={**os.environ, **rank_env(r, nproc, master_port, gpus)},
                                      stdin=subprocess.DEVNULL, preexec_fn=die_with_parent))  # noqa: PLW1509
        for signum in received:  # a stop that came before this rank existed
            procs[-1].send_signal(signum)
    try:
        while True:
            codes = [proc.poll() for proc in procs]
            failed = next(((r, c) for r, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None:
                log.error("trainer rank %d exited with code %d; stopping the other ranks", *failed)
                _stop(procs, grace_s)
                return failed[1]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

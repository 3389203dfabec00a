"""A server's announcement: its discovery file (rundir.publish_server), written once its own `GET /health`
answers 200. Both kinds of server the launchers start announce themselves this way: a vLLM server
(inference/server.py) and an OpenEnv environment server (envs/openenv_server.py).

A write that fails (the run directory unwritable, a network filesystem's error) is retried; one that keeps
failing is an error that stops the server: a healthy server nobody can find must not stay up unannounced.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from pipelinerl import rundir

log = logging.getLogger(__name__)

ANNOUNCE_ATTEMPTS = 5  # writes of the discovery file before the server gives up (1, 2, 4, 8 s apart)


async def announce_when_healthy(run_dir: str, bind_host: str, port: int, folder: str, published: list[Path]) -> None:
    """Publish RUN_DIR/<folder>/<host>_<port> once our own /health answers 200, and append its path to
    `published` (the server removes it when it stops). A write that fails is retried ANNOUNCE_ATTEMPTS times,
    then raises AnnounceError."""
    import httpx

    local = "127.0.0.1" if bind_host in rundir.WILDCARDS else bind_host
    # Polls until the server is up (a vLLM engine: minutes on CPU); 300 s per request is aiohttp's default, used
    # before.
    async with httpx.AsyncClient(timeout=300.0) as client:
        while True:
            try:
                if (await client.get(f"http://{local}:{port}/health")).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
    host = rundir.advertised_host(bind_host)
    for attempt in range(ANNOUNCE_ATTEMPTS):
        try:
            published.append(rundir.publish_server(run_dir, host, port, folder))
            return
        except OSError as err:
            if attempt == ANNOUNCE_ATTEMPTS - 1:
                raise AnnounceError(f"could not announce this server (http://{host}:{port}) in "
                                    f"{Path(run_dir) / folder} after {ANNOUNCE_ATTEMPTS} attempts: {err}") from err
            log.warning("announcing http://%s:%d failed (%s); retrying", host, port, err)
            await asyncio.sleep(2.0 ** attempt)


class AnnounceError(RuntimeError):
    """The server is healthy but its discovery file could not be written."""


def stop_if_unannounced(task: asyncio.Task, stop) -> None:
    """Done-callback of the announcement task: call `stop()` if it failed (not if cancelled or done)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("stopping: %s", task.exception())
        stop()

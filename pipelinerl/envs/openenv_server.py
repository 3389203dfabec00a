"""`pipelinerl openenv-serve CONFIG --port P`: one OpenEnv environment server of the run, a role of the launchers
like a vLLM server (task.openenv.serve; launch/commands.py's `openenv_server` gives its command and port).

uvicorn serves the ASGI app `module:app` (task.openenv.path put on sys.path and PYTHONPATH first) on
inference.host's address (loopback unless set; every interface on Slurm) and port P. Once the app's own
`GET /health` answers 200 (openenv-core's create_app serves it), the server announces itself in
RUN_DIR/openenv_servers/<host>_<port> (announce.py, as a vLLM server does), where the actor's openenv task finds
it (envs/openenv_env.py), and removes that file when it stops (SIGTERM, SIGINT). The launchers' health watch
polls the same /health (launch/health.py) and restarts a server that dies or stops answering.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

from pipelinerl import rundir
from pipelinerl.announce import announce_when_healthy, stop_if_unannounced
from pipelinerl.config import Config

log = logging.getLogger(__name__)

# uvicorn waits this long for open sessions to close when it stops, then closes them: the discovery file is
# removed before a launcher's SIGKILL (procs.Supervisor.stop_all: 20 s after its SIGTERM).
GRACEFUL_SHUTDOWN_S = 5


def serve(cfg: Config, port: int) -> None:
    """Entry point of `pipelinerl openenv-serve` (blocks until SIGTERM or SIGINT)."""
    import uvicorn

    from pipelinerl.tasks.base import add_import_path

    o = cfg.task.openenv
    if o.path:
        add_import_path(o.path, "task.openenv.path")
    # uvicorn re-raises the signal that stopped it once it has shut down; SIGTERM's default action would end the
    # process before the discovery file is removed. As SystemExit it unwinds through `run`'s finally.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    host = rundir.bind_host(cfg.inference.host)
    # ws="websockets": under uvicorn's default (websockets-sansio, 0.55) openenv-core's /ws handler logs an "Exception
    # in ASGI application" traceback at every session's close. log_level="warning": uvicorn logs every session's
    # connection at info, several lines per episode.
    server = uvicorn.Server(uvicorn.Config(o.serve, host=host, port=port, ws="websockets", log_level="warning",
                                           timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    log.info("serving %s on %s:%d (announced in %s/%s once its /health answers)", o.serve, host, port, cfg.run_dir,
             rundir.OPENENV_SERVERS_DIR)
    asyncio.run(run(cfg, server, host, port))


async def run(cfg: Config, server, host: str, port: int) -> None:
    """Serve until stopped; announced once healthy, unannounced on the way out."""
    published: list[Path] = []
    announce = asyncio.create_task(announce_when_healthy(cfg.run_dir, host, port, rundir.OPENENV_SERVERS_DIR,
                                                         published))
    announce.add_done_callback(lambda t: stop_if_unannounced(t, lambda: setattr(server, "should_exit", True)))
    try:
        await server.serve()
    finally:
        announce.cancel()
        for path in published:
            path.unlink(missing_ok=True)
    if announce.done() and not announce.cancelled() and announce.exception() is not None:
        raise SystemExit(f"stopped: {announce.exception()}")
    if not server.started:
        raise SystemExit(f"the OpenEnv server {cfg.task.openenv.serve} did not start on port {port} (see above)")

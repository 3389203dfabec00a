"""Rank 0's weight transport to the run's inference servers (those announced in RUN_DIR/servers)."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterable
from urllib.parse import urlparse

import torch

from pipelinerl.config import Config
from pipelinerl.trainer.dist import DistInfo

log = logging.getLogger("pipelinerl.trainer")


def broadcast_address(cfg: Config, server_url: str) -> str:
    """trainer.broadcast_host, or the local address on the route to the first server (works for
    loopback on one machine and picks the right interface on a cluster)."""
    if cfg.trainer.broadcast_host:
        return cfg.trainer.broadcast_host
    url = urlparse(server_url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((url.hostname, url.port or 80))  # UDP: no packet is sent
        return s.getsockname()[0]


def wait_for_servers(run_dir: str, timeout_s: float, stop_flag=lambda: False) -> list[str]:
    """The announced servers' URLs; [] when a stop signal came first."""
    from pipelinerl.inference.rundir import list_servers

    deadline = time.monotonic() + timeout_s
    while not (urls := list_servers(run_dir)):
        if stop_flag():
            return []
        if time.monotonic() > deadline:
            raise TimeoutError(f"no inference server announced itself in {run_dir}/servers within {timeout_s:.0f} s")
        time.sleep(1.0)
    return urls


class ServerBroadcaster:
    """A contract.WeightSender for the run's servers. Built before the model loads (the trainer backend takes
    it in its constructor) so that loading overlaps the servers' start-up; `connect` then waits for them and
    opens the weight-update group. Until connected, or when a stop signal came before any server, `broadcast`
    sends nothing and returns the bytes it would have sent (the gather, a collective, still runs).

    Servers come and go (a server dies, the launcher restarts it, a user adds one): before each update the
    group is re-formed when it is broken or the announced servers changed (RUN_DIR/servers: a restarted
    server announces itself again). A failed update never stops the run: it is logged, the group is left,
    and the reply says `failed` (trainer/loop.py then gathers again for one retry on a re-formed group)."""

    def __init__(self, cfg: Config, dist: DistInfo):
        self.cfg, self.dist = cfg, dist
        self._sender = None  # a weights.WeightBroadcaster once connected
        self._roster: dict[str, int] = {}  # the announced servers the group was formed from

    def connect(self, stop_flag=lambda: False) -> bool:
        """Open the group with every server announced in RUN_DIR/servers; False when a stop signal came
        before any server (the loop then stops every rank at its first step)."""
        from pipelinerl.inference.rundir import run_token
        from pipelinerl.weights import WeightBroadcaster

        cfg = self.cfg
        urls = wait_for_servers(cfg.run_dir, cfg.inference.startup_timeout_s, stop_flag)
        if not urls:
            return False
        backend = cfg.inference.weight_update_backend or self.dist.backend
        self._sender = WeightBroadcaster(
            urls, backend, broadcast_address(cfg, urls[0]), cfg.trainer.broadcast_port,
            cfg.inference.weight_update_timeout_s, int(cfg.trainer.broadcast_bucket_mb * 2**20),
            run_token(cfg.run_dir, cfg.inference.auth_token), checksum_every=cfg.trainer.broadcast_checksum_every,
            delta=cfg.trainer.broadcast_delta == "auto")
        self._reform()
        return True

    def _reform(self) -> None:
        from pipelinerl.inference.rundir import server_roster
        from pipelinerl.weights import WeightTransferError

        self._roster = server_roster(self.cfg.run_dir)
        try:
            self._sender.connect(sorted(self._roster) or None)
        except (WeightTransferError, TimeoutError) as err:
            log.warning("could not form the weight-update group (retried before the next update): %s", err)

    def _roster_changed(self, roster: dict[str, int]) -> bool:
        """A server announced since the group formed (new, or restarted: announced anew), or a member's
        announcement gone (it stopped). A server left out that is no longer announced changes nothing (the
        launcher removes a dead server's announcement: re-forming then would cost a round for nothing)."""
        members = self._sender.server_urls
        return (any(self._roster.get(url) != at for url, at in roster.items())
                or any(url not in roster for url in members))

    def broadcast(self, version: int, metas, tensors: Iterable[torch.Tensor]) -> dict:
        from pipelinerl.inference.rundir import server_roster
        from pipelinerl.weights import WeightTransferError

        if self._sender is None:
            return {"bytes": float(sum(t.numel() * t.element_size() for t in tensors))}
        tensors = iter(tensors)
        try:
            if not self._sender.connected or self._roster_changed(server_roster(self.cfg.run_dir)):
                self._reform()
            if not self._sender.connected:
                raise WeightTransferError("no weight-update group")
            return self._sender.broadcast(version, metas, tensors)
        except (WeightTransferError, TimeoutError) as err:
            for _ in tensors:  # the other ranks' gathers are collectives: run them to their end
                pass
            log.warning("weight update %d failed: %s. The servers keep their weights; the group is re-formed "
                        "with the servers that answer", version, err)
            return {"bytes": 0.0, "failed": 1.0}

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()

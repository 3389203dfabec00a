"""The network interface a process's gloo and NCCL sockets use to reach the other nodes.

torch's gloo picks the address it listens on and tells its peers by resolving this host's own name, unless
GLOO_SOCKET_IFNAME names an interface; NCCL's bootstrap takes NCCL_SOCKET_IFNAME. Debian and Ubuntu images
map a host's own name to 127.0.1.1 in /etc/hosts, so on such a node gloo listens on loopback and its peers on
other nodes fail with "Connection refused, remote=[127.0.1.1]". So every process that joins a group across
nodes names the interface first (`use_interface`): the one set in the environment (the user's, or
launch.network_interface, which the launchers put there), else the one that carries its route to the group's
master. On one machine that route is loopback, which is right there.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def route_source(host: str, port: int = 80) -> str:
    """This host's address on the route to `host` (a UDP connect: no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def interface_with(address: str) -> str:
    """The name of the local interface that holds IPv4 `address`."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addresses):
            return name
    raise LookupError(f"no local interface has the address {address}")


def interface_env(interface: str | None) -> dict[str, str]:
    """The environment that makes a role's gloo and NCCL use `interface` (launch.network_interface), less
    what this environment sets already (the user's choice wins); empty for None."""
    if interface is None:
        return {}
    return {name: interface for name in SOCKET_IFNAME_VARS if name not in os.environ}


def use_interface(peer: str) -> str | None:
    """Make this process's gloo and NCCL sockets use the interface of its route to `peer` (a host name or
    address of the group's master), where the environment names none; returns the interface gloo will use
    (None: gloo's own choice, when the route cannot be found)."""
    if all(name in os.environ for name in SOCKET_IFNAME_VARS):
        return os.environ["GLOO_SOCKET_IFNAME"]
    try:
        address = route_source(peer)
        interface = interface_with(address)
    except (OSError, LookupError) as err:
        log.warning("no route to %s found (%s); gloo picks its own address (set launch.network_interface "
                    "if the groups fail to connect)", peer, err)
        return os.environ.get("GLOO_SOCKET_IFNAME")
    for name in SOCKET_IFNAME_VARS:
        os.environ.setdefault(name, interface)
    log.info("gloo and NCCL sockets on interface %s (%s: the route to %s)", os.environ["GLOO_SOCKET_IFNAME"],
             address, peer)
    return os.environ["GLOO_SOCKET_IFNAME"]

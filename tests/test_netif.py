"""The interface gloo and NCCL sockets use (pipelinerl/netif.py): chosen by the route to the group's master,
the user's environment first. (Across hosts whose names resolve to 127.0.1.1: tests/test_slurm.py's virtual
cluster.)"""

import logging

import pytest

from pipelinerl import netif


@pytest.fixture
def clean_env(monkeypatch):
    for name in netif.SOCKET_IFNAME_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_route_to_loopback_is_the_loopback_interface(clean_env, caplog):
    assert netif.route_source("127.0.0.1") == "127.0.0.1"
    assert netif.interface_with("127.0.0.1") == "lo"
    with caplog.at_level(logging.INFO, logger="pipelinerl.netif"):
        assert netif.use_interface("127.0.0.1") == "lo"
    assert [netif.os.environ[name] for name in netif.SOCKET_IFNAME_VARS] == ["lo", "lo"]
    assert "gloo and NCCL sockets on interface lo (127.0.0.1: the route to 127.0.0.1)" in caplog.text


def test_an_interface_the_user_named_is_kept(clean_env):
    clean_env.setenv("GLOO_SOCKET_IFNAME", "ib0")
    assert netif.use_interface("127.0.0.1") == "ib0"
    assert (netif.os.environ["GLOO_SOCKET_IFNAME"], netif.os.environ["NCCL_SOCKET_IFNAME"]) == ("ib0", "lo")
    assert netif.interface_env("eth1") == {}  # both set now: the launcher adds nothing
    clean_env.delenv("NCCL_SOCKET_IFNAME")
    assert netif.interface_env("eth1") == {"NCCL_SOCKET_IFNAME": "eth1"}
    assert netif.interface_env(None) == {}


def test_no_route_leaves_the_choice_to_gloo_with_a_warning(clean_env, caplog):
    def unreachable(host, port=80):
        raise OSError("Network is unreachable")

    clean_env.setattr(netif, "route_source", unreachable)
    assert netif.use_interface("10.9.9.9") is None
    assert not any(name in netif.os.environ for name in netif.SOCKET_IFNAME_VARS)
    assert "no route to 10.9.9.9 found (Network is unreachable)" in caplog.text
    with pytest.raises(LookupError, match="no local interface has the address 192.0.2.254"):
        netif.interface_with("192.0.2.254")

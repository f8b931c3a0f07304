"""The gloo/NCCL socket interface: found by the network holding the node's address (longest prefix,
an interface's own address first), or named by transfer.socket_ifname; an error listing what was
seen when nothing fits. Over made-up interface tables, and once over this machine's."""
import pytest

from cluster.transfer.base import TransferConfig
from cluster.transfer.netif import IfAddr, interface_for, interfaces, pick_interface

TABLE = [IfAddr("lo", "127.0.0.1", 8), IfAddr("eth0", "10.1.2.3", 16), IfAddr("eth0", "10.9.0.7", 24),
         IfAddr("ib0", "10.1.200.5", 24), IfAddr("docker0", "172.17.0.1", 16), IfAddr("eth0", "fd00::2", 64)]


@pytest.mark.parametrize("address,name", [
    ("127.0.0.1", "lo"),          # an interface's own address
    ("127.0.0.3", "lo"),          # a loopback alias: inside lo's 127.0.0.0/8, not its address
    ("10.1.200.9", "ib0"),        # in eth0's 10.1.0.0/16 and ib0's 10.1.200.0/24: the longer prefix
    ("10.1.7.7", "eth0"),         # only in eth0's /16
    ("10.9.0.200", "eth0"),       # a secondary address's network
    ("172.17.5.4", "docker0"),
    ("fd00::99", "eth0"),         # IPv6 too
])
def test_the_network_holding_the_address_names_the_interface(address, name):
    assert pick_interface(address, TABLE) == name


def test_an_interface_holding_the_address_itself_beats_a_longer_network():
    table = [IfAddr("wide", "10.0.0.5", 8), IfAddr("narrow", "10.0.0.4", 30)]    # 10.0.0.4-7
    assert pick_interface("10.0.0.5", table) == "wide"
    assert pick_interface("10.0.0.6", table) == "narrow"


def test_no_interface_fits_lists_what_was_seen():
    with pytest.raises(ValueError) as e:
        pick_interface("192.168.5.5", TABLE)
    msg = str(e.value)
    assert "no network interface holds the address 192.168.5.5" in msg
    assert "lo 127.0.0.1/8, eth0 10.1.2.3/16" in msg and "ib0 10.1.200.5/24" in msg
    assert "transfer.socket_ifname" in msg


def test_socket_ifname_names_it_and_must_exist():
    assert pick_interface("192.168.5.5", TABLE, "ib0") == "ib0"
    with pytest.raises(ValueError, match=r"transfer.socket_ifname='eth9': no interface of that name on this node; "
                                         r"interfaces seen: lo 127.0.0.1/8"):
        pick_interface("10.1.2.3", TABLE, "eth9")


def test_an_address_that_is_not_one_asks_for_socket_ifname():
    with pytest.raises(ValueError, match="'node-a' is not an IP address; set transfer.socket_ifname"):
        pick_interface("node-a", TABLE)


@pytest.mark.parametrize("bad", ["", "eth0,eth1", "eth 0", 3])
def test_socket_ifname_is_one_name(bad):
    with pytest.raises(ValueError, match="transfer.socket_ifname="):
        TransferConfig(backend="nccl", socket_ifname=bad)


def test_this_machines_table_has_loopback_and_finds_an_alias():
    table = interfaces()
    assert IfAddr("lo", "127.0.0.1", 8) in table
    assert interface_for("127.0.0.3") == "lo"

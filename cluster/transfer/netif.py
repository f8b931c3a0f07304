"""Which network interface gloo and NCCL sockets use: the one whose network holds the node's address.

gloo and NCCL take an interface by name (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME). A node's address is
not always an interface's own address: a loopback alias such as 127.0.0.3 lies in lo's 127.0.0.0/8,
and secondary addresses or some container networks are reached the same way. So the lookup takes the
interface whose network contains the address, the longest prefix winning (an interface holding the
address itself wins over all), from every address of every interface (getifaddrs, so secondary
addresses count). `transfer.socket_ifname` names the interface instead. When nothing matches, the
error lists what was seen.

The choice (`pick_interface`) is pure, over a table of (interface, address, prefix length), so it is
tested with made-up tables; `interfaces()` reads the real one.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class IfAddr:
    name: str            # the interface, e.g. "lo", "eth0"
    address: str         # one of its addresses
    prefixlen: int       # the length of that address's network prefix

    def __str__(self) -> str:
        return f"{self.name} {self.address}/{self.prefixlen}"


def pick_interface(address: str, table: list[IfAddr], name: str | None = None) -> str:
    """The interface for sockets of a node reached at `address`: `name` when given (it must exist),
    else the interface whose network contains `address`, the longest prefix winning and an exact
    address before any network. Raises ValueError listing the interfaces seen when none fits."""
    if name is not None:
        if any(a.name == name for a in table):
            return name
        raise ValueError(f"transfer.socket_ifname={name!r}: no interface of that name on this node; "
                         f"interfaces seen: {_seen(table)}")
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        raise ValueError(f"the node address {address!r} is not an IP address; set transfer.socket_ifname "
                         f"to the interface to use (interfaces seen: {_seen(table)})") from None
    best, best_key = None, None
    for a in table:
        net = ipaddress.ip_interface(f"{a.address}/{a.prefixlen}").network
        if net.version != ip.version or ip not in net:
            continue
        key = (ipaddress.ip_address(a.address) == ip, a.prefixlen)
        if best_key is None or key > best_key:
            best, best_key = a.name, key
    if best is None:
        raise ValueError(f"no network interface holds the address {address} or a network containing it; "
                         f"interfaces seen: {_seen(table)}; set transfer.socket_ifname to the one to use")
    return best


def _seen(table: list[IfAddr]) -> str:
    return ", ".join(map(str, table)) or "none"


class _SockAddr(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 26)]


class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [("next", ctypes.POINTER(_IfAddrs)), ("name", ctypes.c_char_p), ("flags", ctypes.c_uint),
                     ("addr", ctypes.POINTER(_SockAddr)), ("netmask", ctypes.POINTER(_SockAddr)),
                     ("ifu", ctypes.c_void_p), ("data", ctypes.c_void_p)]

# bytes of the address within sockaddr_in / sockaddr_in6, after the 2-byte family
_SPAN = {socket.AF_INET: (2, 6), socket.AF_INET6: (6, 22)}


def _raw(sa: _SockAddr) -> bytes:
    lo, hi = _SPAN[sa.family]
    return bytes(sa.data[lo:hi])


def interfaces() -> list[IfAddr]:
    """Every IPv4 and IPv6 address of every interface of this machine (getifaddrs)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    out = []
    try:
        node = head
        while node:
            ifa = node.contents
            if ifa.addr and ifa.addr.contents.family in _SPAN and ifa.netmask:
                family = ifa.addr.contents.family
                addr = socket.inet_ntop(family, _raw(ifa.addr.contents))
                mask = int.from_bytes(_raw(ifa.netmask.contents), "big")
                out.append(IfAddr(ifa.name.decode(), addr.split("%")[0], bin(mask).count("1")))
            node = ifa.next
    finally:
        libc.freeifaddrs(head)
    return out


def interface_for(address: str, name: str | None = None) -> str:
    """This machine's interface for sockets of a node reached at `address` (see pick_interface)."""
    return pick_interface(address, interfaces(), name)

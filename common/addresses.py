"""Socket addresses as peers must dial them: who binds what, and what they are told.

A service binds on its ``--host`` (loopback by default; an interface address, or a
wildcard such as ``0.0.0.0`` for every interface) and *advertises* the address its peers
dial: ``--advertise-host`` if given, else the bound host, else (for a wildcard) its own
address on the route to the router — the network it shares with every peer — so nothing
is ever advertised as a wildcard, and a cluster across hosts needs no per-host names.
"""

from __future__ import annotations

import ipaddress
import logging
import random
import socket

log = logging.getLogger("tandem.addresses")

_WILDCARDS = ("0.0.0.0", "[::]", "*")
WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "*", "")


def reachable(address: str, host: str) -> str:
    """``tcp://0.0.0.0:7200`` bound here is ``tcp://<host>:7200`` to everyone else."""
    for wildcard in _WILDCARDS:
        address = address.replace(f"//{wildcard}:", f"//{host}:")
    return address


def advertise_host(bind_host: str, given: str | None, toward: str) -> str:
    """How peers reach a service bound on ``bind_host``: ``given``; else ``bind_host``
    unless it is a wildcard; else this host's address on the route to ``toward`` (the
    router's ZMQ address), and only when there is no route, the hostname. Warns when the
    answer is a loopback address but ``toward`` is not: peers on other hosts could not
    reach it (a worker left on the default ``--host 127.0.0.1`` with a remote router)."""
    if given:
        host = given
    elif bind_host not in WILDCARD_HOSTS:
        host = bind_host
    else:
        host = local_address_toward(toward) or socket.gethostname()
    if _is_loopback(host) and not _is_loopback(_host_of(toward) or "localhost"):
        log.warning("advertising %s, a loopback address, to a router at %s: peers on other "
                    "hosts cannot reach it (set --host or --advertise-host)", host, toward)
    return host


def local_address_toward(address: str) -> str | None:
    """This host's source address for packets to ``address`` (``tcp://host:port``), from
    the routing table (a UDP ``connect`` sends nothing); None for ipc/inproc or no route."""
    host, port = _host_of(address), address.rpartition(":")[2]
    if host is None or not port.isdigit():
        return None
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, int(port), type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.connect(sockaddr)
            ip = s.getsockname()[0]
    except OSError:
        return None
    return f"[{ip}]" if ":" in ip else ip


def _host_of(address: str) -> str | None:
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ("tcp", "ucx"):
        return None
    return rest.rpartition(":")[0].strip("[]") or None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (for launchers that assign ports up front)."""
    [port] = free_ports(1, host)
    return port


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out for ``bind(0)`` and ``connect()`` (Linux's default if
    the sysctl cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


# Planned ports come from below the ephemeral range: a port picked up front is free only
# until it is released, and a service that binds port 0 (a decode worker's KV socket) or
# dials out in that gap could otherwise be handed the same port by the kernel.
_PLANNED_LOW = 20000


def free_ports(count: int, host: str = "127.0.0.1", avoid: frozenset[int] = frozenset()) -> list[int]:
    """``count`` distinct ports nothing listens on right now, none of them in ``avoid``,
    and none the kernel would hand out on its own.

    Every socket stays bound until all are picked: a port closed at once may be handed out
    again by the next pick, and two services told the same port collide (an HTTP metrics
    server that won the port would answer another service's ``/health``)."""
    low, _ = ephemeral_range()
    candidates = range(_PLANNED_LOW, low) if low - _PLANNED_LOW >= 1000 else None
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        for _ in range(count * 50):
            if len(ports) == count:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            try:
                s.bind((host, random.choice(candidates) if candidates else 0))
            except OSError:  # taken: try another
                continue
            if (port := s.getsockname()[1]) not in avoid:  # an avoided one stays held, unused
                ports.append(port)
        if len(ports) < count:
            raise OSError(f"no {count} free ports on {host}")
        return ports
    finally:
        for s in held:
            s.close()

"""Socket addresses as peers must dial them."""

from __future__ import annotations

import socket

_WILDCARDS = ("0.0.0.0", "[::]", "*")


def reachable(address: str, host: str) -> str:
    """``tcp://0.0.0.0:7200`` bound here is ``tcp://<host>:7200`` to everyone else."""
    for wildcard in _WILDCARDS:
        address = address.replace(f"//{wildcard}:", f"//{host}:")
    return address


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (for launchers that assign ports up front)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]

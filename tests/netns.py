"""Simulated hosts for multi-host tests: network namespaces on one bridge, shaped links.

``SimulatedHosts`` makes a Linux bridge and, per host, a network namespace joined to it by
a veth pair (``eth0`` inside, ``lo`` up, an address of its own in a /24 of 10.77.0.0/16).
A host's outgoing link may be shaped with ``tc qdisc ... tbf`` to a rate (this kernel has
no ``netem``). The test process stays in the root namespace and reaches every host
through the bridge's own address. Names carry a random tag, so parallel runs never clash,
and ``close`` removes whatever was made, even after a failure halfway through ``add``.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
from dataclasses import dataclass


class NetnsUnavailable(Exception):
    """This machine or user cannot make network namespaces or shape links (skip, not fail)."""


@dataclass(frozen=True, slots=True)
class Host:
    name: str
    netns: str
    ip: str
    rate: str | None  # tbf rate of its outgoing link, e.g. "1gbit"; None: not shaped

    def argv(self, command: list[str]) -> list[str]:
        """``command`` run inside this host's network namespace."""
        return ["ip", "netns", "exec", self.netns, *command]

    def sent_bytes(self) -> int:
        """Bytes the shaped link's qdisc has sent (``tc -s qdisc show dev eth0``)."""
        out = _run(*self.argv(["tc", "-s", "qdisc", "show", "dev", "eth0"]))
        match = re.search(r"Sent (\d+) bytes", out)
        if match is None:
            raise AssertionError(f"no byte counter in tc's output: {out!r}")
        return int(match.group(1))


class SimulatedHosts:
    """A bridge and its hosts; a context manager that removes them all on exit."""

    def __init__(self) -> None:
        reason = unavailable()
        if reason is not None:
            raise NetnsUnavailable(reason)
        self.tag = secrets.token_hex(3)
        self.bridge = f"tnb{self.tag}"
        self.subnet = _free_subnet()
        self.gateway_ip = f"{self.subnet}.1"  # the bridge's: where this process stands
        self.hosts: list[Host] = []
        self._made: list[list[str]] = []  # the commands that undo what was made, newest last
        try:
            self._make(["ip", "link", "add", self.bridge, "type", "bridge"],
                       ["ip", "link", "del", self.bridge])
            _run("ip", "addr", "add", f"{self.gateway_ip}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise

    def add(self, name: str, rate: str | None = None) -> Host:
        """A new host on the bridge, its outgoing link shaped to ``rate`` if given."""
        i = len(self.hosts)
        host = Host(name, f"tandem-{self.tag}-{name}", f"{self.subnet}.{10 + i}", rate)
        veth = f"tnv{self.tag}{i}"
        self._make(["ip", "netns", "add", host.netns], ["ip", "netns", "del", host.netns])
        self._make(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0",
                    "netns", host.netns], ["ip", "link", "del", veth])
        _run("ip", "link", "set", veth, "master", self.bridge, "up")
        inside = ["ip", "-n", host.netns]
        _run(*inside, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        _run(*inside, "link", "set", "eth0", "up")
        _run(*inside, "link", "set", "lo", "up")
        if rate is not None:
            try:
                _run(*host.argv(["tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate",
                                 rate, "burst", _burst(rate), "latency", "100ms"]))
            except RuntimeError as e:
                raise NetnsUnavailable(f"links cannot be shaped here: {e}") from None
        self.hosts.append(host)
        return host

    def close(self) -> None:
        while self._made:
            subprocess.run(self._made.pop(), capture_output=True, check=False)

    def __enter__(self) -> SimulatedHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self, make: list[str], undo: list[str]) -> None:
        _run(*make)
        self._made.append(undo)


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"tandem-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def _free_subnet() -> str:
    """A 10.77.N /24 that no route of this host uses yet (parallel runs pick apart)."""
    routes = _run("ip", "-4", "route", "show")
    for _ in range(64):
        subnet = f"10.77.{secrets.randbelow(256)}"
        if f"{subnet}." not in routes:
            return subnet
    raise NetnsUnavailable("no free 10.77.N.0/24 subnet")


def _burst(rate: str) -> str:
    """A bucket of 2 ms at ``rate`` (at least 64 KiB): enough for the rate to be reached,
    small enough that a transfer of a few MB is paced by the rate, not the burst."""
    match = re.fullmatch(r"(\d+)([kmg])bit", rate)
    if match is None:
        raise ValueError(f"rate {rate!r}: use e.g. 1gbit, 500mbit")
    bits = int(match.group(1)) * {"k": 10**3, "m": 10**6, "g": 10**9}[match.group(2)]
    return str(max(64 << 10, bits // 8 // 500))


def _run(*argv: str) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout

"""A real local cluster for end-to-end tests: the same launcher as ``tandem up``.

Every service is its own process on loopback; ``Cluster`` starts them through
``services.launcher`` (so the launcher is tested too), waits until all report healthy,
and stops them all on exit.
"""

from __future__ import annotations

import re
import threading
import urllib.request
from dataclasses import dataclass

from cli.main import build_parser
from common.addresses import free_port
from services import launcher


@dataclass
class Cluster:
    model: str
    prefill: int = 1
    decode: int = 1
    colocated: int = 0
    policy: str = "prefix"
    kv_transport: str = "zmq"
    extra: tuple[str, ...] = ("--num-kv-blocks", "512")

    def __enter__(self) -> Cluster:
        self.port = free_port()
        argv = ["up", "--model", self.model, "--port", str(self.port), "--policy", self.policy,
                "--prefill", str(self.prefill), "--decode", str(self.decode),
                "--colocated", str(self.colocated), "--kv-transport", self.kv_transport,
                "--threads", "1", *self.extra]
        args = build_parser().parse_args(argv)
        defaults = vars(launcher._defaults_parser().parse_args([]))
        self.children = launcher.plan(args, launcher.engine_argv(args, defaults))
        try:
            for child in self.children:
                launcher._spawn(child)
            if not launcher._wait_healthy(self.children, threading.Event(), timeout=240):
                raise RuntimeError("cluster did not become healthy:\n" + self.logs())
        except BaseException:
            launcher._shutdown(self.children)
            raise
        return self

    def __exit__(self, *exc) -> None:
        launcher._shutdown(self.children)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def workers(self, role: str | None = None) -> list[launcher.Child]:
        names = ("prefill", "decode", "worker") if role is None else (role,)
        return [c for c in self.children if c.name.split("-")[0] in names]

    def metric(self, child: launcher.Child, name: str) -> float:
        """Sum of a metric's samples (all label sets) on one service."""
        url = child.health_url.replace("/health", "/metrics")
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", re.M)
        return sum(float(v) for v in pattern.findall(text))

    def logs(self) -> str:
        return "\n".join(f"[{c.name}] {line}" for c in self.children for line in c.tail)

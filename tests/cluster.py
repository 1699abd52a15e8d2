"""A real local cluster for end-to-end tests: the same launcher as ``tandem up``.

Every service is its own process on loopback; ``Cluster`` plans and starts them through
``services.launcher`` (so the launcher is tested too), waits until all report healthy,
and stops them all on exit.
"""

from __future__ import annotations

import json
import re
import urllib.request
from dataclasses import dataclass

from common.addresses import free_port
from services import launcher
from services.cli import build_parser


class MissingMetricError(AssertionError):
    """A metric a test reads is not on the page: renamed or never registered."""


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
        self.local = launcher.LocalCluster(launcher.plan(build_parser().parse_args(argv)))
        try:
            self.local.start(timeout=240)
        except launcher.StartupError as e:
            raise RuntimeError(f"cluster did not become healthy: {e}\n{self.logs()}") from e
        return self

    def __exit__(self, *exc) -> None:
        self.local.stop()

    @property
    def children(self) -> list[launcher.Child]:
        return self.local.children

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def router(self) -> launcher.Child:
        [router] = [c for c in self.children if c.name == "router"]
        return router

    def workers(self, role: str | None = None) -> list[launcher.Child]:
        names = ("prefill", "decode", "worker") if role is None else (role,)
        return [c for c in self.children if c.name.split("-")[0] in names]

    def metric(self, child: launcher.Child, name: str, **labels: str) -> float:
        """Sum of a metric's samples on one service (those with ``labels``, if given).
        Raises ``MissingMetricError`` when the page has no such metric at all, so a renamed
        metric fails the test instead of reading as zero."""
        url = child.health_url.replace("/health", "/metrics")
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        family = name.removesuffix("_total")
        if not re.search(rf"^# TYPE {re.escape(family)} ", text, re.M):
            raise MissingMetricError(f"{child.name} exports no metric {name}")
        pattern = re.compile(rf"^{re.escape(name)}(?:{{([^}}]*)}})? ([0-9.eE+-]+|NaN)$", re.M)
        wanted = {f'{k}="{v}"' for k, v in labels.items()}
        return sum(float(value) for label_text, value in pattern.findall(text)
                   if wanted <= set(label_text.split(",")) - {""})

    def health(self, child: launcher.Child) -> dict:
        with urllib.request.urlopen(child.health_url, timeout=5) as r:
            return json.loads(r.read())

    def logs(self) -> str:
        return "\n".join(f"[{c.name}] {line}" for c in self.children for line in c.tail)

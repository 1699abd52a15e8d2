"""What ``tandem bench router`` reads off the router and the load processes: the router's
Prometheus text (its per-message histogram and index gauge) and CPU seconds per process."""

from __future__ import annotations

import math
import os
import urllib.request
from dataclasses import dataclass

MESSAGE_SECONDS = "tandem:router_message_seconds"


@dataclass(frozen=True, slots=True)
class Histogram:
    buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count)
    count: float
    total: float  # seconds

    def mean_us(self) -> float | None:
        return self.total / self.count * 1e6 if self.count else None

    def quantile_us(self, q: float) -> float | None:
        """The upper bound of the bucket holding the ``q`` quantile (None without samples)."""
        if not self.count:
            return None
        for bound, cumulative in self.buckets:
            if cumulative >= q * self.count:
                return bound * 1e6
        return math.inf


@dataclass(frozen=True, slots=True)
class Scrape:
    samples: dict[str, float]  # "name{labels}" -> value, as the text exposition has them

    def gauge(self, name: str) -> int | None:
        value = self.samples.get(name)
        return None if value is None else int(value)

    def histogram(self, message: str) -> Histogram:
        label = f'message="{message}"'
        buckets = []
        for key, value in self.samples.items():
            if key.startswith(f"{MESSAGE_SECONDS}_bucket{{") and label in key:
                le = key.split('le="', 1)[1].split('"', 1)[0]
                buckets.append((float(le), value))
        get = lambda suffix: self.samples.get(f"{MESSAGE_SECONDS}_{suffix}{{{label}}}", 0.0)  # noqa: E731
        return Histogram(tuple(sorted(buckets)), get("count"), get("sum"))

    def histogram_delta(self, before: Scrape, message: str) -> Histogram:
        a, b = self.histogram(message), before.histogram(message)
        old = dict(b.buckets)
        return Histogram(tuple((le, c - old.get(le, 0.0)) for le, c in a.buckets),
                         a.count - b.count, a.total - b.total)


def scrape(url: str) -> Scrape:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return Scrape(samples)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (0 for one that is gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total

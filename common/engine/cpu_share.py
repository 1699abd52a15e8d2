"""How many threads a step may use when other processes share this host's CPUs.

A prefill and a decode worker on one 2-CPU host either pin one CPU each (``--cpu-affinity``:
no interference, but a decode alone on the host still runs on one CPU) or share both. Sharing
with a fixed thread count is the worst of both: when the other worker is busy, a step's
OpenMP team waits at every barrier for the thread that lost its CPU. ``CpuShare`` lets a
worker use every CPU it may run on, but only as many threads per step as the *other*
processes leave idle, measured from ``/proc/stat`` over the last ``interval_s``:

    others = (busy CPU time on our CPUs - our own CPU time) / wall time      (in CPUs)
    threads = clamp(round_down(cpus - others + slack), 1, max_threads)

``slack`` (0.25) makes a neighbour that is busy most of the time count as a whole CPU,
while a gateway's few percent do not cost a thread. Our own threads, spinning or working,
are never counted against us. The decision is re-made at most every ``interval_s`` (the
kernel's CPU counters tick at 100 Hz, so shorter windows are noise).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (idle, iowait not)


def busy_seconds(stat_text: str, cpus: Sequence[int], ticks_per_s: float) -> float:
    """CPU seconds spent busy, since boot, on ``cpus``, from the text of ``/proc/stat``."""
    wanted = {f"cpu{c}" for c in cpus}
    total = 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if name in wanted:
            values = rest.split()
            total += sum(int(values[i]) for i in _BUSY_FIELDS if i < len(values))
    return total / ticks_per_s


def _read_stat() -> str:
    with open("/proc/stat") as f:
        return f.read()


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


class CpuShare:
    """The thread count for the next step; call ``threads()`` before each one."""

    def __init__(self, cpus: Sequence[int], max_threads: int, interval_s: float = 0.1,
                 slack: float = 0.25, *, clock: Callable[[], float] = time.monotonic,
                 read_stat: Callable[[], str] = _read_stat,
                 own_cpu: Callable[[], float] = _own_cpu_seconds,
                 ticks_per_s: float | None = None) -> None:
        if max_threads < 1 or not cpus:
            raise ValueError("CpuShare needs at least one CPU and one thread")
        self.cpus = list(cpus)
        self.max_threads = max_threads
        self.interval_s = interval_s
        self.slack = slack
        self._clock, self._read_stat, self._own_cpu = clock, read_stat, own_cpu
        self._ticks = ticks_per_s or float(os.sysconf("SC_CLK_TCK"))
        self._current = max_threads
        self._last = self._sample()
        self.others = 0.0  # CPUs the other processes kept busy over the last window

    def _sample(self) -> tuple[float, float, float]:
        busy = busy_seconds(self._read_stat(), self.cpus, self._ticks)
        return self._clock(), busy, self._own_cpu()

    def threads(self) -> int:
        now = self._clock()
        if now - self._last[0] < self.interval_s:
            return self._current
        sample = self._sample()
        (t0, busy0, own0), (t1, busy1, own1) = self._last, sample
        self._last = sample
        wall = t1 - t0
        self.others = max(0.0, ((busy1 - busy0) - (own1 - own0)) / wall) if wall > 0 else 0.0
        free = len(self.cpus) - self.others + self.slack
        self._current = max(1, min(self.max_threads, int(free)))
        return self._current

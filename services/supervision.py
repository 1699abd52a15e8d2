"""Supervision for ``tandem up``: a child that dies after the cluster is up is restarted
with the same command line (same worker id, same ports) after a backoff; one dead child
never stops the others. A child asked to exit (``LocalCluster.drain``, as a rolling
restart does) did not crash: it is left to whoever asked.

Two pieces: ``RestartPolicy``, the backoff table (time and counts only, clock injected, so
its sequence is tested in-process), and ``Supervisor``, the loop that watches a started
``LocalCluster``, asks the policy how long to wait, restarts and reports. A crash during
startup is not its business: ``LocalCluster.start`` turns it into ``StartupError``, except
a child killed by a signal there, which it starts again (twice at most).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the launcher imports this module; the cluster is only a parameter here
    from services.launcher import Child, LocalCluster


@dataclass(frozen=True, slots=True)
class Restart:
    delay: float  # seconds to wait before starting the child again
    count: int  # restarts of this child so far, this one included


class RestartPolicy:
    """Exponential backoff per child: ``first`` seconds after an exit, doubling with each
    exit up to ``longest``. A child that stayed healthy for ``reset_after`` seconds since it
    last answered healthy starts again from ``first`` on its next exit, so a crash loop
    backs off while an occasional crash is restarted at once."""

    def __init__(self, first: float = 0.5, longest: float = 10.0, reset_after: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < first <= longest or reset_after <= 0:
            raise ValueError("need 0 < first <= longest and reset_after > 0")
        self.first, self.longest, self.reset_after = first, longest, reset_after
        self.clock = clock  # public: the supervisor times its restarts by the same clock
        self._streak: dict[str, int] = {}  # exits since the last long-enough healthy period
        self._count: dict[str, int] = {}
        self._healthy_since: dict[str, float] = {}

    def restarts(self, name: str) -> int:
        """How many times the child was restarted after an exit of its own."""
        return self._count.get(name, 0)

    def healthy(self, name: str) -> None:
        """The child answered healthy (after its start or restart); only the first report counts."""
        self._healthy_since.setdefault(name, self.clock())

    def exited(self, name: str) -> Restart:
        """The child exited: how long to wait, and which restart this is."""
        since = self._healthy_since.pop(name, None)
        if since is not None and self.clock() - since >= self.reset_after:
            self._streak[name] = 0
        streak = self._streak.get(name, 0)
        self._streak[name] = streak + 1
        self._count[name] = self._count.get(name, 0) + 1
        return Restart(min(self.first * 2 ** streak, self.longest), self._count[name])


class Supervisor:
    """Watches the children of a cluster whose ``start`` has returned (all healthy): an
    exited child is restarted after the policy's delay, and reported healthy again once its
    health URL answers. Stops acting as soon as the cluster is stopping.

    ``run(stop)`` blocks (``tandem up`` calls it from its main thread); ``start`` / ``close``
    run it on a thread of its own (the tests). Children restarted from that thread die with
    it (``PR_SET_PDEATHSIG`` follows the spawning thread), so close it only after the
    cluster has stopped."""

    def __init__(self, cluster: LocalCluster, policy: RestartPolicy | None = None,
                 interval: float = 0.25) -> None:
        self.cluster = cluster
        self.policy = policy or RestartPolicy()
        self.interval = interval
        self._due: dict[str, float] = {}  # child name -> when to restart it
        self._recovering: set[str] = set()  # restarted, not yet healthy
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        for child in cluster.children:
            self.policy.healthy(child.name)

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.interval) and not self.cluster.stopping:
            self.tick()

    def tick(self) -> None:
        """One look at every child: schedule, restart, or confirm health."""
        for child in self.cluster.children:
            if self.cluster.stopping:
                return
            if child.name in self.cluster.retiring:
                continue  # asked to exit (a drain): whoever asked starts it again
            if child.name in self._due:
                self._restart_when_due(child)
            elif child.proc is not None and child.proc.poll() is not None:
                self._schedule(child)
            elif child.name in self._recovering and self.cluster.healthy(child):
                self._recovering.discard(child.name)
                self.policy.healthy(child.name)
                self.cluster.log(f"{child.name} is healthy again")

    def _schedule(self, child: Child) -> None:
        restart = self.policy.exited(child.name)
        self._due[child.name] = self.policy.clock() + restart.delay
        self._recovering.discard(child.name)
        self.cluster.log(f"{child.name} exited with status {child.proc.returncode}: "
                         f"restarting in {restart.delay:g} s (restart {restart.count})")

    def _restart_when_due(self, child: Child) -> None:
        if self.policy.clock() < self._due[child.name]:
            return
        del self._due[child.name]
        if self.cluster.respawn(child):
            self._recovering.add(child.name)

    def start(self) -> Supervisor:
        self._thread = threading.Thread(target=self.run, args=(self._stop,), daemon=True,
                                        name="supervisor")
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

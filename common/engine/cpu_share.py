"""How many threads a step may use when other workers share this host's CPUs.

A prefill and a decode worker on one 2-CPU host either pin one CPU each (``--cpu-affinity``:
no interference, but a decode alone on the host still runs on one CPU) or share both. Sharing
with a fixed thread count is the worst of both: when the other worker is busy, a step's
OpenMP team waits at every barrier for the thread that lost its CPU. ``CpuShare`` lets a
worker use every CPU it may run on, but only as many threads per step as the *other workers*
on those CPUs leave free right now:

    threads = clamp(len(cpus) - threads the others' steps use - threads they wait for,
                    1, max_threads)

Each worker says what it uses on a ``ThreadBoard``: a directory of one small shared-memory
file per process (``/dev/shm/tandem-cpus-<uid>`` by default, ``$TANDEM_CPU_BOARD`` to move
it), holding the thread count of the step it is running (0 while it has nothing to compute)
and the CPUs it may run on. A worker writes its count before each step and reads the others'
in the same breath, so a prefill worker that starts a long prompt costs the decode worker a
thread at the decode worker's next step, not a measuring window later, and gives it back the
moment it finishes. Only workers count: a gateway's or router's scattered load does not cost
a thread (with a fixed two threads, c16 ran faster than when that load was counted from
``/proc/stat``, which is what this module did before).

A worker killed mid-step leaves its file behind: each owner holds an exclusive ``flock`` on
its file for its lifetime, the kernel drops it with the process, and a reader that can take
the lock (it looks again every ``relist_s``) deletes the file. Workers that do not share a
``/dev/shm`` (other hosts, other containers) do not see each other: containers that share
a host's CPUs need CPU limits or ``--cpu-affinity`` instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import mmap
import os
import struct
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

# A board file: int32 threads in use now, int32 threads wanted (waiting for a CPU), int32
# the number of CPUs that follow, then each CPU's number as an int32 (written once).
_HEADER = struct.Struct("=iii")
WAIT_POLL_S = 0.0005  # how often a step waiting for a CPU reads the board
_serial = itertools.count()  # tests run several engines in one process


def default_board_dir() -> Path:
    root = os.environ.get("TANDEM_CPU_BOARD")
    if root:
        return Path(root)
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"tandem-cpus-{os.getuid()}"


class _Entry:
    """One other worker's file, mapped: its CPUs (fixed) and its live thread count."""

    def __init__(self, path: Path, ours: frozenset[int]) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        _, _, count = _HEADER.unpack_from(self._map, 0)
        if count < 0 or _HEADER.size + 4 * count > len(self._map):
            self._map.close()
            raise ValueError(f"{path}: not a board file")
        self.cpus = frozenset(struct.unpack_from(f"={count}i", self._map, _HEADER.size))
        self.shared = len(self.cpus & ours)  # of our CPUs, how many it may run on too
        self._view = memoryview(self._map)[:8].cast("i")

    @property
    def threads(self) -> int:
        return self._view[0]

    @property
    def wanted(self) -> int:
        return self._view[1]

    def close(self) -> None:
        self._view.release()
        self._map.close()


class ThreadBoard:
    """This process's entry on the board, and a view of everyone else's."""

    def __init__(self, cpus: Sequence[int], directory: Path | None = None,
                 relist_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = directory or default_board_dir()
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.cpus = frozenset(cpus)
        self.relist_s, self._clock = relist_s, clock
        self.path = self.directory / f"{os.getpid()}.{next(_serial)}"
        self._fd, self._map = self._publish(sorted(self.cpus))
        self._mine = memoryview(self._map)[:8].cast("i")
        # Our file goes when we are collected or the interpreter exits (a killed worker's
        # goes when a reader finds it unlocked).
        self._finalizer = weakref.finalize(self, _withdraw, self.path, self._fd, self._map, self._mine)
        self._others: dict[str, _Entry] = {}
        self._listed = -float("inf")

    def _publish(self, cpus: list[int]) -> tuple[int, mmap.mmap]:
        # Made under a temporary name and locked before it gets its real one, so no reader
        # ever finds it unlocked (which would mean its owner is dead).
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".new-")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, _HEADER.pack(0, 0, len(cpus)) + struct.pack(f"={len(cpus)}i", *cpus))
            mapped = mmap.mmap(fd, 0)
            os.replace(tmp, self.path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return fd, mapped

    def set(self, threads: int, wanted: int = 0) -> None:
        self._mine[1] = wanted
        self._mine[0] = threads

    def others(self) -> tuple[int, int]:
        """Threads the other workers' steps use on our CPUs now, and threads they wait for."""
        if self._clock() - self._listed >= self.relist_s:
            self._relist()
        used = wanted = 0
        for entry in self._others.values():
            used += min(entry.threads, entry.shared)
            wanted += min(entry.wanted, entry.shared)
        return used, wanted

    def _relist(self) -> None:
        self._listed = self._clock()
        try:
            names = {n for n in os.listdir(self.directory)
                     if not n.startswith(".") and n != self.path.name}
        except OSError:
            names = set()
        for name in list(self._others):
            if name not in names:
                self._others.pop(name).close()
        for name in names:
            if _owner_gone(self.directory / name):
                entry = self._others.pop(name, None)
                if entry is not None:
                    entry.close()
            elif name not in self._others:
                with contextlib.suppress(OSError, ValueError):
                    self._others[name] = _Entry(self.directory / name, self.cpus)

    def close(self) -> None:
        for entry in self._others.values():
            entry.close()
        self._others.clear()
        self._finalizer()


def _withdraw(path: Path, fd: int, mapped: mmap.mmap, mine: memoryview) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
    mine.release()
    mapped.close()
    os.close(fd)


def _owner_gone(path: Path) -> bool:
    """Whether the process that wrote ``path`` has died (its lock went with it); if so the
    file is deleted."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # held: alive
    except OSError:
        return True
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return True
    finally:
        os.close(fd)


class CpuShare:
    """The thread count for the next step: call ``threads()`` before each step that
    computes, and ``rest()`` whenever there is nothing to compute.

    A step that may wait (the engine lets a prefill worker's) and finds every CPU taken
    waits, at most ``wait_s``, with its want on the board instead of starting on a busy
    CPU: the others leave it one at their next step. A step that may not (one that
    decodes, or prefills a prompt whose tokens it will stream) starts at once on at least
    one thread, and a waiting step's CPUs make room for it at their next step. Two OpenMP
    teams on more threads than CPUs stall each other at every barrier: at c16 with a
    prefill and a decode worker on two vCPUs, the prefill worker's steps not waiting cost
    about 15% of the output tokens/s; the decode worker's first steps waiting cost the
    ``mixed`` workload's TPOT p99 a fifth."""

    def __init__(self, cpus: Sequence[int], max_threads: int, board: ThreadBoard | None = None,
                 wait_s: float = 0.2, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if max_threads < 1 or not cpus:
            raise ValueError("CpuShare needs at least one CPU and one thread")
        self.cpus = list(cpus)
        self.max_threads = max_threads
        self.board = board or ThreadBoard(self.cpus)
        self.wait_s, self._clock, self._sleep = wait_s, clock, sleep
        self.others = 0  # threads the other workers were using at the last decision
        self.waited_s = 0.0  # in all, for a free CPU

    def threads(self, may_wait: bool = False) -> int:
        used, wanted = self.board.others()
        if may_wait and used >= len(self.cpus) and self.wait_s > 0:
            used = self._wait_for_a_cpu()
            wanted = 0  # whoever else waits, we came first
        self.others = used
        n = max(1, min(self.max_threads, len(self.cpus) - used - wanted))
        self.board.set(n)
        return n

    def _wait_for_a_cpu(self) -> int:
        start = self._clock()
        self.board.set(0, wanted=1)
        used, _ = self.board.others()
        while used >= len(self.cpus) and self._clock() - start < self.wait_s:
            self._sleep(WAIT_POLL_S)
            used, _ = self.board.others()
        self.waited_s += self._clock() - start
        return used

    def rest(self) -> None:
        self.board.set(0)

    def close(self) -> None:
        self.board.close()

"""Where a UCX transfer's blocks land: buffers reused once nothing references them.

Why: fresh memory costs a page fault and a page of zeroes per 4 KiB at its first write.
92 MB transfers (125 blocks), sender and receiver processes alone, in turns on machine F:
3.07-3.17 GB/s into fresh buffers, 3.36-3.51 into reused ones (1.06-1.14x).

(Sending a run of blocks that lie back to back in the sender's cache as one message was
tried too: no faster, and both processes spent more CPU time in the kernel's copy.)
"""

from __future__ import annotations

import threading
import weakref
from collections import deque

import numpy as np

# Idle buffers kept for reuse; past this, a returned one is freed. The blocks of two
# 92 MB transfers (a 2,000-token SmolLM2 prompt in fp32) fit.
IDLE_BYTES_MAX = 256 << 20


class ReceiveBuffers:
    """Byte buffers handed out by ``take`` and reused after the last view of one dies.

    Safe from any thread: the buffer returns from whichever thread drops the last
    reference (a weakref finalizer on the array ``take`` returned). Views of it must be
    memoryviews of that array (a numpy slice would reference the hidden backing array
    instead and let the buffer return while the slice is still alive). A finalizer never
    waits for the lock: the garbage collector may run one on a thread that holds it
    (inside ``take``), so a buffer that finds the lock busy waits in ``_returned`` for
    the next ``take``.
    """

    def __init__(self, idle_bytes_max: int = IDLE_BYTES_MAX) -> None:
        self.idle_bytes_max = idle_bytes_max
        self._lock = threading.Lock()
        self._idle: dict[int, list[np.ndarray]] = {}  # by size
        self._idle_bytes = 0
        self._returned: deque[np.ndarray] = deque()  # given back while the lock was busy

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            self._collect()
            return self._idle_bytes

    def take(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of uninitialised memory, from the smallest idle buffer that fits."""
        with self._lock:
            self._collect()
            size = min((s for s in self._idle if s >= nbytes), default=None)
            backing = None if size is None else self._idle[size].pop()
            if size is not None:
                self._idle_bytes -= size
                if not self._idle[size]:
                    del self._idle[size]
        if backing is None:
            backing = np.empty(nbytes, dtype=np.uint8)
        handed = backing[:nbytes]  # a distinct array object: its death returns the backing
        weakref.finalize(handed, self._give_back, backing)
        return handed

    def _give_back(self, backing: np.ndarray) -> None:
        if not self._lock.acquire(blocking=False):
            self._returned.append(backing)  # deque.append: atomic, no lock
            return
        try:
            self._keep(backing)
        finally:
            self._lock.release()

    def _collect(self) -> None:
        """Under the lock: the buffers given back while it was busy."""
        while self._returned:
            self._keep(self._returned.popleft())

    def _keep(self, backing: np.ndarray) -> None:
        """Under the lock: ``backing`` idle for reuse, or freed past the cap."""
        if self._idle_bytes + backing.nbytes <= self.idle_bytes_max:
            self._idle.setdefault(backing.nbytes, []).append(backing)
            self._idle_bytes += backing.nbytes

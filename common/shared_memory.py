"""Same-host shared memory for KV blocks: the owner's segment and the peers' mappings.

A prefill worker allocates its KV cache in one ``SharedSegment``: an anonymous memfd
(never a named file, so nothing can leak into /dev/shm — the memory goes when the owner
and every mapping are gone, SIGKILL included). A decode worker on the same host maps it
read-only through ``/proc/<pid>/fd/<fd>`` (``PeerSegments``), once per segment, and copies
blocks straight out of it: the transfer's one copy.

What keeps a peer from reading the wrong memory:
- ``host_identity()`` (boot id + pid, time and network namespaces) must match: the pid
  names the same process and both ends read the same monotonic clock (the loan's
  deadline); and a process in another network namespace (another container or pod, or a
  host simulated with ``ip netns``) is another host, whose KV travels over its network
  even where /proc would let it map the segment;
- the segment's first bytes hold a magic and a random 16-byte token the owner also sends
  in every ``ShmSegmentRef``: a restarted owner (new token), a reused pid or another
  container's /proc never passes for the old segment; the size must match too.

A peer that cannot map a segment raises ``ShmUnavailable`` (the receiver nacks, the sender
falls back to frames). Huge pages: an ``MFD_HUGETLB`` segment where hugetlbfs pages are
reserved, else ``MADV_HUGEPAGE`` on a normal one, which only takes where
/sys/kernel/mm/transparent_hugepage/shmem_enabled allows (``advise``/``always``); with
``never`` the cache is on 4 KiB pages (``SharedSegment.huge`` says which).
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from common.protocol import ShmSegmentRef

if TYPE_CHECKING:
    import torch

log = logging.getLogger("tandem.shm")

HUGE_PAGE = 2 << 20
HEADER_BYTES = HUGE_PAGE  # magic + token; the payload starts on a huge-page boundary
MAGIC = b"TANDEMKV"
TOKEN_BYTES = 16
MEMFD_NAME = "tandem-kv"  # how the segment shows in /proc/<pid>/maps: /memfd:tandem-kv
SWEEP_INTERVAL_S = 1.0  # how often a peer looks for mappings whose owner has gone


class ShmUnavailable(Exception):
    """This process cannot map a peer's segment (another host, container or user)."""


def host_identity() -> str:
    """Equal for two processes exactly when a pid and a monotonic time mean the same to both
    and they share a network namespace (the network is what tells one host from another)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    spaces = [f"{ns}:{os.stat(f'/proc/self/ns/{ns}').st_ino}" for ns in ("pid", "time", "net")
              if os.path.exists(f"/proc/self/ns/{ns}")]
    return ",".join([boot, *spaces])


def shared_memory_supported() -> bool:
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


class SharedSegment:
    """The owner's side: ``nbytes`` of zeroed shared memory, mapped read-write, kept for the
    life of the process (its fd stays open: peers open it through /proc)."""

    def __init__(self, nbytes: int) -> None:
        if nbytes < 1:
            raise ValueError(f"a shared segment needs a positive size, got {nbytes}")
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.payload_nbytes = nbytes
        self.fd, self.huge = _memfd(HEADER_BYTES + nbytes)
        self.nbytes = os.fstat(self.fd).st_size
        self._map = mmap.mmap(self.fd, self.nbytes)
        if not self.huge and hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE, HEADER_BYTES, self.nbytes - HEADER_BYTES)
        self._map[: len(MAGIC) + TOKEN_BYTES] = MAGIC + self.token
        self.base = np.frombuffer(self._map, np.uint8).ctypes.data
        self.ref = ShmSegmentRef(host_identity(), os.getpid(), self.fd, self.nbytes, self.token)

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The payload as a tensor (zeros: a fresh memfd reads as zeros)."""
        import torch  # here: a receiver (and the router's imports) need no torch

        element = torch.empty((), dtype=dtype).element_size()
        count = self.payload_nbytes // element
        flat = torch.frombuffer(self._map, dtype=dtype, offset=HEADER_BYTES, count=count)
        return flat.view(shape)

    def offset_of(self, view: memoryview, nbytes: int) -> int | None:
        """Where ``view`` (``nbytes`` long) starts in the segment, or None if it is not inside."""
        offset = np.frombuffer(view, np.uint8).ctypes.data - self.base
        if offset >= HEADER_BYTES and offset + nbytes <= self.nbytes:
            return offset
        return None


def _memfd(nbytes: int) -> tuple[int, bool]:
    """A memfd of at least ``nbytes``, every page reserved now (so a full tmpfs fails here, not
    as SIGBUS mid-run): on hugetlbfs pages where some are reserved, else normal ones."""
    if hasattr(os, "MFD_HUGETLB"):
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_HUGETLB)
        try:
            size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            return fd, True
        except OSError:  # no hugetlbfs pages reserved (nr_hugepages = 0): normal pages
            os.close(fd)
    fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.close(fd)
        raise
    return fd, False


@dataclass(slots=True)
class _Mapping:
    ref: ShmSegmentRef
    map: mmap.mmap
    file_id: tuple[int, int]  # (st_dev, st_ino) of the memfd, to tell a reused /proc path


class PeerSegments:
    """A peer's read-only mappings of other processes' segments, each mapped once.

    ``blocks`` hands out read-only views into a mapping; a mapping whose owner has gone is
    unmapped by ``sweep`` once no view of it is alive (so a dead owner's memory is freed).
    """

    def __init__(self) -> None:
        self._identity = host_identity()
        self._maps: dict[tuple[int, int, bytes], _Mapping] = {}
        self._next_sweep = 0.0

    def __len__(self) -> int:
        return len(self._maps)

    def blocks(self, ref: ShmSegmentRef, offsets: list[int], nbytes: int) -> list[memoryview]:
        """Views of ``nbytes`` at each offset; ``ShmUnavailable`` when the segment cannot be
        mapped here, ``ValueError`` when an offset lies outside it."""
        view = memoryview(self._mapping(ref).map).toreadonly()
        bad = next((o for o in offsets if o < HEADER_BYTES or o + nbytes > ref.nbytes), None)
        if bad is not None:
            raise ValueError(f"block at offset {bad} (+{nbytes}) lies outside the segment of {ref.nbytes}")
        return [view[o : o + nbytes] for o in offsets]

    def sweep(self, force: bool = False) -> None:
        """Unmap segments whose owner has exited (at most every ``SWEEP_INTERVAL_S``)."""
        now = time.monotonic()
        if not force and now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_INTERVAL_S
        for key, m in list(self._maps.items()):
            if _file_id(m.ref) != m.file_id and _unmap(m):
                del self._maps[key]
                log.info("unmapped the KV segment of pid %d: its owner has gone", m.ref.pid)

    def close(self) -> None:
        for m in self._maps.values():
            _unmap(m)
        self._maps.clear()

    def _mapping(self, ref: ShmSegmentRef) -> _Mapping:
        key = (ref.pid, ref.fd, ref.token)
        m = self._maps.get(key)
        if m is None:
            m = self._maps[key] = self._map(ref)
            log.info("mapped the KV segment of pid %d (%d MB) read-only", ref.pid, ref.nbytes // 10**6)
        return m

    def _map(self, ref: ShmSegmentRef) -> _Mapping:
        if ref.host != self._identity:
            raise ShmUnavailable(f"the segment is on another host or namespace ({ref.host}; "
                                 f"here {self._identity})")
        try:
            fd = os.open(f"/proc/{ref.pid}/fd/{ref.fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise ShmUnavailable(f"cannot open the segment of pid {ref.pid}: {e}") from None
        try:
            st = os.fstat(fd)
            if st.st_size != ref.nbytes:
                raise ShmUnavailable(f"segment of pid {ref.pid} has {st.st_size} bytes, expected {ref.nbytes}")
            # Mapped lazily: pages come in as transfers read them (a fault per 4 KiB: 92 MB copied
            # in 85 ms the first time, 10 ms after), never all at once. MAP_POPULATE mapped a prefill
            # worker's whole cache (2 GB) on the decode worker's first transfer from it, holding
            # the interpreter lock throughout: 5-9 s on a Zen 3 VM, every request on the worker
            # stalled and its heartbeats missed, so the router declared it dead.
            m = mmap.mmap(fd, ref.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        if m[: len(MAGIC) + TOKEN_BYTES] != MAGIC + ref.token:
            m.close()
            raise ShmUnavailable(f"/proc/{ref.pid}/fd/{ref.fd} is not the segment announced "
                                 "(its owner restarted, or a pid of another namespace)")
        return _Mapping(ref, m, (st.st_dev, st.st_ino))


def _file_id(ref: ShmSegmentRef) -> tuple[int, int] | None:
    try:
        st = os.stat(f"/proc/{ref.pid}/fd/{ref.fd}")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _unmap(m: _Mapping) -> bool:
    try:
        m.map.close()
    except BufferError:  # a transfer's views are still alive: the next sweep tries again
        return False
    return True

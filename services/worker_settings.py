"""A worker's settings: one frozen record that validates itself, and the startup checks
that need what the settings alone cannot know (the transport's frame timeout)."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.connector import KVTransport, SharedKV, ShmMode
from common.connector.faults import FaultPlan
from common.roles import WorkerRole

if TYPE_CHECKING:
    from common.shared_memory import SharedSegment

log = logging.getLogger("tandem.worker")


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    role: WorkerRole
    router: str
    worker_id: str = field(default_factory=lambda: f"worker-{uuid.uuid4().hex[:8]}")
    kv_transport: KVTransport = KVTransport.ZMQ
    kv_bind: str | None = None  # decode/colocated: where the KV receiver binds
    kv_shm: ShmMode = ShmMode.AUTO  # KV through same-host shared memory (zmq transport only)
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    advertise_host: str = "127.0.0.1"
    lease_seconds: float = 40.0  # unacked this long, a shipped request's blocks are freed (> the
    # transport's frame timeout, 30 s for UCX, so a slow transfer is never freed mid-send)
    heartbeat_interval: float = 0.25
    drain_timeout: float = 30.0  # SIGTERM: seconds to finish in-flight work before handing it over
    kv_transfer_attempts: int = 2  # a failed transfer goes once more, same blocks, new id
    kv_stream_chunks: bool = True  # prefill: ship each chunk's computed blocks while the next
    # chunk computes (a prompt of one chunk goes in one transfer either way)
    kv_faults: FaultPlan | str | None = None  # TEST ONLY: injected transfer faults (a spec string
    # is parsed: see common.connector.faults); None, the default, injects nothing

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", WorkerRole(self.role))
        object.__setattr__(self, "kv_transport", KVTransport(self.kv_transport))
        object.__setattr__(self, "kv_shm", ShmMode(self.kv_shm))
        if self.kv_shm is ShmMode.ON and self.kv_transport is not KVTransport.ZMQ:
            raise ValueError("--kv-shm on needs --kv-transport zmq")
        if isinstance(self.kv_faults, str):
            object.__setattr__(self, "kv_faults", FaultPlan.parse(self.kv_faults))
        if self.lease_seconds <= 0 or self.heartbeat_interval <= 0:
            raise ValueError("lease_seconds and heartbeat_interval must be > 0")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout:g}")
        if self.kv_transfer_attempts < 1:
            raise ValueError(f"kv_transfer_attempts must be >= 1, got {self.kv_transfer_attempts}")
        if self.kv_faults is not None and self.kv_faults.delays and self.kv_faults.delay_s >= self.lease_seconds:
            # a copy still on its way when the lease ends would be sent again: twice at decode
            raise ValueError(f"KV fault delay {self.kv_faults.delay_s:g} s must be shorter than "
                             f"the lease of {self.lease_seconds:g} s")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port {self.metrics_port} is not a port")


    @property
    def shares_kv_cache(self) -> bool:
        """Whether this worker's KV cache goes in shared memory: a prefill worker's that
        may lend blocks to same-host decode workers."""
        return (self.role is WorkerRole.PREFILL and self.kv_shm is not ShmMode.OFF
                and self.kv_transport is KVTransport.ZMQ)

    @property
    def maps_peer_kv(self) -> bool:
        """Whether this worker's KV receiver takes blocks from same-host senders' memory."""
        return self.kv_shm is not ShmMode.OFF and self.kv_transport is KVTransport.ZMQ


def shared_kv(settings: WorkerSettings, segment: SharedSegment | None) -> SharedKV | None:
    """What the sender lends blocks from, or None for frames only. ``--kv-shm on`` without a
    shared cache (a CUDA cache, or the engine built without ``shared_memory``) is refused."""
    if not settings.shares_kv_cache:
        return None
    if segment is None:
        if settings.kv_shm is ShmMode.ON:
            raise ValueError("--kv-shm on needs the KV cache in shared memory (a CPU cache)")
        return None
    return SharedKV(segment, settings.kv_shm, settings.lease_seconds)


def check_lease(lease_seconds: float, frame_timeout_s: float | None) -> None:
    """A lease shorter than the transport's wait for a frame would free blocks that the
    transport may still be sending."""
    if frame_timeout_s is not None and lease_seconds <= frame_timeout_s:
        raise ValueError(f"--lease-seconds {lease_seconds:g} must exceed the KV transport's "
                         f"frame timeout of {frame_timeout_s:g} s")


def warn_faults(settings: WorkerSettings) -> None:
    """Fault injection is for tests: a worker running with it must say so, loudly."""
    if settings.kv_faults is None:
        return
    if settings.role is not WorkerRole.PREFILL:
        log.warning("--kv-faults has no effect on a %s worker (only senders inject faults)",
                    settings.role.value)
        return
    log.warning("*** TEST ONLY: KV transfer fault injection is ON (%s): this worker drops, "
                "truncates, corrupts or delays transfers on purpose ***", settings.kv_faults.spec)

"""The KV connector: moves a request's KV blocks from a prefill worker to a decode worker.

``base`` states the two roles (sender, receiver), what each guarantees, and the
``KVTransport`` kinds; ``factory`` builds a transport's role; ``zmq`` and ``ucx`` are the
transports, ``shm`` same-host shared memory over zmq; ``lease`` is the sender-side
bookkeeping that decides when a prefill worker may free the blocks it shipped,
``transfers`` a worker's bookkeeping per direction (including the one retry of a failed
transfer), ``streams`` the same for a prompt's KV shipped piece by piece as it is
computed; ``faults`` is a TEST-ONLY sender wrapper
that drops, truncates, corrupts or delays transfers on purpose (off unless asked for).
"""

from common.connector.base import (
           KVReceiver,
           KVSender,
           KVTransport,
           ReceivedTransfer,
           ShmMode,
           owned,
)
from common.connector.factory import SharedKV, make_receiver, make_sender

__all__ = ["KVReceiver", "KVSender", "KVTransport", "ReceivedTransfer", "SharedKV", "ShmMode",
           "make_receiver", "make_sender", "owned"]

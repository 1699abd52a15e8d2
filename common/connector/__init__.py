"""The KV connector: moves a request's KV blocks from a prefill worker to a decode worker.

``base`` states the two roles (sender, receiver) and what each guarantees; ``zmq`` and
``ucx`` are the transports; ``lease`` is the sender-side bookkeeping that decides when
a prefill worker may free the blocks it shipped.
"""

from common.connector.base import KVReceiver, KVSender, ReceivedTransfer, make_receiver, make_sender

__all__ = ["KVReceiver", "KVSender", "ReceivedTransfer", "make_receiver", "make_sender"]

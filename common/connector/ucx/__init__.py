"""UCX transport for KV transfers (``ucx://HOST:PORT``), built on ``ucxx``.

The workers' loops are synchronous, so ``UcxSender``/``UcxReceiver`` hand work to the
process's one UCX event loop with ``call_soon_threadsafe``/``run_coroutine_threadsafe``
and collect results from ``queue.SimpleQueue``s; no public method blocks except
``poll(timeout_ms)`` and ``close``.

- ``loop``: the optional ucxx import and the process's one asyncio loop thread
  (``UcxLoop``), and why there is exactly one;
- ``framing``: the wire format (length-prefixed messages, probed block receives,
  sends kept in order) and ``parse_address``;
- ``sender`` / ``receiver``: the two roles.

Importing this package never needs ucxx; constructing a sender or receiver without it
raises ``RuntimeError`` naming the extra to install.
"""

from common.connector.ucx.framing import FRAME_TIMEOUT_S, framed, parse_address
from common.connector.ucx.loop import UcxLoop, ucx_available
from common.connector.ucx.receiver import UcxReceiver
from common.connector.ucx.sender import CONNECT_TIMEOUT_S, UcxSender

__all__ = ["CONNECT_TIMEOUT_S", "FRAME_TIMEOUT_S", "UcxLoop", "UcxReceiver", "UcxSender",
           "framed", "parse_address", "ucx_available"]

"""The raw UCX reference of ``tandem bench kv-transfer``: ``ucx_perftest`` (shipped in the
libucx wheel's ``bin/``) streaming tagged messages of one block's size from one process
to another on loopback, once per UCX configuration in ``CONFIGS``.

This is UCX with no Python, no checks and busy-polling progress: the ceiling the
connector is measured against, per transport, so the report says which transport UCX
can use here and what it reaches.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

# label -> (environment, ucx_perftest flags). "-e": endpoints with peer-failure handling,
# as the connector creates them (see common/connector/ucx/loop.py for why that matters).
CONFIGS: dict[str, tuple[dict[str, str], list[str]]] = {
    "tcp": ({"UCX_TLS": "tcp"}, []),
    "cma,tcp": ({"UCX_TLS": "cma,tcp"}, []),
    "all": ({}, []),
    "all -e": ({}, ["-e"]),  # the connector's mode before its fix: tcp only
    "all -e cma-inv": ({"UCX_CMA_MEMORY_INVALIDATE": "y"}, ["-e"]),  # the connector's mode now
}
_START_S = 20.0  # the server's start-up on a busy machine


def perftest_binary() -> Path | None:
    """``ucx_perftest`` from the libucx wheel, or None when the wheel is not installed."""
    try:
        import libucx
    except ImportError:
        return None
    binary = Path(libucx.__file__).parent / "bin" / "ucx_perftest"
    return binary if binary.is_file() else None


def perftest_mb_s(label: str, message_bytes: int, count: int) -> float:
    """MB/s (10^6 B/s) of ``count`` tagged messages of ``message_bytes``, overall."""
    binary = perftest_binary()
    if binary is None:
        raise RuntimeError("ucx_perftest not found (the libucx wheel's bin/)")
    extra_env, flags = CONFIGS[label]
    lib = binary.parent.parent / "lib"
    env = os.environ | extra_env | {"LD_LIBRARY_PATH": f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    with socket.socket() as s:  # a free port (the server binds it a moment later)
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    server = subprocess.Popen([str(binary), "-p", port, *flags], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = [str(binary), "127.0.0.1", "-p", port, "-t", "tag_bw", "-s", str(message_bytes),
                  "-n", str(count), *flags]
        deadline = time.monotonic() + _START_S
        while True:
            done = subprocess.run(client, env=env, capture_output=True, text=True, timeout=300)
            if done.returncode == 0 or time.monotonic() > deadline or server.poll() is not None:
                break
            time.sleep(0.1)  # the server is not listening yet: dial again
        final = [line for line in done.stdout.splitlines() if line.startswith("Final:")]
        if done.returncode != 0 or not final:
            raise RuntimeError(f"ucx_perftest {label} failed: {done.stderr.strip()[-300:]}")
        return float(final[0].split()[6])  # Final: iters, overhead x3, bandwidth avg, overall
    finally:
        server.kill()
        server.wait()

"""The service processes a benchmark starts: waiting until one answers, and stopping it."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_answering(proc: subprocess.Popen, probe: Callable[[], T | None], what: str,
                   timeout: float) -> T:
    """Call ``probe`` until it returns something (not None); a ``RuntimeError`` as soon as
    the process exits, or when ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the {what} exited with status {proc.returncode}")
        answer = probe()
        if answer is not None:
            return answer
        time.sleep(0.05)
    raise RuntimeError(f"the {what} did not answer within {timeout:g} s")


def stop(proc: subprocess.Popen, grace: float = 10) -> None:
    """SIGTERM, then SIGKILL if it is still there after ``grace`` seconds; reaped either way."""
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

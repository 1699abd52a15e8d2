"""A real headless Chromium for page tests, driven over the DevTools protocol on a pipe.

``--remote-debugging-pipe`` has Chromium read protocol commands on its fd 3 and write
replies and events on its fd 4, each a JSON text ended by a NUL byte: no websocket, no
port, no Python package beyond the standard library. ``Browser.open(url)`` makes a tab,
``evaluate`` runs JavaScript in it and returns the value, ``screenshot`` writes a PNG.

By hand (docs/dashboard.png was taken so)::

    python -m tests.browser http://127.0.0.1:8000/dashboard docs/dashboard.png
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def chromium() -> str | None:
    """The Chromium binary (Debian's ``chromium`` package), or None."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _above(fd: int, lowest: int) -> int:
    """``fd`` moved to a number >= ``lowest`` (the old one closed)."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD, lowest)
    os.close(fd)
    return moved


class BrowserError(RuntimeError):
    pass


class Browser:
    def __init__(self, width: int = 1280, height: int = 720, timeout: float = 60.0) -> None:
        binary = chromium()
        if binary is None:
            raise BrowserError("no chromium on PATH (./setup.sh --dev installs Debian's)")
        self.timeout = timeout
        self._profile = tempfile.TemporaryDirectory(prefix="tandem-chromium-")
        to_browser, self._commands = os.pipe()  # we write commands, it reads fd 3
        self._replies, from_browser = os.pipe()  # it writes fd 4, we read replies
        # Above 4, so that moving one onto 3 in the child cannot overwrite the other.
        to_browser, from_browser = (_above(fd, 10) for fd in (to_browser, from_browser))

        def wire_fds() -> None:  # in the child, before exec
            os.dup2(to_browser, 3)
            os.dup2(from_browser, 4)

        self.proc = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--no-first-run", "--mute-audio", f"--window-size={width},{height}",
             f"--user-data-dir={self._profile.name}", "--remote-debugging-pipe", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(3, 4), preexec_fn=wire_fds)
        os.close(to_browser)
        os.close(from_browser)
        self._buffer = b""
        self._next_id = 0
        self.session: str | None = None

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for fd in (self._commands, self._replies):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._profile.cleanup()

    def send(self, method: str, session: bool = True, **params: Any) -> dict:
        """One protocol command; its result (events read meanwhile are dropped)."""
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params}
        if session and self.session is not None:
            msg["sessionId"] = self.session
        os.write(self._commands, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._replies], [], [], left)[0]:
                raise BrowserError("chromium did not answer in time")
            chunk = os.read(self._replies, 1 << 20)
            if not chunk:
                raise BrowserError("chromium closed its pipe")
            self._buffer += chunk
        text, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(text)

    def open(self, url: str) -> None:
        """A new tab at ``url``, which later commands act on."""
        target = self.send("Target.createTarget", session=False, url=url)["targetId"]
        self.session = self.send("Target.attachToTarget", session=False, targetId=target,
                                 flatten=True)["sessionId"]
        self.send("Page.enable")
        self.send("Runtime.enable")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the tab (JSON-serialisable)."""
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, what: str, timeout: float = 60.0) -> Any:
        """Poll a JavaScript expression until it is truthy (its value), or fail."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.1)

    def screenshot(self, path: Path) -> Path:
        """The tab's viewport as a PNG."""
        data = self.send("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        return path


def main(argv: list[str]) -> int:
    url, out = argv
    with Browser(width=1280, height=640) as b:
        b.open(url)
        b.wait_for("document.querySelectorAll('#requests .request').length > 0 && "
                   "Number(document.getElementById('poll').dataset.polls) >= 3",
                   "the timeline to show requests, and rates over a few polls")
        b.screenshot(Path(out))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

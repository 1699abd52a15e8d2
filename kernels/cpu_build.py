"""Compile-on-first-use of the C kernels in ``kernels/cpu/`` and loading them with ctypes.

Shared by ``kernels.cpu_attention`` and ``kernels.cpu_gemm``. A kernel is one C file,
built with the system gcc (``CFLAGS``: ``-O3 -march=native -fopenmp``, plus per-variant
defines) into a per-user cache (``$TANDEM_CACHE_DIR/kernels``, else
``~/.cache/tandem/kernels``) the first time it is needed, about a second per build.

The build is keyed by a hash of the source, the flags, the compiler version, the machine
and the CPU (``-march=native``), so a stale or foreign build is never loaded; builds go to
a temporary name and are renamed into place, so concurrent processes never load a
half-written library. torch is imported before any library is loaded so that the
library's ``libgomp.so.1`` dependency binds to the libgomp torch already mapped: one
OpenMP runtime and thread pool for torch and the kernels (``openmp_runtimes`` checks).

``Loader`` is the availability mechanism: it opens a kernel variant once per process and
remembers either its entry points or why they could not be built, so callers can fall
back to torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Generic, TypeVar

import torch  # noqa: F401  (must be loaded before the kernel libraries, see the docstring)

log = logging.getLogger(__name__)

CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
LIBS = ("-lm",)

# Any of these while building or loading means: the kernel is unavailable, use torch.
BUILD_ERRORS = (OSError, RuntimeError, AttributeError, IndexError, subprocess.SubprocessError)
_OPENMP_LIB = re.compile(r"\S*/lib(?:gomp|iomp5|omp)\b[^/\s]*\.so[^/\s]*")
_lock = threading.RLock()

F = TypeVar("F")
K = TypeVar("K", bound=Hashable)


def cache_root() -> Path:
    """Where Tandem keeps what it builds or converts once (``$TANDEM_CACHE_DIR``, else
    ``~/.cache/tandem``); the one definition, for kernels here and models in the loader."""
    root = os.environ.get("TANDEM_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "tandem"


def cache_dir() -> Path:
    return cache_root() / "kernels"


def cpu_identity() -> str:
    """The CPU model and flags lines of /proc/cpuinfo ('' where unreadable)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    keep = ("model name", "flags", "Features", "CPU part")
    found: dict[str, str] = {}
    for line in lines:
        key = line.split(":", 1)[0].strip()
        if key in keep and key not in found:
            found[key] = line
    return "\n".join(found[k] for k in keep if k in found)


@functools.cache
def compiler_version(cc: str) -> str:
    run = subprocess.run([cc, "--version"], check=False, capture_output=True, text=True, timeout=30)
    target = subprocess.run(
        [cc, "-dumpmachine"], check=False, capture_output=True, text=True, timeout=30
    )
    return run.stdout.splitlines()[0] + " " + target.stdout.strip()


def find_compiler() -> str:
    cc = shutil.which("gcc")
    if cc is None:
        raise RuntimeError("gcc not found on PATH")
    return cc


def build_key(
    source: str, cc_version: str, flags: tuple[str, ...] = CFLAGS, libs: tuple[str, ...] = LIBS
) -> str:
    """Hash of everything that decides what the built library contains."""
    parts = [source, " ".join(flags + libs), cc_version, platform.machine(), cpu_identity()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def compile_library(
    cc: str, source: Path, flags: tuple[str, ...], out: Path, libs: tuple[str, ...] = LIBS
) -> None:
    """Build into a temporary name beside ``out``, then rename (safe under races)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp.so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cc, *flags, str(source), "-o", tmp, *libs]
        res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr.strip()}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def source_text(source: Path) -> str:
    """The C file followed by every local header it includes (``#include "x.h"``, beside
    it), so that editing a shared header changes the build key of each kernel using it."""
    text = source.read_text()
    headers = (source.parent / name for name in _LOCAL_INCLUDE.findall(text))
    return "\0".join([text, *(h.read_text() for h in headers)])


def library_path(
    source: Path, name: str, flags: tuple[str, ...] = CFLAGS, libs: tuple[str, ...] = LIBS
) -> Path:
    """``<cache_dir>/<name>-<key>.so``, the build of ``source`` with ``flags`` for this
    compiler and CPU, compiled first if absent."""
    cc = find_compiler()
    key = build_key(source_text(source), compiler_version(cc), flags, libs)
    path = cache_dir() / f"{name}-{key}.so"
    if not path.exists():
        compile_library(cc, source, flags, path, libs)
    return path


def openmp_runtimes() -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process ([] where unknowable)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return sorted(set(_OPENMP_LIB.findall(maps)))


def load(path: Path, what: str) -> ctypes.CDLL:
    """dlopen ``path``; warns if that leaves more than one OpenMP runtime in the process."""
    lib = ctypes.CDLL(str(path))
    runtimes = openmp_runtimes()
    if len(runtimes) > 1:  # e.g. a torch build whose bundled libgomp was renamed
        log.warning("%s and torch use different OpenMP runtimes: %s", what, runtimes)
    return lib


class Loader(Generic[K, F]):
    """Opens a kernel's library once per process and variant ``key``, and remembers
    either the entry points or why they could not be built.

    ``get(key)`` calls ``opener(key)`` the first time (under a lock); a build or load
    failure is remembered as None with its text in ``reason(key)``, and not retried. The
    per-call fast path (already opened) takes no lock. ``reset()`` forgets everything, as
    in a fresh process (for tests)."""

    def __init__(self, what: str, opener: Callable[[K], F]) -> None:
        self.what, self._opener = what, opener
        self._entries: dict[K, F | None] = {}
        self._reasons: dict[K, str] = {}

    def get(self, key: K) -> F | None:
        entries = self._entries
        if key in entries:
            return entries[key]
        with _lock:
            if key not in entries:
                try:
                    entries[key] = self._opener(key)
                except BUILD_ERRORS as exc:
                    entries[key], self._reasons[key] = None, f"{type(exc).__name__}: {exc}"
                    log.debug("%s unavailable: %s", self.what, self._reasons[key])
        return entries[key]

    def require(self, key: K) -> F:
        """``get(key)``, or RuntimeError saying why the kernel is unavailable."""
        entry = self.get(key)
        if entry is None:
            raise RuntimeError(f"{self.what} unavailable: {self._reasons[key]}")
        return entry

    def reason(self, key: K) -> str | None:
        """Why ``get(key)`` is None, else None (opens the library first if need be)."""
        self.get(key)
        return self._reasons.get(key)

    def reset(self) -> None:
        self._entries.clear()
        self._reasons.clear()

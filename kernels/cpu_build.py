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

``load_once`` is the availability mechanism: it opens a kernel variant once per process
and remembers either the function or why it could not be built, so callers can fall back
to torch.
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
from typing import TypeVar

import torch  # noqa: F401  (must be loaded before the kernel libraries, see the docstring)

log = logging.getLogger(__name__)

CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
LIBS = ("-lm",)

# Any of these while building or loading means: the kernel is unavailable, use torch.
BUILD_ERRORS = (OSError, RuntimeError, AttributeError, IndexError, subprocess.SubprocessError)
_OPENMP_LIB = re.compile(r"\S*/lib(?:gomp|iomp5|omp)\b[^/\s]*\.so[^/\s]*")
_lock = threading.RLock()

F = TypeVar("F")


def cache_dir() -> Path:
    root = os.environ.get("TANDEM_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "tandem"
    return base / "kernels"


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


def library_path(
    source: Path, name: str, flags: tuple[str, ...] = CFLAGS, libs: tuple[str, ...] = LIBS
) -> Path:
    """``<cache_dir>/<name>-<key>.so``, the build of ``source`` with ``flags`` for this
    compiler and CPU, compiled first if absent."""
    cc = find_compiler()
    key = build_key(source.read_text(), compiler_version(cc), flags, libs)
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


def load_once(
    functions: dict[Hashable, F | None],
    reasons: dict[Hashable, str],
    key: Hashable,
    opener: Callable[[], F],
    what: str,
) -> F | None:
    """``functions[key]``, calling ``opener()`` the first time (under a lock).

    A build or load failure is remembered as ``functions[key] = None`` with its text in
    ``reasons[key]``, and not retried. The caller owns both dicts (tests swap them to
    simulate a fresh process) and should check ``key in functions`` itself first: that
    per-call fast path needs no lock.
    """
    if key in functions:
        return functions[key]
    with _lock:
        if key not in functions:
            try:
                functions[key] = opener()
            except BUILD_ERRORS as exc:
                functions[key], reasons[key] = None, f"{type(exc).__name__}: {exc}"
                log.debug("%s unavailable: %s", what, reasons[key])
    return functions[key]

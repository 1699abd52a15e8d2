"""The machine's FMA peak, measured: ``kernels/cpu/fma_peak.c`` (register-resident FMA
chains on every thread). Benchmarks quote their fraction of it as the compute limit —
a GEMM library's rate is not the machine's limit (vLLM ran faster than torch's)."""

from __future__ import annotations

import ctypes
from pathlib import Path

from kernels import cpu_build

SOURCE = Path(__file__).parent / "cpu" / "fma_peak.c"


def _open(_variant: None) -> ctypes._CFuncPtr:
    lib = cpu_build.load(cpu_build.library_path(SOURCE, "fma_peak", cpu_build.CFLAGS), "FMA peak")
    fn = lib.fma_peak_gflops
    fn.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_float)]
    fn.restype = ctypes.c_double
    return fn


_loader = cpu_build.Loader("FMA peak kernel", _open)


def available() -> bool:
    return _loader.get(None) is not None


def fma_peak_gflops(threads: int, iters: int = 20_000_000, reps: int = 5) -> float:
    """Best of ``reps`` runs of ``threads`` threads, each ``iters`` rounds of 12 FMA
    chains, 8 floats wide and then 16 (about 0.3 s per run at 3 GHz for 8): the wider
    runs twice as fast where the CPU has whole 512-bit FMA units (Intel's server cores),
    at the same rate where it splits them (Zen 4). The best, not the mean: the peak is
    what the cores can do, and on a shared VM a run can lose a core to a neighbour (seen
    here: one two-thread run at half the rate of the next). RuntimeError where it cannot
    be built."""
    fn = _loader.require(None)
    sink = ctypes.c_float()
    fn(iters // 10, threads, 8, ctypes.byref(sink))  # wake the cores and the thread pool
    return max(fn(iters // (width // 8), threads, width, ctypes.byref(sink))
               for width in (8, 16) for _ in range(reps))

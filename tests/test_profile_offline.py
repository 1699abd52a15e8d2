"""``loadtest/profile_offline.py``: the per-kernel timers see the kernels a run calls,
count each second once (a timer's own time excludes the timers nested in it), and leave
every patched attribute as it found it."""

from __future__ import annotations

import re
import time

from kernels import attention, cpu_decode, cpu_gemm, cpu_ops
from loadtest import profile_offline


def test_a_timer_counts_only_its_own_time_when_another_runs_inside_it():
    timers = profile_offline.Timers()
    inner = timers.wrap(lambda: time.sleep(0.02), lambda: ("inner", 0.0))
    outer = timers.wrap(lambda: (time.sleep(0.02), inner()), lambda: ("outer", 0.0))
    start = time.perf_counter()
    outer()
    wall = time.perf_counter() - start
    assert timers.calls == {"inner": 1, "outer": 1}
    assert timers.seconds["inner"] >= 0.02 and timers.seconds["outer"] >= 0.02
    assert sum(timers.seconds.values()) <= wall  # nothing counted twice


def test_a_run_on_a_tiny_model_is_split_over_the_kernels_and_restores_them(tiny_model_dir, capsys):
    originals = (cpu_gemm.linear, cpu_ops.add_rms_norm, cpu_decode.DecodeLayers.run,
                 attention.TorchBackend.forward)
    assert profile_offline.main(["--model", str(tiny_model_dir), "--num-prompts", "3",
                                 "--input-len", "20", "--output-len", "6", "--threads", "1",
                                 "--num-kv-blocks", "64"]) == 0
    out = capsys.readouterr().out
    shares = dict(re.findall(r"^(\S.*?)\s+[0-9.]+\s+([0-9.]+)%", out, re.M))
    for entry in ("fp32 packed GEMM", "decode layers (C, one call)", "attention, with prefill chunks",
                  "elementwise add_rms_norm", "step: rest (Python, sampling, scheduling), decode only"):
        assert entry in shares, out
    # No time counted twice (nested timers): the shares of the wall clock add up to at most
    # 100%, give or take their printed rounding (0.05% each). Shares, not seconds: a fast
    # run's seconds print as a few hundredths, rounded by as much as they measure.
    assert sum(float(s) for s in shares.values()) <= 100 + 0.05 * len(shares), out
    assert (cpu_gemm.linear, cpu_ops.add_rms_norm, cpu_decode.DecodeLayers.run,
            attention.TorchBackend.forward) == originals

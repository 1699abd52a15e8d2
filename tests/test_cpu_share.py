"""CpuShare: threads per step from what the other processes leave idle (/proc/stat)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from common.engine.cpu_share import CpuShare, busy_seconds

STAT = """cpu  100 0 50 1000 5 0 0 0 0 0
cpu0 {u0} 0 {s0} 500 2 0 0 {st0} 0 0
cpu1 {u1} 0 {s1} 500 3 0 0 0 0 0
intr 12345
"""


def stat(u0=0, s0=0, u1=0, s1=0, st0=0) -> str:
    return STAT.format(u0=u0, s0=s0, u1=u1, s1=s1, st0=st0)


def test_busy_seconds_counts_user_system_irq_and_steal_on_the_cpus_asked_for():
    text = stat(u0=30, s0=10, u1=200, s1=100, st0=5)
    assert busy_seconds(text, [0], 100) == pytest.approx(0.45)  # 30 + 10 + 5 ticks
    assert busy_seconds(text, [1], 100) == pytest.approx(3.0)
    assert busy_seconds(text, [0, 1], 100) == pytest.approx(3.45)
    assert busy_seconds(text, [7], 100) == 0.0


class Host:
    """A scripted /proc/stat, our own CPU time and a clock."""

    def __init__(self) -> None:
        self.now, self.busy_ticks, self.own = 0.0, 0, 0.0

    def share(self, cpus=(0, 1), max_threads=2) -> CpuShare:
        return CpuShare(list(cpus), max_threads, interval_s=0.1, clock=lambda: self.now,
                        read_stat=lambda: stat(u0=self.busy_ticks), own_cpu=lambda: self.own,
                        ticks_per_s=100)

    def run(self, seconds: float, others_cpus: float, own_cpus: float) -> None:
        self.now += seconds
        self.own += own_cpus * seconds
        self.busy_ticks += round((others_cpus + own_cpus) * seconds * 100)


def test_our_own_threads_never_count_against_us():
    host = Host()
    share = host.share()
    host.run(0.2, others_cpus=0.0, own_cpus=2.0)  # both CPUs busy, all of it ours
    assert share.threads() == 2 and share.others == pytest.approx(0.0)


def test_a_neighbour_that_keeps_a_cpu_busy_costs_a_thread_and_gives_it_back():
    host = Host()
    share = host.share()
    host.run(0.2, others_cpus=0.9, own_cpus=1.0)
    assert share.threads() == 1  # 2 - 0.9 + 0.25 = 1.35
    host.run(0.2, others_cpus=0.05, own_cpus=1.0)  # a gateway's few percent
    assert share.threads() == 2
    host.run(0.2, others_cpus=2.0, own_cpus=0.0)
    assert share.threads() == 1  # never below one


def test_the_decision_is_remade_only_once_per_interval():
    host = Host()
    share = host.share()
    host.run(0.2, others_cpus=1.0, own_cpus=0.5)
    assert share.threads() == 1
    host.run(0.05, others_cpus=0.0, own_cpus=2.0)
    assert share.threads() == 1  # inside the interval: unchanged
    host.run(0.1, others_cpus=0.0, own_cpus=2.0)
    assert share.threads() == 2


def test_max_threads_caps_the_count():
    host = Host()
    share = host.share(cpus=(0, 1, 2, 3), max_threads=2)
    host.run(0.2, others_cpus=0.0, own_cpus=1.0)
    assert share.threads() == 2


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs Linux")
def test_a_real_process_spinning_on_one_of_our_cpus_takes_a_thread_away():
    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    burner = subprocess.Popen([sys.executable, "-c", (
        f"import os; os.sched_setaffinity(0, {{{cpus[1]}}})\nwhile True: pass")])
    try:
        share = CpuShare(cpus, 2, interval_s=0.2)
        deadline = time.monotonic() + 20
        seen = []
        while time.monotonic() < deadline:
            seen.append(share.threads())
            if seen[-1] == 1 and share.others >= 0.75:
                break
            time.sleep(0.05)  # pacing the samples; the loop polls a condition with a deadline
        assert seen[-1] == 1 and share.others >= 0.75, (seen[-5:], share.others)
    finally:
        burner.kill()
        burner.wait()

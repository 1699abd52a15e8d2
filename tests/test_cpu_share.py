"""CpuShare: threads per step from what the other workers on our CPUs use now (the board)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from common.engine.cpu_share import CpuShare, ThreadBoard
from tests.conftest import make_engine


@pytest.fixture
def board_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CPU_BOARD", str(tmp_path))
    return tmp_path


def test_a_busy_neighbour_costs_a_thread_at_our_next_step_and_gives_it_back_when_it_rests(board_dir):
    decode, prefill = CpuShare([0, 1], 2), CpuShare([0, 1], 2)
    assert decode.threads() == 2  # alone
    assert prefill.threads() == 1  # the decode step holds both CPUs: what is left, at least one
    assert decode.threads() == 1 and decode.others == 1
    prefill.rest()
    assert decode.threads() == 2 and decode.others == 0


def test_only_the_cpus_we_share_count(board_dir):
    ours = CpuShare([1, 2, 3], 3)
    apart = CpuShare([0], 1)
    overlapping = CpuShare([0, 1], 2)
    assert apart.threads() == 1 and overlapping.threads() == 1  # overlapping sees apart's one
    assert ours.threads() == 2  # overlapping's one thread may be on CPU 1: 3 - 1
    assert ours.others == 1


def test_never_below_one_thread_nor_above_max_threads(board_dir):
    crowd = [CpuShare([0, 1], 2) for _ in range(3)]
    for share in crowd:
        share.threads()
    assert all(share.threads() == 1 for share in crowd)
    for share in crowd:
        share.rest()
    capped = CpuShare([0, 1, 2, 3], 2)
    assert capped.threads() == 2


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.on_sleep = lambda: None

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.on_sleep()


def test_a_step_that_may_wait_waits_for_the_others_next_step_to_leave_it_a_cpu(board_dir):
    clock = Clock()
    decode = CpuShare([0, 1], 2)
    prefill = CpuShare([0, 1], 2, clock=lambda: clock.now, sleep=clock.sleep)
    assert decode.threads() == 2
    decided = []
    clock.on_sleep = lambda: decided.append(decode.threads()) if clock.now >= 0.01 and not decided else None
    assert prefill.threads(may_wait=True) == 1  # not 1 beside the decode's 2: it waited
    assert decided == [1]  # the decode's next step saw the want and left a CPU
    assert 0.01 <= prefill.waited_s < 0.02
    assert decode.threads() == 1 and prefill.board._mine[1] == 0  # the want is withdrawn


def test_a_wait_ends_after_wait_s_if_nobody_makes_room(board_dir):
    clock = Clock()
    holder = CpuShare([0, 1], 2)
    holder.threads()  # holds both CPUs and never steps again
    prefill = CpuShare([0, 1], 2, wait_s=0.2, clock=lambda: clock.now, sleep=clock.sleep)
    assert prefill.threads(may_wait=True) == 1
    assert prefill.waited_s == pytest.approx(0.2, abs=0.001)


def test_a_step_that_may_not_wait_never_does(board_dir):
    clock = Clock()
    holder = CpuShare([0, 1], 2)
    holder.threads()
    decode = CpuShare([0, 1], 2, clock=lambda: clock.now, sleep=clock.sleep)
    assert decode.threads() == 1 and decode.waited_s == 0 and clock.now == 0


def test_a_closed_board_entry_is_gone_and_no_longer_counts(board_dir):
    mine, other = CpuShare([0, 1], 2), CpuShare([0, 1], 2)
    other.threads()
    other_file = other.board.path
    assert other_file.exists()
    other.close()
    assert not other_file.exists()
    mine.board.relist_s = 0.0
    assert mine.threads() == 2


_WORKER = """
import sys
from common.engine.cpu_share import CpuShare
share = CpuShare([0, 1], 2)
share.board.set(2)
print(share.board.path, flush=True)
sys.stdin.read()
"""


def test_a_killed_workers_entry_stops_counting_and_its_file_is_removed(board_dir):
    """A worker killed mid-step leaves its count on the board; its lock goes with it."""
    child = subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={**os.environ},
                             cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        path = child.stdout.readline().strip()
        share = CpuShare([0, 1], 2, ThreadBoard([0, 1], relist_s=0.0))
        assert share.threads() == 1  # alive: its two threads count
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        assert share.threads() == 2
        assert not os.path.exists(path)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_an_engine_holds_its_threads_on_the_board_while_it_computes_and_rests_when_not(
        board_dir, tiny_model_dir):
    from common.sampling_params import SamplingParams

    engine = make_engine(tiny_model_dir, share_cpus=True)
    entry = engine._cpu_share.board
    engine.add_request(list(range(1, 20)), SamplingParams(max_tokens=3, temperature=0.0))
    engine.step()
    assert entry._mine[0] == engine._cpu_share.max_threads >= 1
    deadline = time.monotonic() + 60
    while engine.has_work and time.monotonic() < deadline:
        engine.step()
    assert not engine.has_work
    engine.step()  # nothing to schedule
    assert entry._mine[0] == 0
    engine.close()  # a worker's last act: its entry leaves the board
    assert not entry.path.exists()


def test_an_engine_without_a_writable_board_runs_on_all_its_threads(tmp_path, monkeypatch,
                                                                     tiny_model_dir):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("TANDEM_CPU_BOARD", str(blocked / "board"))  # under a file: no mkdir
    engine = make_engine(tiny_model_dir, share_cpus=True)
    assert engine._cpu_share is None


class RecordingShare:
    def __init__(self) -> None:
        self.asked: list[bool] = []

    def threads(self, may_wait: bool = False) -> int:
        self.asked.append(may_wait)
        return 1

    def rest(self) -> None:
        pass


def test_only_a_step_of_prompts_for_handoff_may_wait(tiny_model_dir):
    from common.sampling_params import SamplingParams

    engine = make_engine(tiny_model_dir)
    engine._cpu_share = share = RecordingShare()
    engine.add_request(list(range(1, 20)), SamplingParams(max_tokens=2, temperature=0.0),
                       prefill_only=True)
    engine.step()
    assert share.asked == [True]
    engine.add_request(list(range(1, 20)), SamplingParams(max_tokens=2, temperature=0.0))
    engine.step()  # a prompt whose tokens this engine streams
    assert share.asked == [True, False]

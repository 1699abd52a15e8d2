"""The UCX transport's receive buffers: reused only once no view of them is alive.
No ucxx needed."""

from __future__ import annotations

import gc
import threading

import numpy as np

from common.connector.ucx.buffers import ReceiveBuffers


def address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


def test_a_buffer_is_reused_only_after_every_view_of_it_is_gone() -> None:
    pool = ReceiveBuffers()
    first = pool.take(1000)
    block = memoryview(first)[100:200].toreadonly()  # as a transfer's blocks are cut
    backing = address(memoryview(first))
    del first
    gc.collect()
    assert pool.idle_bytes == 0  # the block still holds it
    assert address(memoryview(pool.take(1000))) != backing  # so a new buffer is made
    del block
    gc.collect()
    assert pool.idle_bytes >= 1000
    again = pool.take(800)  # the smallest idle buffer that fits
    assert address(memoryview(again)) == backing and again.nbytes == 800


def test_the_smallest_idle_buffer_that_fits_is_taken() -> None:
    pool = ReceiveBuffers()
    small, big = pool.take(100), pool.take(10_000)
    where = {100: address(memoryview(small)), 10_000: address(memoryview(big))}
    del small, big
    gc.collect()
    fits_small, fits_big = pool.take(50), pool.take(5_000)
    assert address(memoryview(fits_small)) == where[100]
    assert address(memoryview(fits_big)) == where[10_000]
    assert pool.idle_bytes == 0


def test_idle_buffers_past_the_cap_are_freed() -> None:
    pool = ReceiveBuffers(idle_bytes_max=1500)
    held = [pool.take(1000), pool.take(1000)]
    del held
    gc.collect()
    assert pool.idle_bytes == 1000  # the second would pass the cap


def test_a_buffer_returns_from_another_thread() -> None:
    pool = ReceiveBuffers()
    views = [memoryview(pool.take(4096))]
    done = threading.Thread(target=views.clear)
    done.start()
    done.join()
    gc.collect()
    assert pool.idle_bytes == 4096


def test_a_buffer_given_back_while_the_lock_is_held_waits_for_the_next_take() -> None:
    pool = ReceiveBuffers()
    held = pool.take(512)
    where = address(memoryview(held))
    with pool._lock:  # as when the collector runs a finalizer inside take, on its thread
        del held
        gc.collect()  # the finalizer must not wait for the lock (it would never get it)
    assert address(memoryview(pool.take(512))) == where

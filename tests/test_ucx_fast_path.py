"""The UCX connector's fast path: between two processes its blocks ride cma (the receiver
reads them in place) with the endpoints' peer-failure handling on, the bytes arrive
intact. (The commit that ends each transfer is tested in test_connector.py.)

Waiting is "poll until a condition holds, within a deadline"; no sleeps as synchronisation.
"""

from __future__ import annotations

import hashlib
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

from common.connector import KVTransport, make_sender
from common.protocol import KVAck
from tests.test_connector import (
    SMOLLM2_BLOCK,
    handoff,
    poll_until,
    random_blocks,
    require_ucx,
    views,
)

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 30.0  # a fresh interpreter imports numpy, zmq and ucxx first

RECEIVER = """
import hashlib, sys
from common.connector import KVTransport, make_receiver
receiver = make_receiver(KVTransport.UCX, "ucx://127.0.0.1:0")
print("ADDRESS", receiver.address, flush=True)
while True:
    for t in receiver.poll(timeout_ms=100):
        digest = hashlib.sha256(b"".join(bytes(b) for b in t.blocks)).hexdigest()
        print("GOT", t.header.transfer_id, len(t.blocks), digest, flush=True)
        receiver.ack(t, ok=True)
        sys.stdin.read()  # until the parent has the ack and closes our stdin
        receiver.close()
        sys.exit(0)
"""


def _start_receiver(tmp_path: Path) -> tuple[subprocess.Popen, str]:
    # UCX prints its protocol tables (which transport serves which message size) to stdout.
    env = os.environ | {"PYTHONPATH": str(ROOT), "UCX_PROTO_INFO": "y"}
    child = subprocess.Popen([sys.executable, "-c", RECEIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=open(tmp_path / "receiver.err", "w"), text=True, env=env)  # noqa: SIM115
    lines = _read_until(child, "ADDRESS")
    return child, lines[-1].split()[1]


def _read_until(child: subprocess.Popen, prefix: str) -> list[str]:
    lines: list[str] = []
    while not (lines and lines[-1].startswith(prefix)):
        ready, _, _ = select.select([child.stdout], [], [], DEADLINE_S)
        line = child.stdout.readline() if ready else ""
        if not line:
            child.kill()
            pytest.fail(f"receiver printed no {prefix} line; output so far: {lines[-20:]}")
        lines.append(line.rstrip("\n"))
    return lines


def test_a_transfer_between_processes_rides_cma_and_arrives_intact(tmp_path: Path) -> None:
    require_ucx()
    import ucxx

    sender = make_sender(KVTransport.UCX)  # first: any ucxx call would create a context without our options
    if "cma" not in ucxx.get_active_transports():
        sender.close()
        pytest.skip("UCX lists no cma transport here (e.g. ptrace restricted)")
    blocks = random_blocks(24, SMOLLM2_BLOCK, seed=11)
    output: list[str] = []
    child, address = _start_receiver(tmp_path)
    try:
        sender.send(address, handoff("fast", len(blocks), SMOLLM2_BLOCK), views(blocks))
        output += _read_until(child, "GOT")
        acks: list[KVAck] = []
        poll_until(lambda: acks.extend(sender.poll_acks()) or acks, "ack for the transfer")
    finally:
        child.stdin.close()
        output += child.stdout.read().splitlines()  # to EOF: UCX's C stdio flushes at exit
        child.wait(timeout=DEADLINE_S)
        sender.close()
    assert acks == [KVAck("fast", True, "")]
    want = hashlib.sha256(b"".join(b.tobytes() for b in blocks)).hexdigest()
    assert [line.split()[1:] for line in output if line.startswith("GOT")] == [["fast", "24", want]]
    # The rendezvous (every 737,280-byte block) is read in place over cma: without the
    # connector's UCX options, peer-failure mode puts it on tcp/lo.
    rendezvous = _rendezvous_rows(output, "intra-node", "tagged message by ucp_tag_send*")
    assert rendezvous and all("cma/memory" in row for row in rendezvous), rendezvous


def _rendezvous_rows(output: list[str], *table: str) -> list[str]:
    """The rendezvous rows of UCX_PROTO_INFO tables whose title has every ``table`` word.

    (A sockaddr endpoint also prints tables for its inter-node start-up configuration,
    which it leaves once the peers find they share a host.)
    """
    rows, title = [], ""
    for line in output:
        if "cfg#" in line:
            title = line
        elif "rendezvous" in line and all(word in title for word in table):
            rows.append(line)
    return rows

"""Transports move bytes exactly, and a write that cannot land fails fast, naming the peer."""
from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import signal
import time
from multiprocessing.connection import Connection
from typing import NamedTuple

import pytest
import torch

from weight_sync.transports import InProcessTransport, MooncakeTransport, TransportError, WriteOp

needs_mooncake = pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="needs the Mooncake wheel (extra cpu, cuda or npu)")

MIB = 1 << 20


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def serve_buffer(conn: Connection, nbytes: int) -> None:
    """Receiver process: register a zeroed buffer, then answer each seed with whether the buffer holds its bytes."""
    with MooncakeTransport() as transport:
        buffer = torch.zeros(nbytes, dtype=torch.uint8)
        conn.send((transport.session_id, transport.register(buffer)))
        while (seed := conn.recv()) is not None:
            conn.send(torch.equal(buffer, random_bytes(nbytes, seed)))


class Peer(NamedTuple):
    process: mp.Process
    conn: Connection
    session_id: str
    addr: int


@pytest.fixture
def start_peer():
    peers: list[Peer] = []

    def start(nbytes: int) -> Peer:
        conn, child_conn = mp.get_context("spawn").Pipe()
        process = mp.get_context("spawn").Process(target=serve_buffer, args=(child_conn, nbytes), daemon=True)
        process.start()
        assert conn.poll(60), "receiver process did not report its session"
        peers.append(Peer(process, conn, *conn.recv()))
        return peers[-1]

    yield start
    for peer in peers:
        if peer.process.is_alive():
            os.kill(peer.process.pid, signal.SIGCONT)
            peer.conn.send(None)
            peer.process.join(10)
        if peer.process.is_alive():
            peer.process.kill()
            peer.process.join()


@pytest.fixture
def sender():
    with MooncakeTransport() as transport:
        yield transport


@needs_mooncake
def test_mooncake_writes_64mib_between_processes_byte_exact(start_peer, sender):
    nbytes, chunk = 64 * MIB, 16 * MIB
    peer = start_peer(nbytes)
    source = random_bytes(nbytes, seed=7)
    local = sender.register(source)

    sender.write(peer.session_id, [WriteOp(local + i, peer.addr + i, chunk) for i in range(0, nbytes, chunk)], timeout_s=30)

    peer.conn.send(7)
    assert peer.conn.recv(), "receiver's buffer differs from the bytes sent"


@needs_mooncake
def test_mooncake_write_outside_peer_buffer_raises_naming_peer(start_peer, sender):
    peer = start_peer(MIB)
    local = sender.register(torch.ones(MIB, dtype=torch.uint8))
    with pytest.raises(TransportError, match=peer.session_id):
        sender.write(peer.session_id, [WriteOp(local, peer.addr + MIB, 4096)], timeout_s=10)


@needs_mooncake
def test_mooncake_write_to_dead_peer_raises_naming_peer(start_peer, sender):
    peer = start_peer(MIB)
    local = sender.register(torch.ones(MIB, dtype=torch.uint8))
    sender.write(peer.session_id, [WriteOp(local, peer.addr, MIB)], timeout_s=10)
    peer.process.kill()
    peer.process.join()

    started = time.monotonic()
    with pytest.raises(TransportError, match=peer.session_id):
        sender.write(peer.session_id, [WriteOp(local, peer.addr, MIB)], timeout_s=10)
    assert time.monotonic() - started < 5


@needs_mooncake
def test_mooncake_write_to_unreachable_address_raises_naming_it(sender):
    local = sender.register(torch.ones(4096, dtype=torch.uint8))
    started = time.monotonic()
    with pytest.raises(TransportError, match="127.0.0.1:1"):
        sender.write("127.0.0.1:1", [WriteOp(local, 0, 4096)], timeout_s=10)
    assert time.monotonic() - started < 5


@needs_mooncake
def test_mooncake_write_to_hung_peer_times_out(start_peer, sender):
    peer = start_peer(64 * MIB)
    local = sender.register(torch.ones(64 * MIB, dtype=torch.uint8))
    sender.write(peer.session_id, [WriteOp(local, peer.addr, 4096)], timeout_s=10)
    os.kill(peer.process.pid, signal.SIGSTOP)

    started = time.monotonic()
    with pytest.raises(TransportError, match=f"{peer.session_id} timed out"):
        sender.write(peer.session_id, [WriteOp(local, peer.addr, 64 * MIB)], timeout_s=1)
    assert 1 <= time.monotonic() - started < 3


def test_inprocess_write_copies_bytes_between_registered_tensors():
    with InProcessTransport() as transport:
        source, target = torch.randn(1000), torch.zeros(2000)
        local, remote = transport.register(source), transport.register(target)

        transport.write(transport.session_id, [WriteOp(local, remote + source.nbytes, source.nbytes)], timeout_s=1)

        assert torch.equal(target[1000:], source)
        assert not target[:1000].any()


def test_inprocess_write_outside_registered_memory_or_to_another_session_raises():
    with InProcessTransport() as transport, InProcessTransport() as other:
        source = torch.ones(16)
        local = transport.register(source)
        with pytest.raises(TransportError, match=other.session_id):
            transport.write(other.session_id, [WriteOp(local, local, 4)], timeout_s=1)
        with pytest.raises(TransportError, match="not inside a registered tensor"):
            transport.write(transport.session_id, [WriteOp(local, local + source.nbytes - 4, 8)], timeout_s=1)
        transport.unregister(local)
        with pytest.raises(TransportError, match="not inside a registered tensor"):
            transport.write(transport.session_id, [WriteOp(local, local, 4)], timeout_s=1)

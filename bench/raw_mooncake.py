"""Baseline: one raw Mooncake `transfer_sync_write` between two processes over TCP loopback, no Riptide code.

Prints {"raw_mooncake_gbps": ...} for 1 GiB; other benchmarks import `raw_mooncake_gbps` to report ratios.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import time
from multiprocessing.connection import Connection

import torch

HOST = "127.0.0.1"


def start_engine():
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize(HOST, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake TransferEngine failed to initialize on tcp loopback")
    return engine


def receive(conn: Connection, nbytes: int) -> None:
    engine = start_engine()
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    if engine.register_memory(buffer.data_ptr(), nbytes) != 0:
        raise RuntimeError(f"receiver could not register {nbytes} bytes")
    conn.send((f"{HOST}:{engine.get_rpc_port()}", buffer.data_ptr()))
    conn.recv()  # hold the buffer until the sender is done


def raw_mooncake_gbps(nbytes: int) -> float:
    """GB/s (1e9 bytes/s) of one write of `nbytes`; engine start, registration and handshake are excluded."""
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    receiver = ctx.Process(target=receive, args=(child_conn, nbytes), daemon=True)
    receiver.start()
    try:
        if not conn.poll(60):
            raise RuntimeError("receiver did not report its session within 60 s")
        peer, remote = conn.recv()
        engine = start_engine()
        source = torch.ones(nbytes, dtype=torch.uint8)  # content does not matter: no compression on the path
        if engine.register_memory(source.data_ptr(), nbytes) != 0:
            raise RuntimeError(f"sender could not register {nbytes} bytes")
        # The first write opens the session (handshake); keep it out of the timing.
        if engine.transfer_sync_write(peer, source.data_ptr(), remote, 4096) != 0:
            raise RuntimeError(f"warm-up write to {peer} failed")
        started = time.perf_counter()
        if engine.transfer_sync_write(peer, source.data_ptr(), remote, nbytes) != 0:
            raise RuntimeError(f"write of {nbytes} bytes to {peer} failed")
        seconds = time.perf_counter() - started
        conn.send(None)
        receiver.join(30)
        return nbytes / seconds / 1e9
    finally:
        if receiver.is_alive():
            receiver.kill()
            receiver.join()


def raw_mooncake_runs(nbytes: int, reps: int = 3, chunk_bytes: int | None = None) -> list[float]:
    """GB/s of `reps` timed writes of `nbytes` into an already-touched receiver buffer.

    Unlike `raw_mooncake_gbps`, one untimed full write goes first, so the receiver's first-touch page
    faults stay out of the timing (Riptide's staging slots are warm after its first push too).
    `chunk_bytes` splits each write into sequential `transfer_sync_write`s of that size, as a bucketed
    push does; None writes it in one call.
    """
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    receiver = ctx.Process(target=receive, args=(child_conn, nbytes), daemon=True)
    receiver.start()
    try:
        if not conn.poll(60):
            raise RuntimeError("receiver did not report its session within 60 s")
        peer, remote = conn.recv()
        engine = start_engine()
        source = torch.ones(nbytes, dtype=torch.uint8)
        if engine.register_memory(source.data_ptr(), nbytes) != 0:
            raise RuntimeError(f"sender could not register {nbytes} bytes")
        step = chunk_bytes or nbytes

        def write() -> float:
            started = time.perf_counter()
            for off in range(0, nbytes, step):
                n = min(step, nbytes - off)
                if engine.transfer_sync_write(peer, source.data_ptr() + off, remote + off, n) != 0:
                    raise RuntimeError(f"write of {n} bytes to {peer} failed")
            return time.perf_counter() - started

        write()  # handshake + receiver page faults, untimed
        out = [nbytes / write() / 1e9 for _ in range(reps)]
        conn.send(None)
        receiver.join(30)
        return out
    finally:
        if receiver.is_alive():
            receiver.kill()
            receiver.join()


if __name__ == "__main__":
    print(json.dumps({"raw_mooncake_gbps": round(raw_mooncake_gbps(1 << 30), 3)}))

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


class RawPair:
    """A sender engine here and a receiver process, kept alive so raw writes can be interleaved with
    other measurements (drifting background load then hits both alike). The receiver buffer is
    touched by one untimed full write first, so first-touch page faults stay out of the timing."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._receiver = ctx.Process(target=receive, args=(child_conn, nbytes), daemon=True)
        self._receiver.start()
        try:
            if not self._conn.poll(60):
                raise RuntimeError("receiver did not report its session within 60 s")
            self._peer, self._remote = self._conn.recv()
            self._engine = start_engine()
            self._source = torch.ones(nbytes, dtype=torch.uint8)
            if self._engine.register_memory(self._source.data_ptr(), nbytes) != 0:
                raise RuntimeError(f"sender could not register {nbytes} bytes")
            self.write()  # handshake + receiver page faults, untimed
        except BaseException:
            self.close()
            raise

    def write(self, chunk_bytes: int | None = None) -> float:
        """Seconds to write all bytes: one `transfer_sync_write`, or sequential ones of `chunk_bytes`."""
        step = chunk_bytes or self.nbytes
        started = time.perf_counter()
        for off in range(0, self.nbytes, step):
            n = min(step, self.nbytes - off)
            if self._engine.transfer_sync_write(self._peer, self._source.data_ptr() + off, self._remote + off, n) != 0:
                raise RuntimeError(f"write of {n} bytes to {self._peer} failed")
        return time.perf_counter() - started

    def gbps(self, chunk_bytes: int | None = None) -> float:
        return self.nbytes / self.write(chunk_bytes) / 1e9

    def close(self) -> None:
        try:
            self._conn.send(None)
            self._receiver.join(30)
        except (OSError, ValueError):
            pass
        if self._receiver.is_alive():
            self._receiver.kill()
            self._receiver.join()


def raw_mooncake_runs(nbytes: int, reps: int = 3, chunk_bytes: int | None = None) -> list[float]:
    """GB/s of `reps` timed writes of `nbytes` into an already-touched receiver buffer.

    Unlike `raw_mooncake_gbps`, one untimed full write goes first (see `RawPair`). `chunk_bytes`
    splits each write into sequential writes of that size, as a bucketed push does.
    """
    pair = RawPair(nbytes)
    try:
        return [pair.gbps(chunk_bytes) for _ in range(reps)]
    finally:
        pair.close()

if __name__ == "__main__":
    print(json.dumps({"raw_mooncake_gbps": round(raw_mooncake_gbps(1 << 30), 3)}))

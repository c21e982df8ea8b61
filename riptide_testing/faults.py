"""Faults injected inside a job's own processes, for the chaos soak (riptide_testing/chaos.py).

A job's trainer and servers open their transports themselves; the soak reaches them through the
library's transport hook: it starts the job with RIPTIDE_TRANSPORT_WRAPPER=WRAPPER, so every
Mooncake transport the job opens is a CorruptingTransport around the real one
(weight_sync.transports.wrap_transport), and with RIPTIDE_FAULTS_DIR=`faults_dir`, where it drops
the trigger files.
"""
from __future__ import annotations

import os

import torch

from weight_sync.transports import Transport, WriteOp

FAULTS_DIR_ENV = "RIPTIDE_FAULTS_DIR"
WRAPPER = f"{__name__}:CorruptingTransport"
CORRUPT_WRITE = "corrupt-write"           # the trigger file; a write that takes it renames it CORRUPT_TAKEN
CORRUPT_TAKEN = CORRUPT_WRITE + ".taken"


def job_env(faults_dir) -> dict[str, str]:
    """What the job's environment needs for these faults (added to os.environ by the soak)."""
    return {"RIPTIDE_TRANSPORT_WRAPPER": WRAPPER, FAULTS_DIR_ENV: str(faults_dir)}


class CorruptingTransport(Transport):
    """`inner`, except that while a file `corrupt-write` is in RIPTIDE_FAULTS_DIR, the next write
    that completes takes it (renames it `corrupt-write.taken`: one fault per file) and then lands
    one wrong byte in the middle of its last op's target, as corruption on the wire would. The
    receiver's digest refuses the bucket and the sender writes it again."""

    def __init__(self, inner: Transport):
        self.inner = inner
        faults = os.environ.get(FAULTS_DIR_ENV)
        self._trigger = os.path.join(faults, CORRUPT_WRITE) if faults else None
        self._junk: torch.Tensor | None = None

    @property
    def session_id(self) -> str:
        return self.inner.session_id

    def register(self, tensor: torch.Tensor) -> int:
        return self.inner.register(tensor)

    def unregister(self, addr: int) -> None:
        self.inner.unregister(addr)

    def write(self, peer_session: str, ops: list[WriteOp], timeout_s: float) -> None:
        self.inner.write(peer_session, ops, timeout_s)
        if self._trigger is not None and ops:
            self._maybe_corrupt(peer_session, ops[-1], timeout_s)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name):
        if name == "inner":                      # not set yet: no recursion through self.inner
            raise AttributeError(name)
        return getattr(self.inner, name)         # anything else the wrapped transport has

    def _maybe_corrupt(self, peer_session: str, op: WriteOp, timeout_s: float) -> None:
        try:
            os.rename(self._trigger, os.path.join(os.path.dirname(self._trigger), CORRUPT_TAKEN))
        except OSError:
            return                               # no trigger, or another writer took it
        if self._junk is None:
            self._junk = torch.full((1,), 0xA5, dtype=torch.uint8)
            self.inner.register(self._junk)
        self.inner.write(peer_session, [WriteOp(self._junk.data_ptr(), op.remote_addr + op.length // 2, 1)],
                         timeout_s)

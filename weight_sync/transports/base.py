"""The transport contract: one-sided writes from registered local memory into a peer's registered memory."""
from __future__ import annotations

import importlib
import os
from abc import ABC, abstractmethod
from typing import NamedTuple

import torch


class TransportError(RuntimeError):
    """A write that did not land; the message names the peer."""


class WriteOp(NamedTuple):
    local_addr: int   # inside a tensor registered with this transport
    remote_addr: int  # inside a tensor the peer registered with its transport
    length: int       # bytes


class Transport(ABC):
    """Moves bytes between registered tensors. A peer is named by its `session_id`.

    `write` returns only once every byte has landed in the peer's memory, and raises
    `TransportError` if that did not happen within `timeout_s`. After a failed or timed-out write
    the peer's target bytes are undefined: the receiver must not trust them (it checks a digest).
    """

    @property
    @abstractmethod
    def session_id(self) -> str: ...

    @abstractmethod
    def register(self, tensor: torch.Tensor) -> int:
        """Make `tensor` (contiguous) a source or target of writes; returns its address."""

    @abstractmethod
    def unregister(self, addr: int) -> None: ...

    @abstractmethod
    def write(self, peer_session: str, ops: list[WriteOp], timeout_s: float) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


WRAPPER_ENV = "RIPTIDE_TRANSPORT_WRAPPER"


def wrap_transport(transport: Transport) -> Transport:
    """`transport` as it is, or, with RIPTIDE_TRANSPORT_WRAPPER=`module:Class` in the environment,
    `Class(transport)`: a way for tooling to act on the writes of a job's own processes (trainer,
    servers), which it does not construct. The chaos soak uses it to corrupt bucket writes
    (riptide_testing/faults.py). Every Mooncake transport the library opens goes through here."""
    spec = os.environ.get(WRAPPER_ENV)
    if not spec:
        return transport
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{WRAPPER_ENV}={spec!r}: expected module:Class")
    return getattr(importlib.import_module(module), name)(transport)


def check_registrable(tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError("only contiguous tensors can be registered; call .contiguous() on it first")
    if tensor.nbytes == 0:
        raise ValueError("cannot register an empty tensor")

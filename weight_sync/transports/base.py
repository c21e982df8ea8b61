"""The transport contract: one-sided writes from registered local memory into a peer's registered memory."""
from __future__ import annotations

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


def check_registrable(tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError("only contiguous tensors can be registered; call .contiguous() on it first")
    if tensor.nbytes == 0:
        raise ValueError("cannot register an empty tensor")

"""Transport for a receiver colocated in the sender's process: a write is a copy between registered tensors.

Sender and receiver share one `InProcessTransport`; its own `session_id` is the only peer it reaches.
"""
from __future__ import annotations

import torch

from weight_sync.transports.base import Transport, TransportError, WriteOp, check_registrable


class InProcessTransport(Transport):
    def __init__(self):
        self._session_id = f"inprocess:{id(self):x}"
        self._registered: dict[int, torch.Tensor] = {}  # addr -> flat uint8 view of the registered tensor

    @property
    def session_id(self) -> str:
        return self._session_id

    def register(self, tensor: torch.Tensor) -> int:
        check_registrable(tensor)
        self._registered[tensor.data_ptr()] = tensor.reshape(-1).view(torch.uint8)
        return tensor.data_ptr()

    def unregister(self, addr: int) -> None:
        if self._registered.pop(addr, None) is None:
            raise KeyError(f"{addr:#x} is not registered with {self._session_id}")

    def write(self, peer_session: str, ops: list[WriteOp], timeout_s: float) -> None:
        # timeout_s is accepted for the interface; a local copy cannot hang on a peer.
        if peer_session != self._session_id:
            raise TransportError(f"{self._session_id} cannot reach {peer_session}: an in-process transport only writes to itself")
        devices = set()
        for op in ops:
            source = self._bytes_at(op.local_addr, op.length, peer_session)
            target = self._bytes_at(op.remote_addr, op.length, peer_session)
            target.copy_(source)
            devices.update({source.device, target.device})
        # Bytes must have landed when write returns, as with a remote peer.
        for device in devices - {torch.device("cpu")}:
            torch.accelerator.synchronize(device)

    def close(self) -> None:
        self._registered.clear()

    def _bytes_at(self, addr: int, length: int, peer_session: str) -> torch.Tensor:
        for start, buffer in self._registered.items():
            if start <= addr and addr + length <= start + buffer.numel():
                return buffer[addr - start : addr - start + length]
        raise TransportError(f"write to {peer_session}: [{addr:#x}, +{length}) is not inside a registered tensor")

"""Transport over the Mooncake transfer engine (TCP, RDMA, ...), peers found by P2P handshake."""
from __future__ import annotations

import ipaddress
import socket
import time
from urllib.parse import urlparse

import torch

from weight_sync.transports.base import Transport, TransportError, WriteOp, check_registrable, wrap_transport

# batch_transfer_async_write answers 0 when submission fails, and (batch_id_t)-1 when it cannot
# open a session with the peer; both mean nothing was sent.
_SUBMIT_FAILED = (0, 2**64 - 1, -1)
_DONE, _PENDING, _FAILED = 1, 0, -1  # transfer_check_status codes; -2 is an engine-side timeout
_POLL_S = 0.0005
# Engines of closed transports, kept alive in a process that exits without tearing them down (see
# leave_engines_to_exit).
_LEFT_TO_EXIT: list | None = None


def leave_engines_to_exit() -> None:
    """For a process that ends with os._exit (a server): closing a transport releases its memory but
    leaves its engine to the exit. An engine's destructor joins its handshake listener, which
    polls once a second: up to 1 s (0.5 s on average) with the GIL held, per engine, per stop."""
    global _LEFT_TO_EXIT
    if _LEFT_TO_EXIT is None:
        _LEFT_TO_EXIT = []


def routable_host(toward: str = "") -> str:
    """This machine's address on the route toward `toward` (a URL or host): loopback for a loopback
    peer (or none), else the address peers on other machines can reach, never 127.0.0.1."""
    host = urlparse(toward).hostname if "://" in toward else toward
    try:
        if not host or ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))                # no packet is sent: this only picks the route
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def open_mooncake(host: str, protocol: str = "tcp", device_name: str = "") -> Transport:
    """A Mooncake transport on `host`, through wrap_transport (as the sender, the ranks and the
    servers open theirs)."""
    return wrap_transport(MooncakeTransport(host, protocol, device_name))


class MooncakeTransport(Transport):
    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device_name: str = ""):
        # Imported here so `weight_sync` imports on machines without the Mooncake wheel.
        from mooncake.engine import TransferEngine

        self._engine = TransferEngine()
        if self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name) != 0:
            raise TransportError(f"Mooncake failed to start on {host} (protocol={protocol!r}, device_name={device_name!r})")
        self._session_id = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: dict[int, torch.Tensor] = {}  # keeps registered memory alive

    @property
    def session_id(self) -> str:
        return self._session_id

    def register(self, tensor: torch.Tensor) -> int:
        check_registrable(tensor)
        addr = tensor.data_ptr()
        if self._engine.register_memory(addr, tensor.nbytes) != 0:
            raise TransportError(f"Mooncake could not register {tensor.nbytes} bytes at {addr:#x} on {self._session_id}")
        self._registered[addr] = tensor
        return addr

    def unregister(self, addr: int) -> None:
        if self._registered.pop(addr, None) is None:
            raise KeyError(f"{addr:#x} is not registered with {self._session_id}")
        self._engine.unregister_memory(addr)

    def write(self, peer_session: str, ops: list[WriteOp], timeout_s: float) -> None:
        # One batch per op, polled without blocking: get_batch_transfer_status would spin a core
        # and only honours MC_TRANSFER_TIMEOUT (never under 5 s), not our timeout.
        deadline = time.monotonic() + timeout_s
        pending = [self._submit(peer_session, op) for op in ops]
        while pending:
            pending = [batch for batch in pending if not self._finished(peer_session, batch)]
            if pending and time.monotonic() > deadline:
                # Abandoned batches stay in the engine until the peer answers, dies, or close().
                raise TransportError(f"write to {peer_session} timed out after {timeout_s}s ({len(pending)}/{len(ops)} ops unfinished)")
            time.sleep(_POLL_S)

    def close(self) -> None:
        for addr in list(self._registered):
            self.unregister(addr)
        if _LEFT_TO_EXIT is not None and self._engine is not None:
            _LEFT_TO_EXIT.append(self._engine)
        self._engine = None  # the engine's destructor aborts in-flight transfers and stops its threads

    def _submit(self, peer_session: str, op: WriteOp) -> int:
        batch = self._engine.batch_transfer_async_write(peer_session, [op.local_addr], [op.remote_addr], [op.length])
        if batch in _SUBMIT_FAILED:
            raise TransportError(f"could not start a write of {op.length} bytes to {peer_session} (unreachable peer?)")
        return batch

    def _finished(self, peer_session: str, batch: int) -> bool:
        status = self._engine.transfer_check_status(batch)
        if status in (_DONE, _PENDING):
            return status == _DONE
        raise TransportError(f"write to {peer_session} failed (Mooncake status {status}): peer gone, or its address not registered")

"""Byte movers for weight sync, one per file behind `Transport`."""
from weight_sync.transports.base import Transport, TransportError, WriteOp, wrap_transport
from weight_sync.transports.inprocess import InProcessTransport
from weight_sync.transports.mooncake import MooncakeTransport

__all__ = ["InProcessTransport", "MooncakeTransport", "Transport", "TransportError", "WriteOp", "wrap_transport"]

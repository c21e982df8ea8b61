"""The receiving end of weight sync, inside an inference server: stage, verify, commit.

Shadow mode (default): the shadow set is one registered flat buffer laid out in plan order, so the
sender writes every bucket straight into its final place and the receiver only verifies digests
(no staging copy). Commit swaps pointers between two decode steps, so the stall is the swap. Two
flat buffers alternate as live and shadow. In-place mode (no memory for a shadow): the
engine is paused in place at the first bucket and buckets are copied into the live weights; a
failed update leaves the engine paused and marked torn, never serving a mix of versions.
Fencing: an update must be newer than what is served and than any other update staged.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from inference_server import weights
from inference_server.engine import PauseMode
from weight_sync.bucket import Bucket, TensorSpec, bucket_offsets, digest, flat_views, plan_buckets, unpack
from weight_sync.protocol import (ApplyRequest, CommitReply, CommitRequest, ErrorKind, InFlight, OpenReply,
                                  OpenRequest, SpecMsg)
from weight_sync.transports import Transport

log = logging.getLogger(__name__)


class ReceiverError(Exception):
    def __init__(self, kind: ErrorKind, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class _Flat:
    """A whole set of weights in one registered buffer (plan order); `views` are the tensors."""
    buffer: torch.Tensor
    views: dict[str, torch.Tensor]

    def holds(self, t: torch.Tensor) -> bool:
        start = self.buffer.data_ptr()
        return start <= t.data_ptr() < start + self.buffer.numel()


@dataclass
class _Update:
    version: int
    plan: list[Bucket]
    targets: dict[str, torch.Tensor]
    offsets: list[int] = field(default_factory=list)
    flat: _Flat | None = None               # shadow mode: buckets land here directly
    applied: set[int] = field(default_factory=set)
    prepared: bool = False
    started: float = field(default_factory=time.monotonic)
    paused_at: float | None = None          # in-place mode: when the engine was paused


class Receiver:
    def __init__(self, engine, make_transport, shadow: bool = True, stage_timeout_s: float = 300.0):
        self.engine = engine
        self.shadow = shadow
        self.stage_timeout_s = stage_timeout_s
        self._make_transport = make_transport
        self._transport: Transport | None = None
        self._slots: list[torch.Tensor] = []
        self._shadow: dict[str, torch.Tensor] | None = None   # fallback when a flat layout misaligns
        self._flats: list[_Flat] = []
        self._update: _Update | None = None
        self._lock = threading.Lock()
        self.torn = False                    # in-place update failed half way: weights are mixed

    @property
    def transport(self) -> Transport:
        if self._transport is None:
            self._transport = self._make_transport()
        return self._transport

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec.of(n, p) for n, p in weights.parameters(self.engine.model).items()]

    # ---- protocol steps -------------------------------------------------------------------------
    def open(self, req: OpenRequest) -> OpenReply:
        with self._lock:
            current = self.engine.version
            if req.version <= current and not self.torn and self.engine.has_weights:
                raise ReceiverError(ErrorKind.STALE, f"version {req.version} is not newer than the served {current}")
            staged = self._update
            # The same version again is a retry (its first sender died); an older one is fenced off.
            if staged is not None and staged.version > req.version and not self._expired(staged):
                raise ReceiverError(ErrorKind.STALE, f"version {req.version} is not newer than the staged "
                                                     f"update {staged.version}")
            if staged is not None:
                log.warning("dropping staged update %d for %d from %s", staged.version, req.version, req.sender)
            specs = self.specs()
            plan = plan_buckets(specs, req.bucket_bytes)
            flat = self._spare_flat(specs) if self.shadow else None
            if flat is None:
                self._ensure_slots(max(b.nbytes for b in plan), req.num_slots)
            targets = flat.views if flat is not None else self._targets()
            self._update = _Update(req.version, plan, targets, bucket_offsets(plan), flat)
            return OpenReply(session=self.transport.session_id,
                             slot_addrs=[] if flat is not None else [s.data_ptr() for s in self._slots],
                             direct_base=flat.buffer.data_ptr() if flat is not None else None,
                             specs=[SpecMsg(name=s.name, dtype=s.dtype, shape=list(s.shape)) for s in specs],
                             current_version=current)

    def apply(self, req: ApplyRequest) -> None:
        """Verify bucket `req.bucket` where it landed (its place in the flat shadow, or staging slot
        `req.slot`) and, from a staging slot, copy it into the update's targets."""
        update = self._current(req.version)
        staged = update.flat is None
        if not 0 <= req.bucket < len(update.plan) or (staged and not 0 <= req.slot < len(self._slots)):
            raise ReceiverError(ErrorKind.STATE, f"bucket {req.bucket} / slot {req.slot} out of range")
        bucket = update.plan[req.bucket]
        if not staged:
            start = update.offsets[req.bucket]
            data = update.flat.buffer[start:start + bucket.nbytes]
        else:
            data = self._slots[req.slot][:bucket.nbytes]
        got = digest(data)
        if got != req.digest:
            raise ReceiverError(ErrorKind.DIGEST, f"bucket {req.bucket} of version {req.version}: digest "
                                                  f"{got} != sender's {req.digest}")
        if not self.shadow and update.paused_at is None:
            self.engine.pause(PauseMode.IN_PLACE).result()
            update.paused_at = time.perf_counter()
            self.torn = True                 # from here until commit the live weights are mixed
        if staged:
            unpack(bucket, data, update.targets)
        update.applied.add(req.bucket)

    def prepare(self, version: int) -> None:
        update = self._current(version)
        missing = len(update.plan) - len(update.applied)
        if missing:
            raise ReceiverError(ErrorKind.INCOMPLETE, f"version {version}: {missing} of {len(update.plan)} "
                                                      f"buckets not staged and verified")
        update.prepared = True

    def commit(self, req: CommitRequest) -> CommitReply:
        update = self._current(req.version)
        if not update.prepared:
            raise ReceiverError(ErrorKind.STATE, f"version {req.version} was not prepared")
        aborted = 0
        if req.inflight is InFlight.ABORT:
            aborted = len(self.engine.abort(None).result())
        if self.shadow:
            old = {n: p.data for n, p in weights.parameters(self.engine.model).items()}
            stall = self.engine.swap_weights(update.targets, req.version).result()
            self.engine.free_retired()   # freed here, on this thread, if nothing else holds them
            if update.flat is None:
                self._shadow = old       # the fallback path reuses the old live set as its shadow
        else:
            self.engine.set_version(req.version).result()
            self.engine.resume().result()
            stall = time.perf_counter() - (update.paused_at or time.perf_counter())
            self.torn = False
        with self._lock:
            self._update = None
        return CommitReply(version=req.version, stall_seconds=stall, aborted_requests=aborted)

    def abort(self, version: int) -> None:
        with self._lock:
            if self._update is not None and self._update.version == version:
                self._update = None

    def status(self) -> dict:
        u = self._update
        return {"version": self.engine.version, "mode": "shadow" if self.shadow else "in_place",
                "torn": self.torn, "staged_version": u.version if u else None,
                "buckets_applied": len(u.applied) if u else 0, "buckets": len(u.plan) if u else 0}

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    # ---- helpers --------------------------------------------------------------------------------
    def _current(self, version: int) -> _Update:
        update = self._update
        if update is None or update.version != version:
            staged = update.version if update else None
            raise ReceiverError(ErrorKind.SUPERSEDED, f"version {version} is not the staged update ({staged})")
        return update

    def _expired(self, update: _Update) -> bool:
        return time.monotonic() - update.started > self.stage_timeout_s

    def _ensure_slots(self, nbytes: int, count: int) -> None:
        if len(self._slots) == count and self._slots[0].numel() >= nbytes:
            return
        for s in self._slots:
            self.transport.unregister(s.data_ptr())
        self._slots = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(count)]
        for s in self._slots:
            self.transport.register(s)

    def _spare_flat(self, specs: list[TensorSpec]) -> _Flat | None:
        """A flat buffer that is not being served from, allocating one (at most two exist)."""
        first = next(iter(weights.parameters(self.engine.model).values()))
        for flat in self._flats:
            if not flat.holds(first):
                return flat
        buffer = torch.empty(sum(s.nbytes for s in specs), dtype=torch.uint8, device=first.device)
        views = flat_views(specs, buffer)
        if views is None:                    # mixed dtypes that misalign: fall back to staging slots
            return None
        self.transport.register(buffer)
        self._flats.append(_Flat(buffer, views))
        return self._flats[-1]

    def _targets(self) -> dict[str, torch.Tensor]:
        params = weights.parameters(self.engine.model)
        if not self.shadow:
            return {n: p.data for n, p in params.items()}
        if self._shadow is None:
            self._shadow = {n: torch.empty_like(p) for n, p in params.items()}
        return self._shadow

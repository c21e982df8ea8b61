"""The trainer's side of weight sync: `WeightSync(receivers).push(model, version)`.

Pipelined: while bucket k travels to every receiver, bucket k+1 is packed and the receivers verify
and apply bucket k-1. Local staging is a ring of `num_slots + 1` registered buffers, each receiver's
a ring of `num_slots`; bucket k's local buffer is reused only after every receiver applied it, so a
digest mismatch is retried from it. Every hop has a timeout. A receiver that fails is named; the
update is aborted everywhere (nobody flips) unless `allow_partial`, which drops it and goes on.
Commit is two-phase: all receivers prepare (everything staged and verified), then all flip.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable

import torch

from weight_sync.bucket import DTYPES, Bucket, TensorSpec, as_bytes, bucket_offsets, digest, plan_buckets
from weight_sync.clients import HttpReceiverClient, ReceiverCallError
from weight_sync.protocol import ApplyRequest, CommitRequest, ErrorKind, InFlight, OpenReply, OpenRequest
from weight_sync.transports import Transport, TransportError, WriteOp

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """An update that did not commit; the message names the receiver and what failed."""


@dataclass
class PushStats:
    version: int
    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0
    open_s: float = 0.0
    pack_s: float = 0.0
    transfer_s: float = 0.0
    apply_s: float = 0.0
    commit_s: float = 0.0
    retries: int = 0
    stall_s: dict[str, float] = field(default_factory=dict)
    aborted_requests: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


@dataclass
class _Peer:
    client: object
    reply: OpenReply | None = None
    error: str | None = None


def named_tensors(weights) -> dict[str, torch.Tensor]:
    """A module's state dict, or a mapping / iterable of (name, tensor) as a dict."""
    if isinstance(weights, torch.nn.Module):
        return dict(weights.state_dict(keep_vars=False))
    return dict(weights)


class WeightSync:
    def __init__(self, receivers: Iterable, transport: Transport | None = None, bucket_bytes: int = 256 << 20,
                 num_slots: int = 2, timeout_s: float = 30.0, allow_partial: bool = False, max_retries: int = 2,
                 api_key: str | None = None):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.clients = [HttpReceiverClient(r, timeout_s, api_key) if isinstance(r, str) else r for r in receivers]
        if not self.clients:
            raise ValueError("WeightSync needs at least one receiver")
        if transport is None:
            from weight_sync.transports import MooncakeTransport
            transport = MooncakeTransport()
        self.transport = transport
        self.bucket_bytes, self.num_slots = bucket_bytes, num_slots
        self.timeout_s, self.allow_partial, self.max_retries = timeout_s, allow_partial, max_retries
        self._local: list[torch.Tensor] = []
        self._version: int | None = None
        self._offsets: list[int] = []
        self._pool = ThreadPoolExecutor(max_workers=2 * len(self.clients) + 2, thread_name_prefix="weight-sync")

    # ---- the update, top to bottom ---------------------------------------------------------------
    def push(self, weights, version: int, inflight: InFlight | str = InFlight.CONTINUE) -> PushStats:
        inflight = InFlight(inflight)
        stats, t0 = PushStats(version=version), time.perf_counter()
        self._version = version
        tensors = named_tensors(weights)
        peers = [_Peer(c) for c in self.clients]
        try:
            specs = self._open(peers, version, stats)
            plan = plan_buckets(specs, self.bucket_bytes)
            stats.buckets, stats.bytes = len(plan), sum(b.nbytes for b in plan)
            self._stream(peers, plan, self._sources(tensors, specs), version, stats)
            self._each(peers, lambda p: p.client.prepare(version), "prepare")
            t = time.perf_counter()
            replies = self._each(peers, lambda p: p.client.commit(CommitRequest(version=version, inflight=inflight)),
                                 "commit")
            stats.commit_s = time.perf_counter() - t
        except BaseException:
            self._abort(peers, version)
            raise
        for p, r in replies:
            stats.stall_s[p.client.name], stats.aborted_requests[p.client.name] = r.stall_seconds, r.aborted_requests
        stats.dropped = {p.client.name: p.error for p in peers if p.error}
        stats.seconds = time.perf_counter() - t0
        return stats

    def close(self, close_transport: bool = True) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for c in self.clients:
            c.close()
        for buf in self._local:
            self.transport.unregister(buf.data_ptr())
        self._local = []
        if close_transport:
            self.transport.close()

    # ---- steps -----------------------------------------------------------------------------------
    def _open(self, peers: list[_Peer], version: int, stats: PushStats) -> list[TensorSpec]:
        t = time.perf_counter()
        req = OpenRequest(version=version, bucket_bytes=self.bucket_bytes, num_slots=self.num_slots,
                          sender=self.transport.session_id)
        for p, reply in self._each(peers, lambda p: p.client.open(req), "open"):
            p.reply = reply
        live = [p for p in peers if p.error is None]
        specs = [TensorSpec(s.name, s.dtype, tuple(s.shape)) for s in live[0].reply.specs]
        for p in live[1:]:
            if [TensorSpec(s.name, s.dtype, tuple(s.shape)) for s in p.reply.specs] != specs:
                raise WeightSyncError(f"receiver {p.client.name} serves a different model than "
                                      f"{live[0].client.name}: their weight specs differ")
        stats.open_s = time.perf_counter() - t
        return specs

    def _sources(self, tensors: dict[str, torch.Tensor], specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
        """The trainer's tensors, checked against what receivers need, as contiguous CPU tensors of
        the receivers' dtype (converted here, once, only where they differ)."""
        missing = [s.name for s in specs if s.name not in tensors]
        if missing:
            raise WeightSyncError(f"the pushed weights lack {len(missing)} tensors the servers need, e.g. {missing[:3]}")
        out = {}
        for s in specs:
            t = tensors[s.name].detach()
            if tuple(t.shape) != s.shape:
                raise WeightSyncError(f"tensor {s.name!r} has shape {tuple(t.shape)}; the servers expect {s.shape}")
            if t.device.type != "cpu" or t.dtype != DTYPES[s.dtype] or not t.is_contiguous():
                t = t.to("cpu", DTYPES[s.dtype]).contiguous()
            out[s.name] = t
        return out

    def _stream(self, peers, plan: list[Bucket], sources, version: int, stats: PushStats) -> None:
        self._ensure_local(max(b.nbytes for b in plan))
        self._offsets = bucket_offsets(plan)
        ring = len(self._local)
        packed: dict[int, Future] = {0: self._pool.submit(self._pack, plan[0], sources, 0)} if plan else {}
        applying: dict[int, list[tuple[_Peer, Future]]] = {}
        for k, bucket in enumerate(plan):
            if k - self.num_slots in applying:
                j = k - self.num_slots
                self._settle(j, applying.pop(j), plan[j], version, stats)
            if k + 1 < len(plan):
                packed[k + 1] = self._pool.submit(self._pack, plan[k + 1], sources, (k + 1) % ring)
            pack_s, dig = packed.pop(k).result()
            stats.pack_s += pack_s
            t = time.perf_counter()
            self._each(peers, lambda p: self._write(p, k % ring, k, bucket.nbytes), "transfer")
            stats.transfer_s += time.perf_counter() - t
            applying[k] = [(p, self._pool.submit(self._apply, p, version, k, dig))
                           for p in peers if p.error is None]
        for j in sorted(applying):
            self._settle(j, applying[j], plan[j], version, stats)

    def _pack(self, bucket: Bucket, sources: dict[str, torch.Tensor], slot: int) -> tuple[float, str]:
        t = time.perf_counter()
        out = self._local[slot]
        for piece in bucket.pieces:
            src = sources[piece.name]
            out[piece.bucket_offset:piece.bucket_offset + piece.length].copy_(
                as_bytes(src)[piece.offset:piece.offset + piece.length])
        return time.perf_counter() - t, digest(out[:bucket.nbytes])

    def _write(self, peer: _Peer, local_slot: int, k: int, nbytes: int) -> None:
        """Bucket k from a local slot into the peer: its final place when the peer takes buckets
        directly into its flat shadow, else the peer's staging slot k % num_slots."""
        src = self._local[local_slot]
        reply = peer.reply
        remote = reply.direct_base + self._offsets[k] if reply.direct_base is not None \
            else reply.slot_addrs[k % self.num_slots]
        op = WriteOp(src.data_ptr(), remote, nbytes)
        try:
            self.transport.write(peer.reply.session, [op], self.timeout_s)
        except TransportError as e:
            raise ReceiverCallError(peer.client.name, f"transfer failed: {e}") from None

    def _apply(self, peer: _Peer, version: int, k: int, dig: str) -> float:
        t = time.perf_counter()
        peer.client.apply(ApplyRequest(version=version, bucket=k, slot=k % self.num_slots, digest=dig))
        return time.perf_counter() - t

    def _settle(self, k: int, pending, bucket: Bucket, version: int, stats: PushStats) -> None:
        """Wait for bucket k's applies; a digest mismatch is rewritten from the local slot and retried."""
        local = self._local[k % len(self._local)]
        for peer, fut in pending:
            for attempt in range(self.max_retries + 1):
                try:
                    stats.apply_s += fut.result()
                    break
                except ReceiverCallError as e:
                    if e.kind is not ErrorKind.DIGEST or attempt == self.max_retries:
                        self._fail(peer, e)
                        break
                    log.warning("%s; rewriting bucket %d (attempt %d)", e, k, attempt + 1)
                    stats.retries += 1
                    try:
                        self._write(peer, k % len(self._local), k, bucket.nbytes)
                    except ReceiverCallError as we:
                        self._fail(peer, we)
                        break
                    fut = self._pool.submit(self._apply, peer, version, k, digest(local[:bucket.nbytes]))

    # ---- fan-out and failure ---------------------------------------------------------------------
    def _each(self, peers: list[_Peer], fn, step: str) -> list:
        """Run `fn` on every live peer in parallel; a failure drops the peer or fails the update."""
        live = [p for p in peers if p.error is None]
        futures = [(p, self._pool.submit(fn, p)) for p in live]
        out = []
        for p, f in futures:
            try:
                out.append((p, f.result()))
            except ReceiverCallError as e:
                self._fail(p, e, stale=e.kind is ErrorKind.STALE)
        if not any(p.error is None for p in peers):
            raise WeightSyncError(f"no receiver left after {step}: " +
                                  "; ".join(f"{p.client.name}: {p.error}" for p in peers))
        return out

    def _fail(self, peer: _Peer, error: Exception, stale: bool = False) -> None:
        if not self.allow_partial or stale:
            raise WeightSyncError(str(error)) from None
        peer.error = str(error)
        log.warning("dropping %s from this update: %s", peer.client.name, error)
        self._pool.submit(self._quiet_abort, peer, self._version)

    def _abort(self, peers: list[_Peer], version: int) -> None:
        for f in [self._pool.submit(self._quiet_abort, p, version) for p in peers]:
            f.result()

    @staticmethod
    def _quiet_abort(peer: _Peer, version: int) -> None:
        try:
            peer.client.abort(version)
        except Exception as e:  # best effort: the receiver may be the one that is dead
            log.info("abort on %s failed: %s", peer.client.name, e)

    def _ensure_local(self, nbytes: int) -> None:
        if len(self._local) == self.num_slots + 1 and self._local[0].numel() >= nbytes:
            return
        for buf in self._local:
            self.transport.unregister(buf.data_ptr())
        self._local = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(self.num_slots + 1)]
        for buf in self._local:
            self.transport.register(buf)

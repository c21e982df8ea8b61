"""The bytes of a push on their way: a ring of registered local slots, each bucket packed into one
(or, zero-copy, written straight from the trainer's host tensors) and sent down the fan-out tree
(fanout.py) while the next is packed. WeightSync (sender.py) runs the update around it: open,
prepare, the two-phase commit, the report."""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Mapping

import torch
import xxhash

from platforms import MooncakeArgs, Platform
from weight_sync.bucket import Bucket, as_bytes, host_buffer, pack
from weight_sync.clients import ReceiverCallError
from weight_sync.fanout import Fanout, Hop, depth
from weight_sync.protocol import UpdateRef
from weight_sync.transports import Transport, TransportError, WriteOp

# Below this many bytes a source on average, a bucket is copied into a local slot rather than written from
# where its tensors lie: registering a buffer with the transport (and the overlap check) costs more than
# copying a small one (an adapter's 420 tensors of 37-98 KB: 84 ms to register, 3 ms to copy).
DIRECT_MIN_BYTES = 256 << 10

log = logging.getLogger(__name__)


class Streamer:
    """A sender's registered memory and the streams written from it: the ring of local slots, the
    trainer's tensors registered as write sources (zero-copy), and a direct buffer (sharded.py)."""

    def __init__(self, transport: Transport, mooncake: MooncakeArgs, platform: Platform, num_slots: int,
                 timeout_s: float, max_retries: int, zero_copy: bool = True):
        self.transport, self.mooncake, self.platform = transport, mooncake, platform
        self.num_slots, self.timeout_s, self.max_retries = num_slots, timeout_s, max_retries
        self._local: list[torch.Tensor] = []
        self._direct: dict[int, list[tuple[int, int, int]]] = {}   # bucket -> (address, offset in it, length)
        self._written_from: dict[int, torch.Tensor] = {}   # the last stream's tensors, registered as write sources
        self._retired: dict[int, torch.Tensor] = {}   # sources a timed-out write may still read: kept to the end
        self._write_failed = False
        self.zero_copy = zero_copy                    # host tensors go out as they lie (see _direct_or)
        self._direct_buffer: torch.Tensor | None = None    # see direct_buffer

    def direct_buffer(self, nbytes: int) -> torch.Tensor:
        """A host buffer of at least `nbytes`, registered with the transport and kept for the next
        streams (a larger one replaces it when it is too small): a sharded direct push packs rank
        0's bytes into it."""
        buf = self._direct_buffer
        if buf is None or buf.numel() < nbytes:
            if buf is not None:
                self.transport.unregister(buf.data_ptr())
            buf = self._direct_buffer = host_buffer(nbytes, self.mooncake.alignment)
            self.transport.register(buf)
        return buf

    def stream(self, peers: list, parents: list[int], plan: list[Bucket],
               sources: Callable[[Bucket], Mapping[str, torch.Tensor]], ref: UpdateRef, stats,
               drop: Callable[[object, Exception], None], packer=None, direct: bool = False, keep=None) -> None:
        """Every bucket down the fan-out tree (fanout.py: `parents`, tree_parents' answer, over the
        update's staging `peers`), packing bucket k while earlier ones travel; `stats` (the push's
        PushStats) counts it, `drop(peer, error)` leaves a failed receiver out or raises.
        `sources(bucket)`: the bucket's tensors (contiguous, the receivers' dtype, on the CPU or an
        accelerator), asked for in plan order just before it is packed (a sharded model gathers
        them then). `packer(bucket, sources, slot)`: how a bucket goes into its local slot, (bytes,
        digest, apply fields); whole by default. `direct`: whole buckets of host tensors are written
        from where they lie (the tensors stay referenced until the stream ends). `keep(bucket, sources,
        packed slot or None)`: after each whole bucket (a delta sender's base takes it)."""
        self._release_sources()
        # Bucket k's local slot is free once the whole tree has verified k (a hop whose copy fails
        # is written again from it): one slot per level of relays keeps the trainer writing while
        # earlier buckets travel down the tree, and packing off the critical path.
        self._ensure_local(max(b.nbytes for b in plan), self.num_slots + depth(parents))
        ring, t = len(self._local), time.perf_counter()
        hop = Hop(self._write, drop, self.timeout_s, self.max_retries)
        with ThreadPoolExecutor(Fanout.pool_size(len(peers), ring), thread_name_prefix="weight-sync-fanout") as pool:
            fan = Fanout(peers, parents, self.num_slots, ring, ref, hop, pool)
            moving: list[Future] = []
            try:
                for k, bucket in enumerate(plan):
                    fan.take_local(k)
                    for f in moving:
                        if f.done():
                            f.result()       # an update that cannot go on stops here
                    t_pack = time.perf_counter()
                    srcs, slot = sources(bucket), self._local[k % ring]
                    if packer is not None:
                        nbytes, dig, extra = packer(bucket, srcs, slot)
                    else:
                        nbytes, dig, extra = self._direct_or(bucket, srcs, k, slot) if direct else \
                            (bucket.nbytes, pack(bucket, srcs, slot), None)
                        if keep is not None:
                            keep(bucket, srcs, None if k in self._direct else slot)
                    stats.pack_s += time.perf_counter() - t_pack
                    stats.wire_bytes += nbytes
                    moving.append(pool.submit(fan.bucket, k, nbytes, dig, extra))
                for f in moving:
                    f.result()
            except BaseException as e:       # buckets still moving give up, so the pool can close
                fan.failed = fan.failed or e
                raise
            finally:
                pool.shutdown(wait=True)     # every write returned or timed out: sources may go
                self._release_sources()
        stats.transfer_s += time.perf_counter() - t
        stats.apply_s += fan.apply_s
        stats.retries += fan.retries
        stats.egress_bytes += fan.egress_bytes

    def _direct_or(self, bucket: Bucket, sources: Mapping[str, torch.Tensor], k: int, slot: torch.Tensor):
        """A whole bucket of host tensors goes straight from them into the receivers' slots, its
        digest taken of them in place: no copy into a local slot, which took a core the transfer
        needs (a 1 GB push on 2 cores: 0.82 -> 0.9x raw Mooncake). Tensors on an accelerator, or
        sharing memory with another source, are packed into `slot`."""
        fresh = {id(t): t for t in sources.values() if t.data_ptr() not in self._written_from}.values()
        if fresh and bucket.nbytes < DIRECT_MIN_BYTES * len(fresh):
            return bucket.nbytes, pack(bucket, sources, slot), None
        for t in fresh:
            if not self._registered(t):
                return bucket.nbytes, pack(bucket, sources, slot), None
        h, ops = xxhash.xxh3_128(), []
        for p in bucket.pieces:
            src = sources[p.name]
            h.update(as_bytes(src)[p.offset:p.offset + p.length].numpy())
            ops.append((src.data_ptr() + p.offset, p.bucket_offset, p.length))
        self._direct[k] = ops
        return bucket.nbytes, h.hexdigest(), None

    def _registered(self, t: torch.Tensor) -> bool:
        """`t` registered as a write source for this stream; False where it cannot be (off, not host
        memory, overlapping another registration, refused by the transport): then it is packed."""
        retired = self._retired.get(t.data_ptr())
        if retired is not None and retired.nbytes >= t.nbytes:   # still registered since a failed write
            return True
        start, end = t.data_ptr(), t.data_ptr() + t.nbytes
        if not self.zero_copy or t.device.type != "cpu" or any(
                a < end and start < a + s.nbytes for a, s in (*self._written_from.items(), *self._retired.items())):
            return False
        try:
            self.transport.register(t)
        except TransportError as e:
            log.info("packing instead of writing in place: %s", e)
            return False
        self._written_from[t.data_ptr()] = t
        return True

    def _release_sources(self) -> None:
        """Before a stream: the last one's sources are no write's any more, unless a write of it
        failed (a timed-out write may still read them until its peer answers): those stay
        registered and alive until close."""
        self._direct.clear()
        for addr, t in self._written_from.items():
            if self._write_failed:
                self._retired[addr] = t
            else:
                self.transport.unregister(addr)
        self._written_from, self._write_failed = {}, False

    def _write(self, peer, local_slot: int, k: int, nbytes: int) -> None:
        """Bucket k from a local slot (or straight from the trainer's tensors) into the peer's
        staging slot k % num_slots."""
        remote = peer.reply.slot_addrs[k % self.num_slots]
        direct = self._direct.get(k)
        ops = [WriteOp(a, remote + off, n) for a, off, n in direct] if direct else \
            [WriteOp(self._local[local_slot].data_ptr(), remote, nbytes)]
        try:
            self.transport.write(peer.reply.session, ops, self.timeout_s)
        except TransportError as e:
            self._write_failed = True
            raise ReceiverCallError(peer.name, f"transfer failed: {e}") from None

    def _ensure_local(self, nbytes: int, ring: int) -> None:
        if len(self._local) == ring and self._local[0].numel() >= nbytes:
            return
        for buf in self._local:
            self.transport.unregister(buf.data_ptr())
        # Page-locked on a machine with an accelerator: the trainer's tensors come over by DMA.
        self._local = [host_buffer(nbytes, self.mooncake.alignment, self.platform.accelerator)
                       for _ in range(ring)]
        for buf in self._local:
            self.transport.register(buf)

    def close(self) -> None:
        """Unregister every buffer and source this streamer registered (the transport stays open)."""
        for buf in self._local:
            self.transport.unregister(buf.data_ptr())
        self._local = []
        self._write_failed = False
        self._release_sources()

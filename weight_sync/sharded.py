"""Weight sync from a sharded trainer: FSDP2 (`fully_shard`: DTensor parameters) on every rank of a
torch.distributed job, without gathering the model.

Every rank calls `push_sharded(model, version, sync, state=state)`; rank 0 passes its `WeightSync`
(it talks to the servers: open, prepare, two-phase commit, exactly as `WeightSync.push`), the other
ranks None; each rank passes its own `RankState` (what it keeps between pushes: its transfer
engine and registered buffer, its delta base), the same one at every push.

`direct` (the default): each rank writes what it holds straight into the servers' staging slots.
A parameter sharded on dim 0 (FSDP2's layout) is a contiguous run of rows of the full tensor, so a
rank's shard of a bucket is a few contiguous byte ranges of it: the rank packs them into one local
bucket-sized buffer, hashing each range, and writes them with its own transfer engine (its own NIC)
to their offsets in the slots of the servers the trainer feeds (every server in a star; the root
of a chain, the roots of a tree, which verify the bucket and relay it on). Parameters that are not sharded on dim 0 (plain tensors,
other placements) are written by rank 0, those with another placement gathered for their bucket
only. Rank 0 collects every rank's ranges and hashes (a small gather per bucket) and sends the
receivers a parts digest (bucket.py): each range checked on its own, the ranges covering the bucket.
Bucket k + num_slots is written only once every server has verified bucket k. A rank's extra memory
is one bucket (its staging buffer), plus a dtype conversion of its own shard where the servers'
dtype differs. A server whose relay is lost mid-bucket leaves that push (the ranks have moved on
to the next bucket and cannot write it again); the push commits on the rest under `min_fraction`.

`gather`: the sharded parameters are gathered bucket by bucket, in the plan's order, by all ranks
together (`DTensor.full_tensor()` is a collective), and rank 0 streams them as a plain push; a
gathered parameter is dropped once its last piece is packed. Every byte goes through rank 0.

Before each bucket rank 0 tells the others what to do (or that the push stopped); at the end, the
outcome, so every rank returns the same stats or raises the same error. A rank that dies mid-push
fails the collective on rank 0, which aborts the update: every server keeps its old version.
"""
from __future__ import annotations

import enum
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Callable

import torch

from weight_sync import named_weights
from platforms import MooncakeArgs
from weight_sync.bucket import (Bucket, TensorSpec, as_bytes, copy_hashed, digest, format_parts_digest,
                                host_buffer, plan_buckets, to_host)
from weight_sync.delta import DeltaBase, apply_diff, diff_piece, width, write_delta
from weight_sync.clients import ReceiverCallError
from weight_sync.fanout import TRAINER, Fanout, Hop, tree_parents
from weight_sync.protocol import Encoding, InFlight, UpdateRef
from weight_sync.sender import Peer, PushStats, WeightSync, WeightSyncError, check_weights
from weight_sync.transports import Transport, TransportError, WriteOp

log = logging.getLogger(__name__)
class Say(str, enum.Enum):
    """What rank 0 tells the other ranks during a sharded push: (Say, body)."""
    PLAN = "plan"          # body: the mode
    GATHER = "gather"      # gather-then-push: the names of the next bucket's tensors (full_tensor)
    SPECS = "specs"        # direct: (specs, bucket_bytes, timeout_s, mooncake, delta): build the rank's writer
    WRITE = "write"        # direct: (bucket k, targets, delta base): write this rank's bytes of bucket k
    DONE = "done"          # body: the push's stats (and its update id: the ranks' next delta base)
    FAILED = "failed"      # body: why


MODES = ("direct", "gather")


def _dtensor_type():
    from torch.distributed.tensor import DTensor
    return DTensor


def is_sharded(model_or_weights) -> bool:
    """Whether any of the weights is a DTensor (the model was sharded with fully_shard)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return False
    dtensor = _dtensor_type()
    return any(isinstance(t, dtensor) for t in named_weights(model_or_weights).values())


class _GatherPush:
    """Rank 0's side of a gather push: a plain WeightSync stream whose sharded tensors are gathered
    (with the other ranks) as the sender packs each bucket, and let go after their last piece."""

    def __init__(self, sync: WeightSync, tensors: dict[str, torch.Tensor], group):
        self.sync, self.tensors, self.group = sync, tensors, group
        self._dtensor = _dtensor_type()
        self._held: dict[str, torch.Tensor] = {}        # gathered, CPU, the receivers' dtype
        self._last: dict[str, int] = {}                 # name -> index of the bucket of its last piece
        self._dtypes: dict[str, torch.dtype] = {}
        self.peak_held_bytes = 0

    def push(self, version: int, inflight: InFlight) -> PushStats:
        return self.sync.run_update(version, inflight, self._stage)

    def _stage(self, staging: list[Peer], specs: list[TensorSpec], ref: UpdateRef, stats: PushStats) -> None:
        self._dtypes = check_weights(self.tensors, specs)
        plan = self.sync.plan(specs, stats)
        self._last = {p.name: b.index for b in plan for p in b.pieces}
        self.sync.stream(staging, plan, self._bucket, ref, stats)
        stats.peak_gathered_bytes = self.peak_held_bytes

    def _bucket(self, bucket: Bucket) -> dict[str, torch.Tensor]:
        """The bucket's tensors as contiguous CPU tensors of the receivers' dtype; its sharded ones
        gathered now, every rank told first which ones."""
        names = list(dict.fromkeys(p.name for p in bucket.pieces))
        gather = [n for n in names if n not in self._held and isinstance(self.tensors[n], self._dtensor)]
        announce((Say.GATHER, gather), self.group)
        out = {}
        for n in names:
            if n in self._held:
                out[n] = self._held[n]
                continue
            t = self.tensors[n].detach()
            if isinstance(t, self._dtensor):
                t = t.full_tensor()
            t = _host(t, self._dtypes[n])
            out[n] = t
            if self._last[n] > bucket.index:                # a tensor cut across buckets: kept until its last
                self._held[n] = t
        self.peak_held_bytes = max(self.peak_held_bytes, sum(t.nbytes for t in out.values()))
        for n in [n for n in self._held if self._last[n] <= bucket.index]:
            del self._held[n]
        return out


def _host(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in host memory as the servers' dtype (converted where it lies: on an accelerator the
    device converts, and half the bytes of an fp32 -> bf16 push cross to the host)."""
    return to_host(t.to(dtype) if t.dtype != dtype else t)


def announce(message, group=None) -> None:
    """Rank 0 (the group's first rank) tells every rank of `group` one picklable message."""
    torch.distributed.broadcast_object_list([message], src=_src(group), group=group)


def listen(group=None):
    """What rank 0 of `group` announced (every other rank calls this while rank 0 announces)."""
    box = [None]
    torch.distributed.broadcast_object_list(box, src=_src(group), group=group)
    return box[0]


def _src(group) -> int:
    """The global rank of the group's first rank (rank 0 of the job for the default group)."""
    return torch.distributed.get_global_rank(group, 0) if group is not None else 0


def push_sharded(model, version: int, sync: WeightSync | None = None, inflight: InFlight | str = InFlight.CONTINUE,
                 mode: str = "direct", group=None, state: RankState | None = None) -> PushStats:
    """Push a sharded model's weights as `version`; call it on every rank, with rank 0's WeightSync
    on rank 0 and None elsewhere, and the same `mode` everywhere (direct | gather, see above).
    `state`: this rank's RankState, the same one at every push (its delta base, and on the other
    ranks its transfer engine); without one the push keeps nothing for the next (the rank sends
    no deltas, and starts and closes an engine of its own). Returns the push's stats on every rank
    (the others get rank 0's summary), or raises WeightSyncError on every rank."""
    if mode not in MODES:
        raise ValueError(f"push_sharded: mode={mode!r} is not one of {', '.join(MODES)}")
    rank = torch.distributed.get_rank(group)
    if (rank == 0) != (sync is not None):
        raise ValueError(f"push_sharded on rank {rank}: rank 0 passes its WeightSync, the other ranks None "
                         f"(got {'one' if sync is not None else 'None'})")
    tensors = named_weights(model)
    own = state is None
    state = RankState() if own else state
    try:
        if rank != 0:
            return _follow(tensors, mode, group, state)
        return _lead(sync, tensors, version, inflight, mode, group, state)
    finally:
        if own:
            state.close()


def _lead(sync: WeightSync, tensors: dict[str, torch.Tensor], version: int, inflight: InFlight | str, mode: str, group,
          state: RankState) -> PushStats:
    """Rank 0: the push, every other rank told what to do and how it ended."""
    announce((Say.PLAN, mode), group)
    t0 = time.perf_counter()
    try:
        if mode == "direct":
            stats = _DirectPush(sync, tensors, group, state).push(version, InFlight(inflight))
        else:
            stats = _GatherPush(sync, tensors, group).push(version, InFlight(inflight))
    except BaseException as e:
        try:
            announce((Say.FAILED, f"{type(e).__name__}: {e}"), group)
        except Exception:     # a rank that died mid-push is why it failed: the others learn it from the group
            pass
        raise
    announce((Say.DONE, {"version": stats.version, "bytes": stats.bytes, "buckets": stats.buckets,
                   "seconds": time.perf_counter() - t0, "serving": stats.serving, "update_id": sync.update_id,
                   "wire_bytes": stats.wire_bytes, "modes": stats.modes, "changed_fraction": stats.changed_fraction}),
             group)
    return stats


def _follow(tensors: dict[str, torch.Tensor], mode: str, group, state: RankState) -> PushStats:
    """A rank other than 0: do what rank 0 says, bucket by bucket, until it says how it ended."""
    kind, body = listen(group)
    if kind is Say.FAILED:
        raise WeightSyncError(f"the push failed on rank 0: {body}")
    if kind is not Say.PLAN or body not in MODES:
        raise WeightSyncError(f"push_sharded: rank 0 said {kind!r} where a plan was due (ranks out of step)")
    if body != mode:
        log.info("push_sharded: rank 0 pushes with mode %s", body)
    dtensor = _dtensor_type()
    writer: _RankWriter | None = None
    peak = 0
    while True:
        kind, body = listen(group)
        if kind is Say.FAILED and writer is not None and writer.base is not None:
            writer.base.forget()                 # it may hold part of the failed push
        if kind is Say.GATHER:
            held = [tensors[n].detach().full_tensor() for n in body if isinstance(tensors[n], dtensor)]
            peak = max(peak, sum(t.nbytes for t in held))
            del held
        elif kind is Say.SPECS:
            specs, bucket_bytes, timeout_s, mooncake, delta = body
            specs = [TensorSpec(*s) for s in specs]
            writer = _RankWriter(tensors, group, plan_buckets(specs, bucket_bytes), check_weights(tensors, specs),
                                 bucket_bytes, timeout_s, partial(state.writer, mooncake=mooncake),
                                 base=state.base(specs) if delta else None)
        elif kind is Say.WRITE:
            k, targets, delta_base = body
            _gather(writer.write(k, targets, delta_base), group)
        elif kind is Say.DONE:
            if writer is not None and writer.base is not None:
                writer.base.update_id = body["update_id"]
            stats = PushStats(version=body["version"], bytes=body["bytes"], buckets=body["buckets"],
                              seconds=body["seconds"], serving=body["serving"], modes=body["modes"],
                              wire_bytes=body["wire_bytes"], changed_fraction=body["changed_fraction"])
            stats.peak_gathered_bytes = max(peak, writer.peak_gathered_bytes if writer else 0)
            return stats
        else:
            raise WeightSyncError(f"the push failed on rank 0: {body}")


# ---- direct: every rank writes its own bytes ---------------------------------------------------------
def _shard0_rows(t) -> tuple[int, int] | None:
    """Rows [start, end) of the full tensor held by this rank's local shard, when `t` is sharded on
    dim 0 over a 1-D mesh (FSDP2's layout: torch.chunk's split); None for any other layout."""
    from torch.distributed.tensor import Shard
    if t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
        return None
    n, world, r = t.shape[0], t.device_mesh.size(), t.device_mesh.get_local_rank()
    chunk = -(-n // world)
    start = min(n, r * chunk)
    end = min(n, start + chunk)
    return (start, end) if t.to_local().shape[0] == end - start else None


class RankState:
    """What one rank keeps from one sharded push to the next: its delta bases (its own bytes of every
    tensor as the last committed push wrote them, by model) and, on a rank other than 0, its transfer
    engine and registered buffer (by the address it writes from; rank 0 writes with its WeightSync's).
    Each rank makes one and passes it to every push_sharded call; two in one process share nothing."""

    def __init__(self):
        self._bases: dict[tuple[TensorSpec, ...], DeltaBase] = {}
        self._writers: dict[str, tuple[Transport, torch.Tensor]] = {}

    def base(self, specs: list[TensorSpec]) -> DeltaBase:
        """The delta base for the model of these specs."""
        return self._bases.setdefault(tuple(specs), DeltaBase())

    def writer(self, toward: str, nbytes: int, mooncake: MooncakeArgs) -> tuple[Transport, torch.Tensor]:
        """This rank's transfer engine and a registered buffer of at least `nbytes`, kept for the
        next pushes: one engine per address, the one that routes toward the servers (`toward`),
        started as rank 0's (`mooncake`: protocol, devices, alignment)."""
        from weight_sync.transports.mooncake import open_mooncake, routable_host
        host = routable_host(toward.rsplit(":", 1)[0])
        transport, buf = self._writers[host] if host in self._writers else (
            open_mooncake(host, mooncake.protocol, mooncake.device_name), None)
        if buf is None or buf.numel() < nbytes:
            if buf is not None:
                transport.unregister(buf.data_ptr())
            buf = host_buffer(nbytes, mooncake.alignment)
            transport.register(buf)
        self._writers[host] = (transport, buf)
        return transport, buf

    def close(self) -> None:
        """Unregister the buffers and close the engines this state started."""
        for transport, buf in self._writers.values():
            transport.unregister(buf.data_ptr())
            transport.close()
        self._writers.clear()


class _RankWriter:
    """One rank's part of a direct push: its bytes of each bucket, packed and hashed into its local
    buffer, written to their offsets in every server's slot. `engine(toward, nbytes)`: the rank's
    transfer engine and a registered buffer of at least nbytes (toward: a server's address)."""

    def __init__(self, tensors: dict[str, torch.Tensor], group, plan: list[Bucket], dtypes: dict[str, torch.dtype],
                 bucket_bytes: int, timeout_s: float, engine: Callable[[str, int], tuple[Transport, torch.Tensor]],
                 base: DeltaBase | None = None):
        self.tensors, self.group, self.plan, self.dtypes = tensors, group, plan, dtypes
        self.base = base                     # delta sync: this rank's bytes as the last push left them
        self.bucket_bytes, self.timeout_s, self.engine = bucket_bytes, timeout_s, engine
        self.rank = torch.distributed.get_rank(group)
        self._dtensor = _dtensor_type()
        self._last = {p.name: b.index for b in self.plan for p in b.pieces}
        self._local: dict[str, tuple[torch.Tensor, int]] = {}    # name -> (flat bytes in the servers' dtype, first byte)
        self.peak_gathered_bytes = 0

    def _bytes(self, name: str) -> tuple[torch.Tensor, int] | None:
        """This rank's bytes of tensor `name` (flat uint8, the servers' dtype) and the byte of the
        full tensor they start at; None when another rank writes it (rank 0 writes what is not
        sharded on dim 0)."""
        if name not in self._local:          # once per tensor, on every rank alike (a gather is collective)
            self._local[name] = self._take(name)
        return self._local[name]

    def _take(self, name: str) -> tuple[torch.Tensor, int] | None:
        t, dtype = self.tensors[name].detach(), self.dtypes[name]
        if isinstance(t, self._dtensor):
            rows = _shard0_rows(t)
            if rows is None:                   # another placement: gathered, for as long as its buckets last
                t, start = t.full_tensor(), 0
                self.peak_gathered_bytes = max(self.peak_gathered_bytes, t.nbytes)
                if self.rank != 0:
                    return None
            else:
                start = rows[0] * math.prod(t.shape[1:]) * dtype.itemsize
                t = t.to_local()
        elif self.rank != 0:
            return None
        else:
            start = 0
        return as_bytes(_host(t, dtype)), start

    def write(self, k: int, targets: list[tuple[str, int]], delta_base: str | None = None) -> tuple:
        """Bucket k's bytes this rank holds into every target (session, slot address); with
        `delta_base` (the update every target serves), each range this rank's base holds as that
        update left it goes as a delta where that pays. Returns the parts written (bucket offset,
        length, xxh3 of the new bytes[, delta bytes]), the targets whose write failed (index -> why),
        the bytes this rank sent, and (elements changed, compared)."""
        bucket = self.plan[k]
        room = self.bucket_bytes + 8 * max(len(b.pieces) for b in self.plan)    # ranges start 8-aligned
        transport, buf = self.engine(targets[0][0] if targets else "127.0.0.1", room)
        delta = delta_base is not None and self.base is not None and self.base.update_id == delta_base
        parts, ops, at, changed = [], [], 0, [0, 0]
        for p in bucket.pieces:
            mine = self._bytes(p.name)
            if mine is not None:
                data, start = mine
                lo, hi = max(start, p.offset), min(start + data.numel(), p.offset + p.length)
                if lo < hi:
                    part, n = self._range(p, data, start, lo, hi, buf[at:], delta, changed)
                    parts.append(part)
                    ops.append((at, part[0], n))
                    at += -(-n // 8) * 8
            if self._last[p.name] <= k:
                self._local.pop(p.name, None)
        errors, sent = {}, 0
        if ops:
            base = buf.data_ptr()
            for i, (session, addr) in enumerate(targets):
                try:
                    transport.write(session, [WriteOp(base + a, addr + b, n) for a, b, n in ops], self.timeout_s)
                    sent += sum(n for _, _, n in ops)
                except TransportError as e:
                    errors[i] = f"rank {self.rank}: {e}"
        return parts, errors, sent, tuple(changed)

    def _range(self, p, data: torch.Tensor, start: int, lo: int, hi: int, out: torch.Tensor, delta: bool,
               changed: list[int]) -> tuple[tuple, int]:
        """Bytes [lo, hi) of piece p's tensor (this rank holds them from byte `start` of it) into
        `out`, as a delta against the base or whole; the base takes the new bytes. Returns the part
        and the bytes used."""
        new = data[lo - start:hi - start]
        old = self.base.view(p.name, data)[lo - start:hi - start] if self.base is not None else None
        offset = p.bucket_offset + lo - p.offset
        if delta:
            d = diff_piece(p.name, new, old, width(self.dtypes[p.name], lo, hi - lo))
            changed[0], changed[1] = changed[0] + d.index.numel(), changed[1] + d.elements
            if d.nbytes <= self.base.max_fraction * (hi - lo):
                n = write_delta([d], out)
                apply_diff(d, old)
                return (offset, hi - lo, digest(new), n), n
        h = copy_hashed([(out[:hi - lo], new)])
        if old is not None:
            old.copy_(new)
        return (offset, hi - lo, h), hi - lo


def _gather(obj, group) -> list | None:
    dist = torch.distributed
    rank = dist.get_rank(group)
    out = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(obj, out, dst=_src(group), group=group)
    return out


class _DirectPush:
    """Rank 0's side of a direct push: WeightSync's open, prepare and commit around buckets every
    rank writes."""

    def __init__(self, sync: WeightSync, tensors: dict[str, torch.Tensor], group, state: RankState):
        self.sync, self.tensors, self.group, self.state = sync, tensors, group, state
        self.base: DeltaBase | None = None

    def push(self, version: int, inflight: InFlight) -> PushStats:
        try:
            stats = self.sync.run_update(version, inflight, self._stage)
        except BaseException:
            if self.base is not None:
                self.base.forget()
            raise
        if self.base is not None:
            self.base.update_id = self.sync.update_id
        return stats

    def _stage(self, staging: list[Peer], specs: list[TensorSpec], ref: UpdateRef, stats: PushStats) -> None:
        sync = self.sync
        dtypes = check_weights(self.tensors, specs)
        plan = sync.plan(specs, stats)
        wire = [(s.name, s.dtype, s.shape) for s in specs]
        delta = sync.base is not None
        announce((Say.SPECS, (wire, sync.bucket_bytes, sync.timeout_s, sync.mooncake, delta)), self.group)
        self.base = self.state.base(specs) if delta else None
        writer = _RankWriter(self.tensors, self.group, plan, dtypes, sync.bucket_bytes, sync.timeout_s,
                             lambda toward, nbytes: (sync.transport, sync.direct_buffer(nbytes)), base=self.base)
        self._stream(staging, writer, ref, stats)
        stats.peak_gathered_bytes = writer.peak_gathered_bytes

    def _delta_base(self, peers: list[Peer], stats: PushStats) -> str | None:
        """The update the ranks send deltas against: theirs, when every server serves it (a rank
        still sends whole what its own base does not hold); else None, whole everywhere."""
        base = self.base.update_id if self.base is not None else None
        delta_base = base if base is not None and all(p.reply.live_update == base for p in peers) else None
        for p in peers:
            stats.modes[p.name] = "delta" if delta_base else "full"
        return delta_base

    def _collect(self, bucket: Bucket, results: list, live: list[Peer], delta_base: str | None, stats: PushStats,
                 changed: list[int]) -> tuple[str, dict | None]:
        """Every rank's report of a bucket: counted, its failed writes' servers dropped; returns the
        bucket's parts digest and its apply fields (a delta's, when a range went as one)."""
        parts = [part for r in results for part in r[0]]
        stats.wire_bytes += sum(part[3] if len(part) > 3 else part[1] for part in parts)
        if not stats.egress_by_rank:
            stats.egress_by_rank = [0] * len(results)
        for rank, (_, failed, sent, (diffs, compared)) in enumerate(results):
            changed[0], changed[1] = changed[0] + diffs, changed[1] + compared
            stats.egress_bytes += sent
            stats.egress_by_rank[rank] += sent
            for i, why in failed.items():
                self.sync.drop_peer(live[i], ReceiverCallError(live[i].name, f"transfer failed: {why}"))
        deltas = any(len(part) > 3 for part in parts)
        stats.delta_buckets += deltas
        return (format_parts_digest(parts, bucket.nbytes),
                dict(encoding=Encoding.DELTA, base_update=delta_base) if deltas else None)

    def _stream(self, peers: list[Peer], writer: _RankWriter, ref: UpdateRef, stats: PushStats) -> None:
        sync, n = self.sync, self.sync.num_slots
        written: dict[int, set[int]] = {}      # bucket -> the servers the ranks wrote it into
        delta_base = self._delta_base(peers, stats)
        changed = [0, 0]

        def hop_write(peer: Peer, local_slot: int, k: int, nbytes: int) -> None:
            """The fan-out's trainer -> server write: the ranks did it already, into the servers
            the trainer feeds. A server the trainer takes over (its relay was lost) cannot get
            the bucket from the ranks again (they are on the next one): it leaves this push."""
            if id(peer) not in written.get(k, ()):
                raise ReceiverCallError(peer.name, f"its relay was lost with bucket {k}, which the trainer's ranks "
                                                   f"wrote only into the servers they feed (direct sharded push)")

        hop = Hop(hop_write, sync.drop_peer, sync.timeout_s, 0)
        t = time.perf_counter()
        with ThreadPoolExecutor(Fanout.pool_size(len(peers), n), thread_name_prefix="weight-sync-sharded") as pool:
            # A ring of num_slots "local" slots: bucket k starts once bucket k - num_slots has been
            # verified everywhere, which is when every server's slot k % num_slots is free again.
            # The ranks write into the tree's roots (every server in a star); relays do the rest.
            fan = Fanout(peers, tree_parents(len(peers), sync.topology, sync.fan_out, buckets=len(writer.plan)), n, n, ref, hop, pool)
            moving = []
            try:
                for k, bucket in enumerate(writer.plan):
                    fan.take_local(k)
                    for f in moving:
                        if f.done():
                            f.result()
                    live = [peers[i] for i in fan.children(TRAINER)]
                    written[k] = {id(p) for p in live}
                    targets = [(p.reply.session, p.reply.slot_addrs[k % n]) for p in live]
                    announce((Say.WRITE, (k, targets, delta_base)), self.group)
                    results = _gather(writer.write(k, targets, delta_base), self.group)
                    digest, extra = self._collect(bucket, results, live, delta_base, stats, changed)
                    moving.append(pool.submit(fan.bucket, k, bucket.nbytes, digest, extra))
                for f in moving:
                    f.result()
            except BaseException as e:
                fan.failed = fan.failed or e
                raise
        stats.transfer_s = time.perf_counter() - t
        stats.apply_s, stats.retries = fan.apply_s, fan.retries
        if delta_base:
            stats.changed_fraction = changed[0] / max(1, changed[1])

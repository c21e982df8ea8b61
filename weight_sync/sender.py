"""The trainer's side of weight sync: `WeightSync(receivers).push(model, version)`.

Pipelined (streaming.py): bucket k+1 is packed while bucket k travels down the fan-out tree (`fanout.py`: a star,
or a chain / tree where receivers relay each bucket onward, so the trainer writes it once) and
receivers copy and verify it. Local staging is a ring of `num_slots` + (levels of the tree) registered
buffers, each receiver's a ring of `num_slots` staging slots; bucket k's local buffer is reused only once every
receiver verified it, so a digest mismatch anywhere is rewritten from it. Every hop has a timeout.
A receiver that fails before the decision is named and dropped while at least `min_fraction` of
the fleet remains (else the update is aborted everywhere and nobody flips; the aborts go out in
the background, so a frozen receiver costs one hop timeout, not two).

Commit is two-phase: all remaining receivers prepare (everything staged and verified), then the
outcome is commit, whatever happens next. A receiver that does not confirm its commit is reported
(`stats.pending`; the push raises CommitIncomplete when fewer than `min_fraction` confirmed) and the
commit is offered to it again in the background; it also asks its peers. Pushing the same version
again completes it: receivers already serving the version answer so at open and are left alone.
"""
from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import torch

from weight_sync import live_digest, named_weights
from platforms import detect
from weight_sync.bucket import DTYPES, Bucket, TensorSpec, pack, plan_buckets
from weight_sync.clients import HttpReceiverClient, ReceiverCallError
from weight_sync.fanout import AUTO, tree_parents
from weight_sync.delta import DeltaBase
from weight_sync.protocol import (AdapterMsg, CommitRequest, Encoding, ErrorKind, InFlight, OpenReply, OpenRequest,
                                  PrepareRequest, SpecMsg, UpdateRef)
from weight_sync.streaming import Streamer
from weight_sync.transports import Transport

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """An update that did not commit everywhere; the message names the receiver and what failed."""

    def __init__(self, message: str, stats: "PushStats | None" = None):
        super().__init__(message)
        self.stats = stats


class CommitIncomplete(WeightSyncError):
    """Every receiver prepared, so the version is committed; some did not confirm it (yet).
    `stats.serving` says who serves what as far as the sender knows, `stats.pending` who is missing."""


def check_weights(tensors: Mapping[str, torch.Tensor], specs: list[TensorSpec]) -> dict[str, torch.dtype]:
    """The pushed weights against what the receivers need (names and shapes; a DTensor's shape is
    the full one); returns the receivers' dtype of each."""
    missing = [s.name for s in specs if s.name not in tensors]
    if missing:
        raise WeightSyncError(f"the pushed weights lack {len(missing)} tensors the servers need, e.g. {missing[:3]}")
    for s in specs:
        shape = tuple(tensors[s.name].shape)
        if shape != s.shape:
            raise WeightSyncError(f"tensor {s.name!r} has shape {shape}; the servers expect {s.shape}")
    return {s.name: DTYPES[s.dtype] for s in specs}


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
    egress_bytes: int = 0          # what the trainer itself wrote (relay: ~bytes; star: ~bytes x receivers)
    egress_by_rank: list[int] = field(default_factory=list)   # sharded direct push: what each rank wrote
    peak_gathered_bytes: int = 0   # the most gathered at once (about a bucket's parameters)
    stall_s: dict[str, float] = field(default_factory=dict)
    aborted_requests: dict[str, int] = field(default_factory=dict)
    serving: dict[str, int | None] = field(default_factory=dict)   # receiver -> version it serves (None: unknown)
    pending: dict[str, str] = field(default_factory=dict)          # committed here, unconfirmed there: why
    dropped: dict[str, str] = field(default_factory=dict)          # left out of the update (min_fraction)
    modes: dict[str, str] = field(default_factory=dict)            # receiver -> "delta" | "full"
    wire_bytes: int = 0            # bytes of the update as it travelled to each receiver, summed over the passes
    delta_buckets: int = 0         # buckets sent as deltas (others went whole)
    changed_fraction: float | None = None   # elements changed / compared, over the delta buckets
    merge_s: float = 0.0           # adapter pushes: the slowest receiver's merge into its base
    model_bytes: int = 0           # adapter pushes: the whole weights' bytes as the receivers hold them

    @property
    def wire_fraction(self) -> float:
        """Bytes on the wire to a receiver over the model's bytes (1.0: a full push)."""
        return self.wire_bytes / self.bytes if self.bytes else 0.0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


@dataclass
class Peer:
    """A receiver as one update sees it: its open reply, and why it left the update if it did."""
    client: object
    reply: OpenReply | None = None
    current: bool = False          # already serves the pushed version: nothing to send it
    served: dict | None = None     # then: the digest and specs of the weights serving it
    error: str | None = None

    @property
    def name(self) -> str:
        return self.client.name

    @property
    def staging(self) -> bool:
        return self.error is None and self.reply is not None


class WeightSync:
    def __init__(self, receivers: Iterable, transport: Transport | None = None, bucket_bytes: int = 256 << 20,
                 num_slots: int = 2, timeout_s: float = 30.0, min_fraction: float = 1.0, max_retries: int = 2,
                 api_key: str | None = None, topology: str = "star", fan_out: int = AUTO,
                 host: str | None = None, protocol: str = "auto", device_name: str = "", delta: bool = False,
                 zero_copy: bool = True, audit_log=None):
        """`receivers`: server URLs (or receiver clients). `min_fraction`: the share of them that must
        stay in an update for it to commit (1.0: all). `topology`: star | chain | tree (fan_out; AUTO: chosen per push).
        Without a `transport`, a Mooncake engine on `host` (default: this machine's address toward
        the first receiver, loopback for a loopback fleet) with the receivers' protocol and device
        (`auto`: this machine's platform's, see platforms.Platform.mooncake). `delta`: after a push,
        keep its weights (the receivers' dtype, one copy where the trainer's lie) and send each later
        push as the bytes that changed to every receiver that still serves exactly that push (the
        others, and any bucket whose delta would not pay, go whole; delta.py). `zero_copy`: host tensors
        are registered with the transport and written from where they lie (off: copied into local
        slots first, for a transport that must register nothing but buffers of its own). `audit_log`: an
        AuditLog (weight_sync/audit.py) that gets a line per push started, before anything is sent."""
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if not 0.0 <= min_fraction <= 1.0:
            raise ValueError(f"min_fraction={min_fraction}: must be in [0, 1]")
        tree_parents(1, topology, fan_out)                  # a bad topology fails here, not mid-push
        self.timeout_s, self.min_fraction, self.max_retries = timeout_s, min_fraction, max_retries
        self.api_key = api_key
        self.clients = [self._client(r) for r in receivers]
        if not self.clients:
            raise ValueError("WeightSync needs at least one receiver")
        self.platform = detect()                  # this machine's: the trainer's tensors live on it
        self.mooncake = self.platform.mooncake(protocol, device_name)
        if transport is None:
            from weight_sync.transports.mooncake import open_mooncake, routable_host
            transport = open_mooncake(host or routable_host(getattr(self.clients[0], "url", "")),
                                      self.mooncake.protocol, self.mooncake.device_name)
        self.transport = transport
        self.bucket_bytes, self.num_slots = bucket_bytes, num_slots
        self.topology, self.fan_out = topology, fan_out
        self.streamer = Streamer(transport, self.mooncake, self.platform, num_slots, timeout_s, max_retries,
                                 zero_copy)          # the buckets' way: ring of local slots, zero-copy, fan-out
        self._ref: UpdateRef | None = None           # the update being pushed (or last pushed)
        self._peers: list[Peer] = []
        self._drop_lock = threading.Lock()
        self._closed = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="weight-sync")
        self.base = DeltaBase() if delta else None
        self.audit_log = audit_log
        self._base_digests: dict[tuple, str | None] = {}    # push_adapter: a base's digest, by model and tensors

    def _client(self, receiver):
        return HttpReceiverClient(receiver, self.timeout_s, self.api_key) if isinstance(receiver, str) else receiver

    # ---- the fleet --------------------------------------------------------------------------------
    def add_receiver(self, receiver) -> None:
        """A server that joins the fleet: it takes part from the next push on."""
        self.clients.append(self._client(receiver))

    def remove_receiver(self, name: str) -> None:
        """A server that left the fleet (by URL): no later push goes to it."""
        gone = [c for c in self.clients if c.name == name.rstrip("/")]
        self.clients = [c for c in self.clients if c not in gone]
        for c in gone:
            c.close()

    @property
    def update_id(self) -> str | None:
        """The id of the update being pushed, or of the last one pushed (None before the first)."""
        return self._ref.update_id if self._ref is not None else None

    def direct_buffer(self, nbytes: int) -> torch.Tensor:
        """A host buffer of at least `nbytes`, registered with this sync's transport and kept for the
        next pushes (streaming.Streamer.direct_buffer): a sharded direct push packs rank 0's bytes
        into it."""
        return self.streamer.direct_buffer(nbytes)

    @property
    def zero_copy(self) -> bool:
        """Host tensors go out as they lie (streaming.Streamer.zero_copy)."""
        return self.streamer.zero_copy

    @zero_copy.setter
    def zero_copy(self, on: bool) -> None:
        self.streamer.zero_copy = on

    # ---- the update, top to bottom ---------------------------------------------------------------
    def push(self, weights, version: int, inflight: InFlight | str = InFlight.CONTINUE) -> PushStats:
        tensors = named_weights(weights)
        staged: list[str] = []

        def stage(staging: list[Peer], specs: list[TensorSpec], ref: UpdateRef, stats: PushStats) -> None:
            """Receivers that serve the base get deltas; the rest (new, evicted and back, restarted,
            cold-started) the whole weights, in a pass of their own, first: the delta pass moves the
            base on to the new weights as it goes."""
            passes = self._passes(staging, stats)
            for i, (peers, delta) in enumerate(passes):
                keep = self.base.take if self.base is not None and i == len(passes) - 1 else None
                self.stream(peers, self.plan(specs, stats), self._sources(tensors, specs), ref, stats,
                            self._delta_packer(stats) if delta else None, direct=True, keep=keep)
            staged.append(ref.update_id)

        def digest_as(specs: list[TensorSpec]) -> str:
            """live_digest of the pushed weights as the receivers hold them (their names and dtypes)."""
            dtypes = check_weights(tensors, specs)
            return live_digest({s.name: tensors[s.name].detach().to(dtypes[s.name]) for s in specs})
        try:
            stats = self.run_update(version, InFlight(inflight), stage, digest_as)
        except CommitIncomplete:
            self._based(staged)
            raise
        except BaseException:
            if self.base is not None:
                self.base.forget()          # it may hold part of this push: the next one goes whole
            raise
        self._based(staged)
        return stats

    def push_adapter(self, adapter: Mapping[str, torch.Tensor], scales: Mapping[str, float],
                     base: Mapping[str, torch.Tensor], version: int,
                     inflight: InFlight | str = InFlight.CONTINUE) -> PushStats:
        """A LoRA adapter alone as `version` (`m.lora_A`, `m.lora_B` of each adapted module m, and
        its scale): every receiver merges it into the base it keeps (receiver.py), so each version
        serves base + its own adapter, with a full push's guarantees (digests, the two-phase commit,
        fencing). `base`: the frozen weights the adapter was trained on, by checkpoint name; each
        receiver's base is checked against them (live_digest in its dtypes) before any byte of the
        adapter moves, and a receiver that holds another fails the push everywhere."""
        tensors = {n: t.detach() for n, t in adapter.items()}
        msg = AdapterMsg(specs=[SpecMsg(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape))
                                for n, t in tensors.items()], scales=dict(scales))

        def stage(staging: list[Peer], specs: list[TensorSpec], ref: UpdateRef, stats: PushStats) -> None:
            stats.model_bytes = self._check_base(staging, base)
            for p in staging:
                stats.modes[p.name] = "adapter"
            self.stream(staging, self.plan(specs, stats), self._sources(tensors, specs), ref, stats, direct=True)
            stats.wire_bytes = stats.bytes
        if self.base is not None:
            self.base.forget()       # what serves from here is base + adapter: the next whole push goes whole
        return self.run_update(version, InFlight(inflight), stage, adapter=msg)

    def _check_base(self, staging: list[Peer], base: Mapping[str, torch.Tensor]) -> int:
        """Each receiver's base against `base` (a digest per model the receivers hold, kept while
        `base`'s tensors stay as they are); the whole weights' bytes."""
        model_bytes = 0
        for p in staging:
            specs = tuple(TensorSpec(s.name, s.dtype, tuple(s.shape)) for s in p.reply.base_specs)
            key = (specs, tuple((n, t.data_ptr(), t._version) for n, t in sorted(base.items())))
            if key not in self._base_digests:
                try:
                    dtypes = check_weights(base, list(specs))
                    self._base_digests[key] = live_digest({s.name: base[s.name].detach().to(dtypes[s.name])
                                                           for s in specs})
                except WeightSyncError:
                    self._base_digests[key] = None
            if self._base_digests[key] is None or self._base_digests[key] != p.reply.base_digest:
                raise WeightSyncError(f"{p.name} holds another base model than this adapter's: an adapter-only push "
                                      f"applies onto the weights it was trained on; push those whole first")
            model_bytes = max(model_bytes, sum(s.nbytes for s in specs))
        return model_bytes

    def _based(self, staged: list[str]) -> None:
        """The update that staged (and so committed) is the base of the next delta."""
        if self.base is not None and staged:
            self.base.update_id = staged[0]

    def _passes(self, staging: list[Peer], stats: PushStats) -> list[tuple[list[Peer], bool]]:
        """(receivers, as deltas?) for each pass of this push: whole first, then deltas."""
        base = self.base.update_id if self.base is not None else None
        delta = [p for p in staging if base is not None and p.reply.live_update == base]
        full = [p for p in staging if p not in delta]
        for p in staging:
            stats.modes[p.name] = "delta" if p in delta else "full"
        return [(peers, peers is delta) for peers in (full, delta) if peers]

    def _delta_packer(self, stats: PushStats):
        """How a delta pass puts each bucket into its local slot: (bucket, sources, slot) -> (bytes,
        digest, apply fields), a delta where it pays, else whole; the base follows either way."""
        base = self.base
        base.changed = base.elements = 0

        def packer(bucket: Bucket, sources: Mapping[str, torch.Tensor], slot: torch.Tensor):
            got = base.pack(bucket, sources, slot)
            stats.changed_fraction = base.changed / max(1, base.elements)
            if got is not None:
                stats.delta_buckets += 1
                return got[0], got[1], dict(encoding=Encoding.DELTA, base_update=base.update_id, wire_bytes=got[0])
            dig = pack(bucket, sources, slot)
            base.take(bucket, sources, slot)
            return bucket.nbytes, dig, None
        return packer

    def plan(self, specs: list[TensorSpec], stats: PushStats) -> list[Bucket]:
        """The update's buckets (counted in `stats`)."""
        plan = plan_buckets(specs, self.bucket_bytes)
        stats.buckets, stats.bytes = len(plan), sum(b.nbytes for b in plan)
        return plan

    def run_update(self, version: int, inflight: InFlight, stage,
                   digest_as: Callable[[list[TensorSpec]], str] | None = None,
                   adapter: AdapterMsg | None = None) -> PushStats:
        """One update as version `version`: open every receiver, `stage(staging peers, specs, ref,
        stats)` puts every bucket into them verified, then prepare and the two-phase commit. A
        sharded push (sharded.py) stages its own way, inside this same update. Receivers that serve
        `version` already are left as they are only when `digest_as(their specs)`, the pushed
        weights' live_digest, is that of the weights they serve (None: it cannot be told, so a push
        of a served version fails)."""
        ref = self._ref = UpdateRef(version=version, update_id=uuid.uuid4().hex)
        stats, t0 = PushStats(version=version), time.perf_counter()
        peers = self._peers = [Peer(c) for c in self.clients]
        try:
            specs = self._open(peers, ref, stats, adapter)
            if self.audit_log is not None:
                self.audit_log.write(kind="push", version=version, update_id=ref.update_id, t=time.time(),
                                     digest=digest_as(specs) if digest_as is not None else None)
            self._check_current(peers, version, digest_as)
            staging = [p for p in peers if p.staging]
            if staging:
                stage(staging, specs, ref, stats)
                self._each(staging, lambda p: p.client.prepare(self._prepare_request(p, staging, ref, inflight)),
                           "prepare")
        except BaseException:
            for p in peers:                  # in the background: a frozen receiver must not hold the caller
                if not p.current:
                    self._pool.submit(self._quiet_abort, p, ref)
            raise
        # Every receiver taking part has prepared: from here the outcome is commit.
        self._commit([p for p in peers if p.staging], ref, inflight, stats)
        stats.seconds = time.perf_counter() - t0
        return self._report(peers, stats)

    def close(self, close_transport: bool = True) -> None:
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for c in self.clients:
            c.close()
        self.streamer.close()
        if close_transport:
            self.transport.close()

    # ---- steps -----------------------------------------------------------------------------------
    def _open(self, peers: list[Peer], ref: UpdateRef, stats: PushStats,
              adapter: AdapterMsg | None = None) -> list[TensorSpec]:
        t = time.perf_counter()
        req = OpenRequest(**ref.model_dump(), bucket_bytes=self.bucket_bytes, num_slots=self.num_slots,
                          sender=self.transport.session_id, adapter=adapter)

        def open_one(p: Peer) -> OpenReply | None:
            try:
                return p.client.open(req)
            except ReceiverCallError as e:
                if e.kind is ErrorKind.CURRENT:
                    p.served = e.detail
                    return None
                raise
        for p, reply in self._each(peers, open_one, "open"):
            p.reply, p.current = reply, reply is None
        live = [p for p in peers if p.staging]
        specs = [TensorSpec(s.name, s.dtype, tuple(s.shape)) for s in live[0].reply.specs] if live else []
        for p in live[1:]:
            if [TensorSpec(s.name, s.dtype, tuple(s.shape)) for s in p.reply.specs] != specs:
                raise WeightSyncError(f"receiver {p.name} serves a different model than "
                                      f"{live[0].name}: their weight specs differ")
        stats.open_s = time.perf_counter() - t
        return specs

    @staticmethod
    def _check_current(peers: list[Peer], version: int, digest_as) -> None:
        """A version names one set of weights: receivers that serve `version` already must serve
        exactly the pushed weights, or the push fails before anything is sent. (A trainer that
        pushed v, crashed, resumed and trained step v again differently would otherwise label
        rollouts of the old weights as its new ones.)"""
        current = [p for p in peers if p.current]
        if not current:
            return
        names = ", ".join(p.name for p in current)
        if digest_as is None:
            raise WeightSyncError(f"version {version} is already served by {names}, and this push cannot check "
                                  f"that its weights are the ones serving it: push them as a new version")
        digests: dict[tuple[TensorSpec, ...], str] = {}    # one digest per model the receivers hold
        differ = []
        for p in current:
            served = p.served or {}
            specs = tuple(TensorSpec(s["name"], s["dtype"], tuple(s["shape"])) for s in served.get("specs", []))
            if specs and specs not in digests:
                digests[specs] = digest_as(list(specs))
            if not specs or digests[specs] != served.get("digest"):
                differ.append(p.name)
        if differ:
            raise WeightSyncError(f"version {version} is already served by {', '.join(differ)} with other weights "
                                  f"than these: a version names one set of weights, so this push changes nothing "
                                  f"and fails; push the new weights as a version above {version}")

    def _prepare_request(self, peer: Peer, staging: list[Peer], ref: UpdateRef, inflight: InFlight):
        others = [q.client.url for q in staging if q is not peer and getattr(q.client, "url", None)]
        return PrepareRequest(**ref.model_dump(), peers=others, inflight=inflight,
                              outcome_after_s=2 * self.timeout_s)

    def _commit(self, peers: list[Peer], ref: UpdateRef, inflight: InFlight, stats: PushStats) -> None:
        t = time.perf_counter()
        req = CommitRequest(**ref.model_dump(), inflight=inflight)
        for p, fut in [(p, self._pool.submit(p.client.commit, req)) for p in peers]:
            try:
                reply = fut.result()
            except ReceiverCallError as e:
                stats.pending[p.name] = str(e)
                if e.kind is None:           # no answer (timed out, unreachable): offer it again
                    self._pool.submit(self._deliver, p, req)
                continue
            stats.stall_s[p.name], stats.aborted_requests[p.name] = reply.stall_seconds, reply.aborted_requests
            stats.merge_s = max(stats.merge_s, reply.merge_seconds)
        stats.commit_s = time.perf_counter() - t

    def _deliver(self, peer: Peer, req: CommitRequest) -> None:
        """Offer a decided commit to a receiver that did not confirm it, until it does, refuses
        (a newer update replaced it there) or a newer push starts."""
        while not self._closed.wait(1.0) and self._ref is not None and self._ref.update_id == req.update_id:
            try:
                peer.client.commit(req)
            except ReceiverCallError as e:
                if e.kind is None:
                    continue
                log.info("commit of version %d no longer applies on %s: %s", req.version, peer.name, e)
                return
            log.warning("version %d committed on %s, late", req.version, peer.name)
            return

    def _report(self, peers: list[Peer], stats: PushStats) -> PushStats:
        v = stats.version
        for p in peers:
            old = p.reply.current_version if p.reply is not None else None
            if p.current or (p.staging and p.name not in stats.pending):
                stats.serving[p.name] = v
            else:        # its old state; under v's label only if it had no weights (or torn ones): none
                stats.serving[p.name] = old if old != v else None
            if p.error:
                stats.dropped[p.name] = p.error
        done = [n for n, s in stats.serving.items() if s == v]
        if stats.pending and len(done) < math.ceil(self.min_fraction * len(peers)):
            raise CommitIncomplete(
                f"version {v} is committed on {', '.join(done) or 'no receiver yet'}, but not confirmed by " +
                "; ".join(f"{n} ({e})" for n, e in stats.pending.items()) +
                f": each serves its old version until the commit reaches it (the sender offers it again and "
                f"it asks its peers); pushing version {v} again completes it", stats)
        return stats

    def _sources(self, tensors: dict[str, torch.Tensor], specs: list[TensorSpec]) -> Callable[[Bucket], dict]:
        """The trainer's tensors, checked against what receivers need, bucket by bucket: each
        contiguous, in the receivers' dtype (converted where it lies, on the trainer's device, once:
        a tensor cut across buckets is kept until its last piece is packed)."""
        dtypes = check_weights(tensors, specs)
        held: dict[str, torch.Tensor] = {}

        def of(bucket: Bucket) -> dict[str, torch.Tensor]:
            out = {}
            for p in bucket.pieces:
                t = held.get(p.name)
                if t is None:
                    t = tensors[p.name].detach().to(dtypes[p.name]).contiguous()
                out[p.name] = t
            held.clear()
            last = bucket.pieces[-1]
            if last.offset + last.length < out[last.name].nbytes:     # cut: its next piece opens the next bucket
                held[last.name] = out[last.name]
            return out
        return of

    def stream(self, peers: list[Peer], plan: list[Bucket], sources: Callable[[Bucket], Mapping[str, torch.Tensor]],
               ref: UpdateRef, stats: PushStats, packer=None, direct: bool = False, keep=None) -> None:
        """Every bucket down the fan-out tree of this sync's topology (streaming.Streamer.stream:
        `sources`, `packer`, `direct` and `keep` there); a receiver that fails is dropped
        (drop_peer) or fails the update."""
        parents = tree_parents(len(peers), self.topology, self.fan_out, buckets=len(plan))
        self.streamer.stream(peers, parents, plan, sources, ref, stats, self.drop_peer, packer, direct, keep)

    # ---- failure ---------------------------------------------------------------------------------
    def _each(self, peers: list[Peer], fn, step: str) -> list:
        """Run `fn` on every live peer in parallel; a failure drops the peer or fails the update."""
        live = [p for p in peers if p.error is None]
        futures = [(p, self._pool.submit(fn, p)) for p in live]
        out = []
        for p, f in futures:
            try:
                out.append((p, f.result()))
            except ReceiverCallError as e:
                self.drop_peer(p, e, stale=e.kind is ErrorKind.STALE)
        if not any(p.error is None for p in peers):
            raise WeightSyncError(f"no receiver left after {step}: " +
                                  "; ".join(f"{p.client.name}: {p.error}" for p in peers))
        return out

    def drop_peer(self, peer: Peer, error: Exception, stale: bool = False) -> None:
        """Leave `peer` (one of the update in progress) out of this update, or raise WeightSyncError
        when the update may not go on without it (`stale`, or fewer than `min_fraction` left)."""
        with self._drop_lock:
            if peer.error is not None:
                return
            alive = sum(p.error is None for p in self._peers) - 1
            if stale or alive < max(1, math.ceil(self.min_fraction * len(self._peers))):
                raise WeightSyncError(str(error)) from None
            peer.error = str(error)
        log.warning("dropping %s from this update: %s", peer.name, error)
        self._pool.submit(self._quiet_abort, peer, self._ref)

    @staticmethod
    def _quiet_abort(peer: Peer, ref: UpdateRef) -> None:
        try:
            peer.client.abort(ref)
        except Exception as e:  # best effort: the receiver may be the one that is dead
            log.info("abort on %s failed: %s", peer.name, e)


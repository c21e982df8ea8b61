r"""The receiving end of weight sync, inside an inference server: stage, verify, commit.

What a sender can write is a set of staging slots, registered with the transport while one update
is open and unregistered when it ends. Bytes reach the weights only by a copy out of a slot into
memory no transport can write (the shadow set; in in-place mode, the live set while the engine is
paused), and they count only when the digest of that copy matches the sender's. So a late write (a
frozen sender that wakes up, a timed-out write the transport still delivers) can at worst spoil a
slot, which the digest then refuses: it never reaches weights that serve. Two slot sets take turns,
so an update that replaces another (a newer version, or the same one from a new sender) never
writes where the one it replaced was writing; slot memory that was ever registered is never freed
while the receiver lives, so a write already under way when its slot is unregistered lands in
memory nothing else uses.

One lock orders every call. An update goes through

    idle -> open -> staged -> prepared -> committed
              \________\__________\-----> aborted

open: buckets arrive (apply); staged: all of them copied and verified; prepared: the sender may now
decide commit. A newer open (or the same version from another update) aborts the update it
replaces, whatever its stage, but never an older one. Commit is idempotent; an abort of a committed
update is refused. A prepared receiver that hears no outcome within `outcome_after_s` asks its peers
(named at prepare) and commits if one of them committed the update: once every receiver prepared,
the sender's decision is commit, so a peer's commit proves it. Until then it serves the old version.
Shadow mode commits by pointer swap between two decode steps; the old live set becomes the next
shadow. In-place mode pauses the engine at the first bucket and copies into the live weights; a
failed update leaves the engine paused and marked torn, never serving a mix of versions.
"""
from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from platforms import platform_of, usable_cores
from weight_sync import live_digest, merge_lora
from weight_sync.audit import AuditLog
from weight_sync.bucket import DTYPES, Bucket, TensorSpec, host_buffer, is_parts_digest, plan_buckets, unpack_verified
from weight_sync.delta import DeltaError, restore, unpack_delta, unpack_parts
from weight_sync.protocol import (AdapterMsg, ApplyReply, ApplyRequest, CommitReply, CommitRequest, Encoding,
                                  ErrorKind, InFlight, OpenReply, OpenRequest, PrepareRequest, SpecMsg, UpdateRef)
from weight_sync.transports import Transport, TransportError, WriteOp

log = logging.getLogger(__name__)


class ServingEngine(Protocol):
    """What a receiver needs of the server it feeds; the launcher adapts its engine to it. Each call
    returns once done, run between two decode steps where it touches what is served."""

    version: int                 # the version being served
    has_weights: bool            # False until a cold server's first update lands

    def parameters(self) -> dict[str, torch.Tensor]: ...       # the live tensors, by checkpoint name
    def pause(self) -> None: ...                              # keep requests and their KV; stop stepping
    def resume(self) -> None: ...
    def abort_all(self) -> int: ...                           # requests aborted
    def swap(self, tensors: dict[str, torch.Tensor], version: int) -> float: ...   # stall seconds
    def set_version(self, version: int) -> None: ...          # the live tensors were written in place
    def mark_torn(self, torn: bool) -> None: ...              # live weights mixed: refuse to serve
    # Optional, an engine that serves LoRA adapters in its forward (the embedded engine's fused path):
    # adaptable() -> the module names it can; swap_adapter(tensors, scales, version) -> stall seconds;
    # served() -> the weights it serves, the adapter merged in (for digests and peers). Without them,
    # adapter updates merge into the shadow weights.


class ReceiverError(Exception):
    def __init__(self, kind: ErrorKind, message: str, detail: dict | None = None):
        super().__init__(message)
        self.kind, self.detail = kind, detail or {}


class Stage(str, enum.Enum):
    IDLE = "idle"
    OPEN = "open"
    STAGED = "staged"
    PREPARED = "prepared"
    COMMITTED = "committed"
    ABORTED = "aborted"


@dataclass
class _Update:
    ref: UpdateRef
    plan: list[Bucket]
    targets: dict[str, torch.Tensor]
    slots: list[torch.Tensor]
    stage: Stage = Stage.OPEN
    applied: set[int] = field(default_factory=set)
    started: float = field(default_factory=time.monotonic)
    paused_at: float | None = None          # in-place mode: when the engine was paused
    base: str | None = None                 # the update serving at open: what a delta applies onto
    prepare: PrepareRequest | None = None
    adapter: AdapterMsg | None = None       # an adapter-only update: `targets` hold its tensors until the merge
    forward: bool = False                   # ... served in the engine's forward beside the base: no merge
    merge_s: float = 0.0

    @property
    def version(self) -> int:
        return self.ref.version


@dataclass
class _LoraBase:
    """What adapter updates merge into: the weights as they served when the first adapter update
    opened (a copy, so every version is the base + its own adapter, never a merge onto a merge, nor
    onto what a whole update brought since), the modules it adapts, and the live_digest of the
    weights then, which the sender checks against its base."""
    weights: dict[str, torch.Tensor] | None    # None: the live weights are the base (adapters served in the forward)
    adapted: set[str]
    digest: str
    specs: list[SpecMsg]
    confirmed: bool = False                 # an adapter update committed onto it


def adapted_modules(weights: set[str]) -> set[str]:
    return {n.removesuffix(".weight") for n in weights}


def adapter_problems(specs: list[TensorSpec], scales: dict[str, float], live: dict[str, torch.Tensor]) -> list[str]:
    """What is wrong with an adapter update's tensors for these weights (nothing: [])."""
    by_name, out = {s.name: s for s in specs}, []
    for m in scales:
        a, b, w = by_name.get(f"{m}.lora_A"), by_name.get(f"{m}.lora_B"), live.get(f"{m}.weight")
        if w is None:
            out.append(f"{m}: this server has no weight {m}.weight")
        elif a is None or b is None:
            out.append(f"{m}: needs both {m}.lora_A and {m}.lora_B")
        elif len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != b.shape[1] or \
                (b.shape[0], a.shape[1]) != tuple(w.shape):
            out.append(f"{m}: lora_B {list(b.shape)} @ lora_A {list(a.shape)} does not make {list(w.shape)}")
    extra = sorted(set(by_name) - {f"{m}.lora_{x}" for m in scales for x in "AB"})
    if extra:
        out.append(f"tensors of no adapted module: {extra[:3]}")
    return out


class Receiver:
    def __init__(self, engine: ServingEngine, make_transport, shadow: bool = True, stage_timeout_s: float = 300.0,
                 peer_status: Callable[[str], dict] | None = None, alignment: int = 1,
                 commit_log: AuditLog | None = None, name: str = "", forward_adapters: bool = True):
        """`make_transport()` starts the transport at the first update; `alignment`: what its
        registrations must be multiples of (Mooncake's ascend_direct: 2 MiB). `commit_log`: a
        record of every commit (weight_sync/audit.py), this server named `name` in it."""
        self.commit_log, self.name = commit_log, name
        self.forward_adapters = forward_adapters   # adapters in the engine's forward where it can (else merged)
        self.engine = engine
        self.alignment = alignment
        self._weights_device: torch.device | None = None
        self._copy_stream = None             # an accelerator's: slot -> weights copies beside the steps
        self.shadow = shadow
        self.stage_timeout_s = stage_timeout_s
        self._make_transport = make_transport
        self._peer_status = peer_status        # url -> that receiver's status(); None: ask nobody
        self._transport: Transport | None = None
        self._slot_sets: list[list[torch.Tensor]] = [[], []]
        self._next_set = 0
        self._retired_slots: list[torch.Tensor] = []   # registered once: never freed (see module doc)
        self._shadow: dict[str, torch.Tensor] | None = None
        self._lora_base: _LoraBase | None = None
        # which weight set holds the adapter base's tensors outside the adapted modules (what a merge
        # need not copy again): "live", and in shadow mode "shadow"
        self._rest_is_base = {"live": False, "shadow": False}
        self._update: _Update | None = None
        self._committed: collections.deque[str] = collections.deque(maxlen=32)   # recent update ids
        self._served: tuple[int, str] | None = None    # (version, live_digest of the weights serving it)
        self._live: tuple[str, int, int] | None = None  # (update id, version, weights' address) serving now
        self._lock = threading.Lock()
        # one relay write at a time (they share this host's link), beside the copies under the lock
        self._relays = ThreadPoolExecutor(1, thread_name_prefix="relay")
        self._mergers: ThreadPoolExecutor | None = None    # adapter merges on a CPU: a thread a core
        self._closed = threading.Event()
        self.torn = False                    # in-place update under way or failed: weights are mixed

    @property
    def transport(self) -> Transport:
        if self._transport is None:
            self._transport = self._make_transport()
        return self._transport

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec.of(n, p) for n, p in self.engine.parameters().items()]

    @property
    def stage(self) -> Stage:
        return self._update.stage if self._update is not None else Stage.IDLE

    # ---- protocol steps -------------------------------------------------------------------------
    def open(self, req: OpenRequest) -> OpenReply:
        with self._lock:
            current = self.engine.version
            if self.engine.has_weights and not self.torn:
                if req.version < current:
                    raise ReceiverError(ErrorKind.STALE, f"version {req.version} is not newer than the served {current}")
                if req.version == current:   # the sender checks its weights are these (sender._check_current)
                    raise ReceiverError(ErrorKind.CURRENT, f"version {req.version} is already served",
                                        {"digest": self._served_digest(),
                                         "specs": [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)}
                                                   for s in self.specs()]})
            staged = self._update
            # The same version again is a retry (its first sender died or missed a receiver); an older
            # one is fenced off while the staged update is fresh.
            if staged is not None and staged.version > req.version and not self._expired(staged):
                raise ReceiverError(ErrorKind.STALE, f"version {req.version} is not newer than the staged "
                                                     f"update {staged.version}")
            if staged is not None:
                log.warning("update %s (version %d, %s) superseded by %s (version %d) from %s", staged.ref.update_id,
                            staged.version, staged.stage.value, req.update_id, req.version, req.sender)
                self._end(staged, Stage.ABORTED)
            specs, targets = self._adapter_targets(req.adapter) if req.adapter else (self.specs(), self._targets())
            if req.adapter is None:          # a whole update writes the shadow (in place: the live set)
                self._rest_is_base["shadow" if self.shadow else "live"] = False
                base = self._lora_base
                if base is not None and base.weights is None:
                    # the live weights stop being the adapters' base at its commit: keep a copy now, and
                    # later adapter updates merge into it
                    base.weights = {n: t.detach().clone() for n, t in self.engine.parameters().items()}
            plan = plan_buckets(specs, req.bucket_bytes)
            slots = self._take_slots(max(b.nbytes for b in plan), req.num_slots)
            base = self.live_update()
            self._update = _Update(UpdateRef(version=req.version, update_id=req.update_id), plan, targets, slots,
                                   base=base, adapter=req.adapter,
                                   forward=req.adapter is not None and self._lora_base.weights is None)
            lora = self._lora_base if req.adapter else None
            return OpenReply(session=self.transport.session_id, slot_addrs=[s.data_ptr() for s in slots],
                             specs=[SpecMsg(name=s.name, dtype=s.dtype, shape=list(s.shape)) for s in specs],
                             current_version=current, live_update=base, base_digest=lora and lora.digest,
                             base_specs=lora.specs if lora else [])

    def apply(self, req: ApplyRequest) -> ApplyReply:
        """Copy bucket `req.bucket` out of staging slot `req.slot` into the update's targets and check
        the copy against the sender's digest, while writing the slot on to `req.forward` (relay
        fan-out). The relay does not wait for the check (cut-through): each child checks its own
        copy against the same digest, and a bucket that fails here is written again and relayed
        again before any child is asked to apply it."""
        if not req.forward:
            return self._verify(req)
        with self._lock:
            update = self._staging(req, req.bucket, req.slot)
        relay = self._relays.submit(self._forward, update, req)
        try:
            self._verify(req)
        finally:
            reply = relay.result()  # the slot is the sender's again only once the relay has read it
        return reply

    def _verify(self, req: ApplyRequest) -> ApplyReply:
        with self._lock:
            update = self._staging(req, req.bucket, req.slot)
            if not self.shadow and update.paused_at is None and not update.forward:
                self.engine.pause()
                update.paused_at = time.perf_counter()
                self._set_torn(True)             # from here until commit the live weights are mixed
            bucket = update.plan[req.bucket]
            if req.encoding is Encoding.DELTA:
                got = self._unpack_delta(update, req)
            else:
                got = unpack_verified(bucket, update.slots[req.slot], update.targets, like=req.digest,
                                      stream=self._stream())
            if got != req.digest:
                update.applied.discard(req.bucket)
                raise ReceiverError(ErrorKind.DIGEST, f"bucket {req.bucket} of version {req.version}: digest "
                                                      f"{got} != sender's {req.digest}")
            update.applied.add(req.bucket)
            if len(update.applied) == len(update.plan):
                update.stage = Stage.STAGED
            return ApplyReply(failed={})

    def prepare(self, req: PrepareRequest) -> None:
        with self._lock:
            update = self._current(req)
            if update.stage is Stage.OPEN:
                missing = len(update.plan) - len(update.applied)
                raise ReceiverError(ErrorKind.INCOMPLETE, f"version {req.version}: {missing} of {len(update.plan)} "
                                                          f"buckets not staged and verified")
            if update.stage is Stage.PREPARED:
                return
            if update.adapter is not None and not update.forward:
                self._merge(update)
            update.stage, update.prepare = Stage.PREPARED, req
            # Nothing can write the targets any more (no slot of this update is copied again), so
            # the update that is prepared is exactly what the applies verified.
            self._release_slots(update)
        if req.peers and self._peer_status is not None:
            threading.Thread(target=self._await_outcome, args=(update,), name=f"outcome-{req.update_id[:8]}",
                             daemon=True).start()

    def commit(self, req: CommitRequest) -> CommitReply:
        with self._lock:
            if req.update_id in self._committed:
                return CommitReply(version=req.version, stall_seconds=0.0)    # a retry: already done
            update = self._current(req)
            if update.stage is not Stage.PREPARED:
                raise ReceiverError(ErrorKind.STATE, f"version {req.version} was not prepared ({update.stage.value})")
            aborted = self.engine.abort_all() if req.inflight is InFlight.ABORT else 0
            t_start = time.time()
            if update.forward:               # the base stays; the adapter serves beside it from the next step
                stall = self.engine.swap_adapter(update.targets, update.adapter.scales, req.version)
            elif self.shadow:
                old = self.engine.parameters()
                stall = self.engine.swap(update.targets, req.version)
                self._shadow = old           # the old live set is the next update's shadow
            else:
                self.engine.set_version(req.version)
                self.engine.resume()
                stall = time.perf_counter() - (update.paused_at or time.perf_counter())
                self._set_torn(False)
            self._committed.append(req.update_id)
            if update.adapter is not None:
                self._lora_base.confirmed = True
            if self.shadow and not update.forward:     # the sets swapped
                r = self._rest_is_base
                r["live"], r["shadow"] = r["shadow"], r["live"]
            self._live = (req.update_id, req.version, self._address())
            self._end(update, Stage.COMMITTED)
            if self.commit_log is not None:
                t_end = time.time()
                self.commit_log.write(kind="commit", server=self.name, version=req.version,
                                      update_id=req.update_id, t_start=t_start, t_end=t_end,
                                      digest=live_digest(self.served_weights()))
            return CommitReply(version=req.version, stall_seconds=stall, aborted_requests=aborted,
                               merge_seconds=update.merge_s)

    def abort(self, ref: UpdateRef) -> None:
        with self._lock:
            if ref.update_id in self._committed:
                raise ReceiverError(ErrorKind.STATE, f"update {ref.update_id} (version {ref.version}) is "
                                                     f"committed: an abort cannot undo it")
            update = self._update
            if update is not None and update.ref.update_id == ref.update_id:
                self._end(update, Stage.ABORTED)

    def status(self) -> dict:
        u = self._update
        return {"version": self.engine.version, "mode": "shadow" if self.shadow else "in_place",
                "torn": self.torn, "stage": self.stage.value,
                "staged_version": u.version if u else None, "update_id": u.ref.update_id if u else None,
                "buckets_applied": len(u.applied) if u else 0, "buckets": len(u.plan) if u else 0,
                "committed_updates": list(self._committed), "live_update": self.live_update()}

    def close(self) -> None:
        self._closed.set()
        self._relays.shutdown(wait=False)
        if self._mergers is not None:
            self._mergers.shutdown(wait=False)
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def live_update(self) -> str | None:
        """The update whose weights serve now, exactly as it committed them; None when what serves
        came otherwise (start-up, a reload from disk) or is torn."""
        if self._live is None or self.torn or not self.engine.has_weights:
            return None
        update_id, version, address = self._live
        return update_id if (version, address) == (self.engine.version, self._address()) else None

    def _address(self) -> int:
        """Where the live weights lie: a reload from disk replaces them (a new address)."""
        return next(iter(self.engine.parameters().values())).data_ptr()

    def _unpack_delta(self, update: _Update, req: ApplyRequest) -> str:
        """A delta bucket onto the base it names, into the update's targets; the digest of the result
        (or why there is none). In-place, a delta that does not verify is undone, so the live
        weights stay the base and a rewrite of the same delta applies again."""
        if update.base is None or req.base_update != update.base:
            raise ReceiverError(ErrorKind.BASE, f"bucket {req.bucket} of version {req.version} is a delta onto update "
                                                f"{req.base_update}, but this server serves "
                                                f"{update.base or 'weights no update of this sender pushed'}")
        slot = update.slots[req.slot][:req.wire_bytes or update.plan[req.bucket].nbytes]
        undo: list | None = None if self.shadow else []
        base = self.engine.parameters() if self.shadow else None
        try:
            if is_parts_digest(req.digest):            # a sharded push: ranges from several ranks
                got = unpack_parts(update.plan[req.bucket], slot, update.targets, req.digest, base, undo)
            else:
                got = unpack_delta(update.plan[req.bucket], slot, update.targets, base, undo)
        except DeltaError as e:
            got = f"undecodable delta ({e})"
        if got != req.digest and undo:
            restore(undo)
        return got

    # ---- adapter updates ---------------------------------------------------------------------------
    def _adapter_targets(self, msg: AdapterMsg) -> tuple[list[TensorSpec], dict[str, torch.Tensor]]:
        """An adapter update's tensors, checked against the weights they adapt, and the buffers they
        are staged into; the base they merge into is taken from what serves at the first one."""
        live = self.engine.parameters()
        if not self.engine.has_weights or self.torn:
            raise ReceiverError(ErrorKind.BASE, "no whole weights to merge an adapter into: push the base model first")
        specs = [TensorSpec(s.name, s.dtype, tuple(s.shape)) for s in msg.specs]
        problems = adapter_problems(specs, msg.scales, live)
        if problems:
            raise ReceiverError(ErrorKind.STATE, "adapter update refused: " + "; ".join(problems[:3]))
        adapted = {f"{m}.weight" for m in msg.scales}
        if self.live_update() is None:       # what serves came otherwise (start-up, a reload): nothing known
            self._rest_is_base = {"live": False, "shadow": False}
        base = self._lora_base
        if base is not None and base.adapted != adapted:
            if base.confirmed:
                raise ReceiverError(ErrorKind.BASE, f"this adapter adapts {len(adapted)} modules, the adapters merged "
                                                    f"here {len(base.adapted)}: other ones; push the whole weights")
            base = None
        if base is None:
            self._rest_is_base = {"live": True, "shadow": False}
            # served in the engine's forward where it can (the base then is the live weights: no copy,
            # no merge), else merged into a copy of the base
            forward = self.forward_adapters and adapted_modules(adapted) <= self._adaptable()
            base = self._lora_base = _LoraBase(
                None if forward else {n: t.detach().clone() for n, t in live.items()}, adapted, live_digest(live),
                [SpecMsg(name=n, dtype=str(p.dtype).removeprefix("torch."), shape=list(p.shape)) for n, p in live.items()])
        return specs, {s.name: torch.empty(s.shape, dtype=DTYPES[s.dtype], device=self._device()) for s in specs}

    def _adaptable(self) -> set[str]:
        adaptable = getattr(self.engine, "adaptable", None)
        return adaptable() if adaptable is not None else set()

    def served_weights(self) -> dict[str, torch.Tensor]:
        """What serves, by checkpoint name: the live weights, with an adapter served in the forward
        merged in (as a merging receiver would hold them: the same digest)."""
        served = getattr(self.engine, "served", None)
        return served() if served is not None else self.engine.parameters()

    def _merge(self, update: _Update) -> None:
        """An adapter update's weights: each adapted module's base plus lora_B @ lora_A * its scale (in
        fp32, as peft merges, rounded once to the served dtype) and every other tensor the base's, into
        the shadow set, or in place into the live weights (the engine paused)."""
        t = time.perf_counter()
        written = "shadow" if self.shadow else "live"
        done, self._rest_is_base[written] = self._rest_is_base[written], True
        out, adapter, base = self._targets(), update.targets, self._lora_base
        if not self.shadow and update.paused_at is None:
            self.engine.pause()
            update.paused_at = time.perf_counter()
            self._set_torn(True)
        def merge(names: list[str]) -> None:
            for name in names:
                dst = out[name]
                if name in base.adapted:
                    m = name.removesuffix(".weight")
                    merge_lora(base.weights[name], adapter[f"{m}.lora_A"], adapter[f"{m}.lora_B"],
                               update.adapter.scales[m], out=dst)
                elif not done:
                    dst.copy_(base.weights[name])   # the base's, unless this set holds it already
        # Bound by memory traffic (the base read, the set written once): on a CPU, dealt over a thread
        # a core this process has (SmolLM2-135M's 106M adapted weights: 0.16 s on one core, 0.09 on two;
        # one OpenMP team of two in a handler thread measured slower than one core)
        names = sorted(out, key=lambda n: -out[n].numel())
        parts = min(len(names), usable_cores()) if self._device().type == "cpu" else 1
        if parts > 1:
            if self._mergers is None:
                self._mergers = ThreadPoolExecutor(parts, thread_name_prefix="lora-merge",
                                                   initializer=torch.set_num_threads, initargs=(1,))
            for f in [self._mergers.submit(merge, names[i::parts]) for i in range(parts)]:
                f.result()
        else:
            merge(names)
        update.targets, update.merge_s = out, time.perf_counter() - t

    # ---- learning the outcome from peers ----------------------------------------------------------
    def _await_outcome(self, update: _Update) -> None:
        """Prepared and no word from the sender: commit once a peer shows it committed this update."""
        prep = update.prepare
        wait = prep.outcome_after_s
        while not self._closed.wait(wait) and self._update is update and update.stage is Stage.PREPARED:
            wait = min(prep.outcome_after_s, 2.0)
            for peer in prep.peers:
                try:
                    committed = prep.update_id in self._peer_status(peer).get("committed_updates", [])
                except Exception as e:  # a peer that is down or slow just has no answer this round
                    log.info("outcome of %s: %s did not answer: %s", prep.update_id, peer, e)
                    continue
                if committed:
                    log.warning("update %s (version %d): no commit from the sender; %s committed it, so "
                                "committing here", prep.update_id, prep.version, peer)
                    try:
                        self.commit(CommitRequest(version=prep.version, update_id=prep.update_id,
                                                  inflight=prep.inflight))
                    except ReceiverError as e:   # superseded or ended meanwhile: nothing left to decide
                        log.info("late commit of %s not applied: %s", prep.update_id, e)
                    return

    # ---- helpers --------------------------------------------------------------------------------
    def _served_digest(self) -> str:
        """live_digest of the weights that serve the current version: computed the first time a
        sender asks (a push of the version already served), then kept until the version changes.
        Under the lock: nothing writes the live weights meanwhile."""
        version = self.engine.version
        if self._served is None or self._served[0] != version:
            self._served = (version, live_digest(self.served_weights()))
        return self._served[1]

    def _staging(self, ref: UpdateRef, bucket: int, slot: int) -> _Update:
        update = self._current(ref)
        if update.stage not in (Stage.OPEN, Stage.STAGED):
            raise ReceiverError(ErrorKind.STATE, f"bucket {bucket} of version {ref.version} arrived "
                                                 f"after the update was {update.stage.value}")
        if not 0 <= bucket < len(update.plan) or not 0 <= slot < len(update.slots):
            raise ReceiverError(ErrorKind.STATE, f"bucket {bucket} / slot {slot} out of range "
                                                 f"({len(update.plan)} buckets, {len(update.slots)} slots)")
        return update

    def _forward(self, update: _Update, req: ApplyRequest) -> ApplyReply:
        """The relay hop: this receiver's slot into each target's slot, with its own transport. It
        runs outside the lock (beside the copies of other buckets); the sender hands this slot to
        another bucket only after the apply returns, and slot memory outlives its update, so a
        write racing an abort lands in memory nothing uses."""
        src, nbytes = update.slots[req.slot], req.wire_bytes or update.plan[req.bucket].nbytes
        failed = {}
        for i, target in enumerate(req.forward):
            try:
                self.transport.write(target.session, [WriteOp(src.data_ptr(), target.addr, nbytes)],
                                     req.forward_timeout_s)
            except TransportError as e:
                failed[i] = str(e)
        return ApplyReply(failed=failed)

    def _current(self, ref: UpdateRef) -> _Update:
        update = self._update
        if update is None or update.ref.update_id != ref.update_id or update.version != ref.version:
            staged = f"update {update.ref.update_id} (version {update.version})" if update else "no update"
            raise ReceiverError(ErrorKind.SUPERSEDED, f"update {ref.update_id} (version {ref.version}) is not the "
                                                      f"staged one ({staged})")
        return update

    def _end(self, update: _Update, stage: Stage) -> None:
        update.stage = stage
        if stage is Stage.ABORTED and update.adapter is not None and self._lora_base is not None \
                and not self._lora_base.confirmed:
            self._lora_base = None           # taken for this update only: the next looks at what serves then
        self._release_slots(update)
        if self._update is update:
            self._update = None

    def _set_torn(self, torn: bool) -> None:
        self.torn = torn
        self.engine.mark_torn(torn)

    def _expired(self, update: _Update) -> bool:
        return time.monotonic() - update.started > self.stage_timeout_s

    def _take_slots(self, nbytes: int, count: int) -> list[torch.Tensor]:
        """The slot set the previous update did not use, registered for this one."""
        i, self._next_set = self._next_set, 1 - self._next_set
        slots = self._slot_sets[i]
        if len(slots) < count or slots[0].numel() < nbytes:
            self._retired_slots += slots
            # Page-locked when the weights live on an accelerator: its copies out of a slot are DMA.
            pinned = self._device().type != "cpu"
            slots = self._slot_sets[i] = [host_buffer(nbytes, self.alignment, pinned) for _ in range(count)]
        slots = slots[:count]
        for s in slots:
            self.transport.register(s)
        return slots

    def _device(self) -> torch.device:
        """Where the served weights (and so every update's targets) live; that never changes."""
        if self._weights_device is None:
            self._weights_device = next(iter(self.engine.parameters().values())).device
        return self._weights_device

    def _stream(self):
        device = self._device()
        if self._copy_stream is None and device.type != "cpu":
            self._copy_stream = platform_of(device).copy_stream(device)
        return self._copy_stream

    def _release_slots(self, update: _Update) -> None:
        for s in update.slots:
            self.transport.unregister(s.data_ptr())
        update.slots = []

    def _targets(self) -> dict[str, torch.Tensor]:
        live = self.engine.parameters()
        if not self.shadow:
            return live
        if self._shadow is None:
            self._shadow = {n: torch.empty_like(p) for n, p in live.items()}
        return self._shadow

"""Wire messages of the weight-sync protocol between a sender and each receiver.

One update, named by the sender's `update_id` (one per push, shared by every receiver of it):
open (fencing by version; staging slots handed out) -> for each bucket: the sender writes it into a
staging slot, then apply (the receiver copies it into its shadow weights and checks the copy's
digest) -> prepare (all buckets staged and verified) -> commit (flip, between two decode steps) or
abort (drop everything staged; keep serving the old version). Every call after open names the
update, so a late call from a sender whose update was superseded is refused, even for the same
version.
"""
from __future__ import annotations

import enum

from pydantic import BaseModel, Field


class InFlight(str, enum.Enum):
    CONTINUE = "continue"   # running requests go on under the new weights (their KV came from the old)
    ABORT = "abort"         # running requests end with finish_reason abort, to be resumed by the caller


class Encoding(str, enum.Enum):
    WHOLE = "whole"         # the bucket's bytes as they lie in the weights
    DELTA = "delta"         # only what changed since the base update (weight_sync/delta.py)


class SpecMsg(BaseModel):
    name: str
    dtype: str
    shape: list[int]


class UpdateRef(BaseModel):
    version: int
    update_id: str = Field(min_length=1)


class AdapterMsg(BaseModel):
    """An adapter-only update (LoRA): for each adapted module m, `m.lora_A` [r, in] and `m.lora_B`
    [out, r] (the tensors the update streams, named in `specs`), which the receiver merges into the
    base it keeps: m.weight = base m.weight + lora_B @ lora_A * scales[m]."""
    specs: list[SpecMsg]
    scales: dict[str, float]


class OpenRequest(UpdateRef):
    bucket_bytes: int = Field(gt=0)
    num_slots: int = Field(ge=1, le=8)
    sender: str                        # the sender's transport session, for the receiver's logs
    adapter: AdapterMsg | None = None  # an adapter-only update (None: the weights themselves)


class OpenReply(BaseModel):
    session: str                       # the receiver's transport session id
    slot_addrs: list[int]              # staging slots: bucket k goes to slot k % len
    specs: list[SpecMsg]               # what the receiver needs, in plan order
    current_version: int
    live_update: str | None = None     # the update whose weights serve now, exactly (None: loaded otherwise)
    base_digest: str | None = None     # adapter updates: live_digest of the base the adapter merges into
    base_specs: list[SpecMsg] = []     # ... over these tensors (names, dtypes, shapes), for the sender's check


class Target(BaseModel):
    """A staging slot of another receiver, which this one writes a bucket into (relay fan-out)."""
    session: str
    addr: int


class ApplyRequest(UpdateRef):
    bucket: int
    slot: int
    digest: str
    forward: list[Target] = []         # once verified, write the bucket on into these slots
    forward_timeout_s: float = Field(default=30.0, gt=0)
    encoding: Encoding = Encoding.WHOLE
    base_update: str | None = None     # delta: the update whose weights it applies onto
    wire_bytes: int | None = Field(default=None, gt=0)   # delta: bytes of the slot it fills


class ApplyReply(BaseModel):
    failed: dict[int, str] = {}        # index in `forward` -> why that write did not land


class PrepareRequest(UpdateRef):
    """Also tells a receiver what it needs to learn the outcome on its own: once every receiver has
    prepared, the sender decides commit; a receiver that hears nothing for `outcome_after_s` asks
    its `peers` whether they committed this update, and if one did, commits with `inflight`."""
    peers: list[str] = []
    inflight: "InFlight" = InFlight.CONTINUE
    outcome_after_s: float = Field(default=30.0, gt=0)


class CommitRequest(UpdateRef):
    inflight: InFlight = InFlight.CONTINUE


class CommitReply(BaseModel):
    version: int
    stall_seconds: float
    aborted_requests: int = 0
    merge_seconds: float = 0.0         # adapter updates: the merge into the base (at prepare)


class PushToRequest(BaseModel):
    """Ask a live server to push its current weights to another (cold start from a peer)."""
    receiver_url: str
    bucket_bytes: int = 64 << 20
    timeout_s: float = 60.0


class ErrorKind(str, enum.Enum):
    STALE = "stale_version"          # older than what the receiver serves or stages
    CURRENT = "current_version"      # the receiver already serves this version: nothing to do
    SUPERSEDED = "superseded"        # the call names an update that is not the one staged
    DIGEST = "digest_mismatch"
    INCOMPLETE = "incomplete"
    BASE = "base_mismatch"           # a delta onto weights other than those serving
    STATE = "bad_state"              # the call is not legal in the update's stage

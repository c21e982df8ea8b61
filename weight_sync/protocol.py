"""Wire messages of the weight-sync protocol between a sender and each receiver.

One update: open (fencing by version, staging slots handed out) -> for each bucket: the sender
writes it into a staging slot, then apply (the receiver verifies the digest and copies it into its
shadow weights) -> prepare (all buckets staged and verified?) -> commit (flip, between two decode
steps) or abort (drop everything staged; keep serving the old version).
"""
from __future__ import annotations

import enum

from pydantic import BaseModel, Field


class InFlight(str, enum.Enum):
    CONTINUE = "continue"   # running requests go on under the new weights (their KV came from the old)
    ABORT = "abort"         # running requests end with finish_reason abort, to be resumed by the caller


class SpecMsg(BaseModel):
    name: str
    dtype: str
    shape: list[int]


class OpenRequest(BaseModel):
    version: int
    bucket_bytes: int = Field(gt=0)
    num_slots: int = Field(ge=1, le=8)
    sender: str                        # the sender's transport session, for the receiver's logs


class OpenReply(BaseModel):
    session: str                       # the receiver's transport session id
    slot_addrs: list[int]              # staging slots (in-place mode): bucket k goes to slot k % len
    direct_base: int | None = None     # shadow mode: bucket k goes to direct_base + its plan offset
    specs: list[SpecMsg]               # what the receiver needs, in plan order
    current_version: int


class ApplyRequest(BaseModel):
    version: int
    bucket: int
    slot: int
    digest: str


class VersionRequest(BaseModel):
    version: int


class CommitRequest(BaseModel):
    version: int
    inflight: InFlight = InFlight.CONTINUE


class CommitReply(BaseModel):
    version: int
    stall_seconds: float
    aborted_requests: int = 0


class PushToRequest(BaseModel):
    """Ask a live server to push its current weights to another (cold start from a peer)."""
    receiver_url: str
    bucket_bytes: int = 64 << 20
    timeout_s: float = 60.0


class ErrorKind(str, enum.Enum):
    STALE = "stale_version"
    SUPERSEDED = "superseded"
    DIGEST = "digest_mismatch"
    INCOMPLETE = "incomplete"
    STATE = "bad_state"

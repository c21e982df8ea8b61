"""Delta buckets: only the elements that changed since the version a receiver serves.

At the learning rates RL runs use, most weights in the servers' dtype do not change from one step
to the next (an update smaller than half a bf16 ulp rounds away), so a bucket can travel as the
elements that differ from the base version the receiver serves. The encoding, per piece of the
bucket (in plan order), each section 8-byte aligned:

    n        int64                  elements changed in the piece
    counts   int32[ceil(E / 65536)] changes in each block of 65536 elements
    low      int16[n]               each change's index within its block (the low 16 bits)
    values   W[n]                   the new elements, W the piece's element width (1, 2, 4 or 8 bytes)

so a change costs its value plus two bytes, and a piece that did not change costs ~8 bytes. The
diff runs wherever the tensors live (on an accelerator only the encoding crosses to the host).
Decoding is checked (counts, ranges, lengths) and writes only inside the piece; a malformed
encoding raises `DeltaError`. Either way the receiver hashes the whole resulting bucket and compares
it with the sender's digest of the new weights, so a delta push is as exact as a full one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import xxhash

from weight_sync.bucket import Bucket, as_bytes

BLOCK_BITS = 16
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeltaError(ValueError):
    """A delta encoding that does not decode into its bucket (corrupted, truncated, wrong plan)."""


@dataclass(frozen=True)
class Section:
    """Where a piece's encoding lies in the bucket's wire bytes."""
    n: int
    counts: int      # byte offsets in the wire bytes
    low: int
    values: int
    end: int


def _pad(n: int) -> int:
    return -(-n // 8) * 8


def width(dtype: torch.dtype, offset: int, length: int) -> int:
    """Bytes per element the diff compares: the dtype's, where the piece is made of whole elements."""
    w = dtype.itemsize
    return w if w in _INTS and offset % w == 0 and length % w == 0 else 1


def layout(at: int, n: int, elements: int, w: int) -> Section:
    counts = at + 8
    low = counts + _pad(4 * -(-elements >> BLOCK_BITS) if elements else 0)
    values = low + _pad(2 * n)
    return Section(n, counts, low, values, values + _pad(w * n))


def encoded_size(n: int, elements: int, w: int) -> int:
    return layout(0, n, elements, w).end


# ---- the sender's side ------------------------------------------------------------------------
@dataclass
class PieceDiff:
    """What changed in one piece: indices (int64, where the tensors live) and their new values."""
    name: str
    index: torch.Tensor
    values: torch.Tensor
    elements: int
    width: int


def diff_piece(name: str, new: torch.Tensor, base: torch.Tensor, w: int) -> PieceDiff:
    """`new` and `base`: flat uint8 views of the same piece; compared as w-byte integers (so a NaN
    or a -0.0 that differs in its bits is a change, one that does not is not)."""
    new_i, base_i = new.view(_INTS[w]), base.view(_INTS[w])
    index = (new_i != base_i).nonzero().flatten()
    return PieceDiff(name, index, new_i[index], new_i.numel(), w)


def write_delta(diffs: list[PieceDiff], wire: torch.Tensor) -> int:
    """Encode the pieces' diffs into `wire` (flat uint8, host memory; large enough); returns the
    bytes used. Device tensors come over by DMA into it."""
    at = 0
    for d in diffs:
        s = layout(at, d.index.numel(), d.elements, d.width)
        blocks = -(-d.elements >> BLOCK_BITS)
        wire[at:at + 8].view(torch.int64)[0] = s.n
        counts = torch.bincount(d.index >> BLOCK_BITS, minlength=blocks).to(torch.int32)
        wire[s.counts:s.counts + 4 * blocks].view(torch.int32).copy_(counts)
        wire[s.low:s.low + 2 * s.n].view(torch.int16).copy_((d.index & 0xFFFF).to(torch.int16))
        wire[s.values:s.values + d.width * s.n].view(_INTS[d.width]).copy_(d.values)
        at = s.end
    return at


def apply_diff(d: PieceDiff, target: torch.Tensor) -> None:
    """The diff onto `target` (the flat uint8 view of the same piece, where the diff was taken)."""
    target.view(_INTS[d.width])[d.index] = d.values


# ---- the receiver's side ----------------------------------------------------------------------
def read_piece(wire: torch.Tensor, at: int, elements: int, w: int) -> tuple[Section, torch.Tensor, torch.Tensor]:
    """Decode one piece's section starting at byte `at`: (section, int64 indices, values)."""
    if at + 8 > wire.numel():
        raise DeltaError(f"truncated at byte {at}")
    n = int(wire[at:at + 8].view(torch.int64)[0])
    if not 0 <= n <= elements:
        raise DeltaError(f"{n} changes claimed in a piece of {elements} elements")
    s = layout(at, n, elements, w)
    if s.end > wire.numel():
        raise DeltaError(f"a section of {s.end - at} bytes at {at} runs past the {wire.numel()} received")
    blocks = -(-elements >> BLOCK_BITS)
    counts = wire[s.counts:s.counts + 4 * blocks].view(torch.int32).to(torch.int64)
    if bool((counts < 0).any()) or int(counts.sum()) != n:
        raise DeltaError(f"block counts add up to {int(counts.sum())}, not the {n} changes claimed")
    low = wire[s.low:s.low + 2 * n].view(torch.int16).to(torch.int64) & 0xFFFF
    block = torch.repeat_interleave(torch.arange(blocks, dtype=torch.int64), counts)
    index = (block << BLOCK_BITS) | low
    if n and int(index.max()) >= elements:
        raise DeltaError(f"a change at element {int(index.max())} of a piece of {elements}")
    return s, index, wire[s.values:s.values + w * n].view(_INTS[w])


def unpack_delta(bucket: Bucket, wire: torch.Tensor, targets: dict[str, torch.Tensor],
                 base: dict[str, torch.Tensor] | None = None, undo: list | None = None) -> str:
    """Rebuild the bucket's new bytes in `targets`: each piece is first made equal to its `base`
    (the live weights, when the targets are a shadow set; None: the targets are the base) and then
    takes the changes. Returns the xxh3-128 digest of the bucket's new bytes, taken as a whole
    bucket's is, or raises DeltaError. With `undo` (targets that are the base: in-place mode), the
    old value of every element written is appended to it, so `restore(undo)` puts the base back
    after a delta that does not verify. Decoding reads `wire` once; a late write into it can change
    what is decoded, and then the digest, not the slot, is what disagrees."""
    h = xxhash.xxh3_128()
    at = 0
    for p in bucket.pieces:
        dst = as_bytes(targets[p.name])[p.offset:p.offset + p.length]
        w = width(targets[p.name].dtype, p.offset, p.length)
        s, index, values = read_piece(wire, at, p.length // w, w)
        if base is not None:
            dst.copy_(as_bytes(base[p.name])[p.offset:p.offset + p.length])
        elements = dst.view(_INTS[w])
        index, values = index.to(dst.device), values.to(dst.device)
        if undo is not None:
            undo.append((elements, index, elements[index].clone()))
        elements[index] = values
        h.update((dst if dst.device.type == "cpu" else dst.cpu()).numpy())
        at = s.end
    return h.hexdigest()


def restore(undo: list) -> None:
    """Put back what `unpack_delta` overwrote, last write first."""
    for elements, index, old in reversed(undo):
        elements[index] = old
    undo.clear()


# ---- what the sender keeps --------------------------------------------------------------------
class DeltaBase:
    """The weights a sender last pushed, in the receivers' dtype, and the update that pushed them:
    the base its next push diffs against, for every receiver that still serves exactly that update.
    `tensors` live where the trainer's do (the diff runs there); on an accelerator `mirror` keeps the
    same bytes in host memory, where a delta bucket's digest is taken (so only changed bytes cross).
    The base follows the push bucket by bucket, so a push that fails part-way leaves it unusable:
    `forget()`, and the next push goes whole."""

    def __init__(self, max_fraction: float = 0.9):
        self.max_fraction = max_fraction         # a delta bigger than this share of its bucket goes whole
        self.tensors: dict[str, torch.Tensor] = {}
        self.mirror: dict[str, torch.Tensor] = {}
        self.update_id: str | None = None
        self.changed = self.elements = 0         # this push's delta buckets: elements changed / compared

    def forget(self) -> None:
        self.update_id = None

    def _views(self, name: str, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.tensors.get(name)
        if t is None or t.shape != like.shape or t.dtype != like.dtype or t.device != like.device:
            t = self.tensors[name] = torch.empty_like(like)
            self.mirror[name] = t if t.device.type == "cpu" else torch.empty(
                like.shape, dtype=like.dtype, pin_memory=True)
        return as_bytes(t), as_bytes(self.mirror[name])

    def take(self, bucket: Bucket, sources: dict[str, torch.Tensor], packed: torch.Tensor) -> None:
        """After a whole bucket was packed into `packed` (host): the base takes its new bytes."""
        for p in bucket.pieces:
            base, mirror = self._views(p.name, sources[p.name])
            if base.data_ptr() != mirror.data_ptr():
                base[p.offset:p.offset + p.length].copy_(as_bytes(sources[p.name])[p.offset:p.offset + p.length])
            mirror[p.offset:p.offset + p.length].copy_(packed[p.bucket_offset:p.bucket_offset + p.length])

    def pack(self, bucket: Bucket, sources: dict[str, torch.Tensor], wire: torch.Tensor) -> tuple[int, str] | None:
        """Encode what changed in the bucket since the base into `wire` and move the base on to the new
        bytes; returns (bytes used, digest of the bucket's new bytes), or None when the delta would
        not pay (the bucket then goes whole: pack it and `take` it)."""
        diffs = []
        for p in bucket.pieces:
            src = sources[p.name]
            base, _ = self._views(p.name, src)
            w = width(src.dtype, p.offset, p.length)
            diffs.append(diff_piece(p.name, as_bytes(src)[p.offset:p.offset + p.length],
                                    base[p.offset:p.offset + p.length], w))
        size = sum(encoded_size(d.index.numel(), d.elements, d.width) for d in diffs)
        if size > self.max_fraction * bucket.nbytes or size > wire.numel():
            return None
        used = write_delta(diffs, wire)
        device = next(iter(sources.values())).device
        if device.type != "cpu":
            from platforms import platform_of
            platform_of(device).synchronize(device)
        h = xxhash.xxh3_128()
        for p, d in zip(bucket.pieces, diffs):
            base, mirror = self._views(p.name, sources[p.name])
            apply_diff(d, base[p.offset:p.offset + p.length])
            if mirror.data_ptr() != base.data_ptr():     # the host copy takes the changes from the wire
                _, index, values = read_piece(wire, _section_start(diffs, d), d.elements, d.width)
                apply_diff(PieceDiff(d.name, index, values, d.elements, d.width), mirror[p.offset:p.offset + p.length])
            # On the CPU the digest is of the trainer's bytes themselves; elsewhere of the host copy.
            new = as_bytes(sources[p.name])[p.offset:p.offset + p.length] if device.type == "cpu" else \
                mirror[p.offset:p.offset + p.length]
            h.update(new.numpy())
            self.changed += d.index.numel()
            self.elements += d.elements
        return used, h.hexdigest()


def _section_start(diffs: list[PieceDiff], d: PieceDiff) -> int:
    at = 0
    for e in diffs:
        if e is d:
            return at
        at += encoded_size(e.index.numel(), e.elements, e.width)
    raise ValueError(f"{d.name} is not among the bucket's diffs")

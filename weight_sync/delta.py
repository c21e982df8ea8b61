"""Delta buckets: only the elements that changed since the version a receiver serves.

At the learning rates RL runs use, most weights in the servers' dtype do not change from one step
to the next (an update smaller than half a bf16 ulp rounds away), so a bucket can travel as the
elements that differ from the base version the receiver serves. Each piece of the bucket (in plan
order) is encoded as five sections, each 8-byte aligned:

    header  int64[3]   n changes, gap bytes, full values
    gaps    uint8[]    where the changes are: per change, the unchanged elements before it, one
                       byte each (0..254); a 255 skips 255 elements with no change
    low     uint8[n]   each change's new low byte
    flags   uint8[n/8] a bit per change: its upper bytes changed too
    full    W[]        the new elements of the flagged changes (W: the element's width)

A step moves a bf16 weight by an ulp or two, which leaves its upper byte (sign and exponent) as it
was, so a change costs ~2.1 bytes here where a (position, value) pair costs 6: on the bench's
training steps at lr 1e-6, 3.6% of the bf16 elements changed and the delta is ~3.9% of the bytes.
The diff runs where the tensors live (on an accelerator only the encoding crosses to the host).
Decoding checks every count and range and writes only inside its piece; a malformed encoding raises
`DeltaError`. Either way the receiver hashes the whole rebuilt bucket and compares it with the
sender's digest of the new weights, so a delta push is as exact as a full one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import xxhash

from weight_sync.bucket import Bucket, as_bytes, format_parts_digest, parse_parts

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SKIP = 255
_BITS = torch.arange(8, dtype=torch.int32)


class DeltaError(ValueError):
    """A delta encoding that does not decode into its bucket (corrupted, truncated, wrong plan)."""


def _pad(n: int) -> int:
    return -(-n // 8) * 8


def width(dtype: torch.dtype, offset: int, length: int) -> int:
    """Bytes per element the diff compares: the dtype's, where the piece is made of whole elements."""
    w = dtype.itemsize
    return w if w in _INTS and offset % w == 0 and length % w == 0 else 1


def _upper(x: torch.Tensor, w: int) -> torch.Tensor:
    """Everything but the low byte of each element (w-byte integers)."""
    return x >> 8 if w > 1 else torch.zeros_like(x)


# ---- the sender's side ------------------------------------------------------------------------
@dataclass
class PieceDiff:
    """What changed in one piece, encoded (tensors where the piece lives), and the change itself."""
    name: str
    index: torch.Tensor      # int64 [n]: the elements that changed
    values: torch.Tensor     # [n]: their new values (w-byte integers)
    gaps: torch.Tensor       # uint8
    low: torch.Tensor        # uint8 [n]
    flags: torch.Tensor      # uint8 [ceil(n / 8)]
    full: torch.Tensor       # w-byte integers
    elements: int
    width: int

    @property
    def nbytes(self) -> int:
        return 24 + _pad(self.gaps.numel()) + _pad(self.low.numel()) + _pad(self.flags.numel()) + \
            _pad(self.width * self.full.numel())


def diff_piece(name: str, new: torch.Tensor, base: torch.Tensor, w: int) -> PieceDiff:
    """`new` and `base`: flat uint8 views of the same piece; compared as w-byte integers (so a NaN
    or a -0.0 that differs in its bits is a change, one that does not is not)."""
    new_i, base_i = new.view(_INTS[w]), base.view(_INTS[w])
    index = (new_i != base_i).nonzero().flatten()
    values = new_i[index]
    gap = torch.diff(index, prepend=index.new_full((1,), -1)) - 1        # unchanged elements before each
    runs = gap // _SKIP + 1                                              # skip bytes, then its own byte
    gaps = torch.full((int(runs.sum()),), _SKIP, dtype=torch.uint8, device=index.device)
    gaps[runs.cumsum(0) - 1] = (gap % _SKIP).to(torch.uint8)
    flagged = _upper(values, w) != _upper(base_i[index], w)
    bits = torch.nn.functional.pad(flagged.to(torch.int32), (0, -flagged.numel() % 8)).view(-1, 8)
    flags = (bits << _BITS.to(bits.device)).sum(1).to(torch.uint8)
    return PieceDiff(name, index, values, gaps, (values & 0xFF).to(torch.uint8), flags, values[flagged],
                     new_i.numel(), w)


def write_delta(diffs: list[PieceDiff], wire: torch.Tensor) -> int:
    """Encode the pieces' diffs into `wire` (flat uint8, host memory; large enough); returns the
    bytes used. Device tensors come over into it."""
    at = 0
    for d in diffs:
        wire[at:at + 24].copy_(torch.tensor([d.low.numel(), d.gaps.numel(), d.full.numel()]).view(torch.uint8))
        at += 24
        for part in (d.gaps, d.low, d.flags, d.full):
            raw = part.reshape(-1).view(torch.uint8)
            wire[at:at + raw.numel()].copy_(raw)
            at += _pad(raw.numel())
    return at


def apply_diff(d: PieceDiff, target: torch.Tensor) -> None:
    """The diff onto `target` (the flat uint8 view of the same piece, where the diff was taken)."""
    target.view(_INTS[d.width])[d.index] = d.values


# ---- the receiver's side ----------------------------------------------------------------------
def _take(wire: torch.Tensor, at: int, nbytes: int, what: str) -> tuple[torch.Tensor, int]:
    if nbytes < 0 or at + nbytes > wire.numel():
        raise DeltaError(f"{what}: {nbytes} bytes at {at} run past the {wire.numel()} received")
    return wire[at:at + nbytes], at + _pad(nbytes)


def decode_onto(wire: torch.Tensor, at: int, target: torch.Tensor, w: int, undo: list | None = None) -> int:
    """Decode the piece whose encoding starts at byte `at` onto `target` (the piece's flat uint8
    bytes, holding the base), recording what it overwrites in `undo`; returns where the next
    piece's encoding starts."""
    head, at = _take(wire, at, 24, "header")
    n, ngaps, nfull = (int(x) for x in head.clone().view(torch.int64))    # clone: `at` may be unaligned
    elements = target.view(_INTS[w])
    if not (0 <= n <= elements.numel() and n <= ngaps and 0 <= nfull <= n):
        raise DeltaError(f"header claims {n} changes, {ngaps} gap bytes, {nfull} full values in a piece of "
                         f"{elements.numel()} elements")
    gaps, at = _take(wire, at, ngaps, "gaps")
    low, at = _take(wire, at, n, "low bytes")
    flags, at = _take(wire, at, -(-n // 8), "flags")
    full, at = _take(wire, at, w * nfull, "full values")
    g = gaps.to(torch.int64)
    change = g != _SKIP
    index = (torch.where(change, g + 1, _SKIP).cumsum(0) - 1)[change]
    flagged = ((flags.to(torch.int32)[:, None] >> _BITS) & 1).flatten()[:n].bool()
    if index.numel() != n or (n and int(index[-1]) >= elements.numel()) or int(flagged.sum()) != nfull:
        raise DeltaError(f"the gaps give {index.numel()} changes up to element {int(index[-1]) if n else -1} and "
                         f"the flags {int(flagged.sum())} full values, for {n} changes and {nfull} full values in "
                         f"a piece of {elements.numel()} elements")
    index = index.to(target.device)
    old = elements[index]
    values = old & ~0xFF | low.to(target.device).to(old.dtype) if w > 1 else low.to(target.device).clone()
    values[flagged.to(target.device)] = full.clone().view(_INTS[w]).to(target.device)
    if undo is not None:
        undo.append((elements, index, old))
    elements[index] = values
    return at


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
        if base is not None:
            dst.copy_(as_bytes(base[p.name])[p.offset:p.offset + p.length])
        at = decode_onto(wire, at, dst, width(targets[p.name].dtype, p.offset, p.length), undo)
        h.update((dst if dst.device.type == "cpu" else dst.cpu()).numpy())
    return h.hexdigest()


def unpack_parts(bucket: Bucket, slot: torch.Tensor, targets: dict[str, torch.Tensor], like: str,
                 base: dict[str, torch.Tensor] | None = None, undo: list | None = None) -> str:
    """A bucket several ranks wrote (a parts digest, `like`), some of its ranges as deltas: each range
    is copied out of the slot, or rebuilt onto its base from the delta at its start, into `targets`;
    returns the parts digest of what landed there, in `like`'s form. A range lies inside one piece."""
    out = []
    for start, length, wire in parse_parts(like):
        p = next((p for p in bucket.pieces if p.bucket_offset <= start and start + length <= p.bucket_offset + p.length),
                 None)
        if p is None:
            raise DeltaError(f"bytes {start}+{length} of bucket {bucket.index} span pieces")
        at = p.offset + start - p.bucket_offset
        dst = as_bytes(targets[p.name])[at:at + length]
        if wire is None:
            dst.copy_(slot[start:start + length])
        else:
            if base is not None:
                dst.copy_(as_bytes(base[p.name])[at:at + length])
            decode_onto(slot[start:start + min(wire, length)], 0, dst, width(targets[p.name].dtype, at, length), undo)
        h = xxhash.xxh3_128_hexdigest((dst if dst.device.type == "cpu" else dst.cpu()).numpy())
        out.append((start, length, h, wire))
    return format_parts_digest(out, bucket.nbytes)


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

    def _pair(self, name: str, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.tensors.get(name)
        if t is None or t.shape != like.shape or t.dtype != like.dtype or t.device != like.device:
            t = self.tensors[name] = torch.empty_like(like)
            self.mirror[name] = t if t.device.type == "cpu" else torch.empty(
                like.shape, dtype=like.dtype, pin_memory=True)
        return as_bytes(t), as_bytes(self.mirror[name])

    def view(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The base's bytes of tensor `name`, shaped as `like` (made, uninitialised, on first use)."""
        return self._pair(name, like)[0]

    def take(self, bucket: Bucket, sources: dict[str, torch.Tensor], packed: torch.Tensor | None = None) -> None:
        """After a whole bucket went (packed into `packed`, host memory, or None: written from the
        sources as they lie): the base takes its new bytes."""
        for p in bucket.pieces:
            base, mirror = self._pair(p.name, sources[p.name])
            new = as_bytes(sources[p.name])[p.offset:p.offset + p.length]
            if base.data_ptr() != mirror.data_ptr():
                base[p.offset:p.offset + p.length].copy_(new)
            mirror[p.offset:p.offset + p.length].copy_(
                new if packed is None else packed[p.bucket_offset:p.bucket_offset + p.length])

    def pack(self, bucket: Bucket, sources: dict[str, torch.Tensor], wire: torch.Tensor) -> tuple[int, str] | None:
        """Encode what changed in the bucket since the base into `wire` and move the base on to the new
        bytes; returns (bytes used, digest of the bucket's new bytes), or None when the delta would
        not pay (the bucket then goes whole: pack it and `take` it)."""
        diffs = []
        for p in bucket.pieces:
            src = sources[p.name]
            base, _ = self._pair(p.name, src)
            w = width(src.dtype, p.offset, p.length)
            diffs.append(diff_piece(p.name, as_bytes(src)[p.offset:p.offset + p.length],
                                    base[p.offset:p.offset + p.length], w))
        self.changed += sum(d.index.numel() for d in diffs)
        self.elements += sum(d.elements for d in diffs)
        size = sum(d.nbytes for d in diffs)
        if size > self.max_fraction * bucket.nbytes or size > wire.numel():
            return None
        used = write_delta(diffs, wire)
        device = next(iter(sources.values())).device
        if device.type != "cpu":
            from platforms import platform_of
            platform_of(device).synchronize(device)
        h = xxhash.xxh3_128()
        at = 0
        for p, d in zip(bucket.pieces, diffs):
            base, mirror = self._pair(p.name, sources[p.name])
            apply_diff(d, base[p.offset:p.offset + p.length])
            if mirror.data_ptr() != base.data_ptr():     # the host copy takes the changes from the wire
                decode_onto(wire, at, mirror[p.offset:p.offset + p.length], d.width)
            at += d.nbytes
            # On the CPU the digest is of the trainer's bytes themselves; elsewhere of the host copy.
            new = as_bytes(sources[p.name])[p.offset:p.offset + p.length] if device.type == "cpu" else \
                mirror[p.offset:p.offset + p.length]
            h.update(new.numpy())
        return used, h.hexdigest()

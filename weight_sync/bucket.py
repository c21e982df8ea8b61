"""Bucket planning, packing and digests.

A plan lays every tensor's bytes into buckets of at most `bucket_bytes`. A tensor never spans two
buckets unless it alone is larger than a bucket; then it is cut into bucket-sized pieces. Both sides
derive the same plan from the same ordered specs, so only specs and the bucket size cross the wire.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import xxhash

from platforms import platform_of

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
    torch.uint8, torch.bool)}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype].itemsize
        for s in self.shape:
            n *= s
        return n

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> "TensorSpec":
        return cls(name, str(t.dtype).removeprefix("torch."), tuple(t.shape))


@dataclass(frozen=True)
class Piece:
    name: str
    offset: int         # byte offset inside the tensor
    length: int         # bytes
    bucket_offset: int  # byte offset inside the bucket


@dataclass(frozen=True)
class Bucket:
    index: int
    pieces: tuple[Piece, ...]
    nbytes: int


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[Bucket] = []
    pieces: list[Piece] = []
    used = 0

    def close():
        nonlocal pieces, used
        if pieces:
            buckets.append(Bucket(len(buckets), tuple(pieces), used))
        pieces, used = [], 0

    for spec in specs:
        size = spec.nbytes
        if size > bucket_bytes:          # alone larger than a bucket: cut into bucket-sized pieces
            close()
            for off in range(0, size, bucket_bytes):
                pieces, used = [Piece(spec.name, off, min(bucket_bytes, size - off), 0)], min(bucket_bytes, size - off)
                close()
            continue
        if used + size > bucket_bytes:
            close()
        pieces.append(Piece(spec.name, 0, size, used))
        used += size
    close()
    return buckets


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8)


_CHUNK = 1 << 20   # copy-then-hash 1 MiB at a time, while it is in cache: 23 ms per 128 MiB here, against 30


def copy_hashed(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """Copy each (dst, src) pair of flat uint8 CPU views, in order; xxh3-128 of everything copied."""
    h = xxhash.xxh3_128()
    for dst, src in pairs:
        for at in range(0, dst.numel(), _CHUNK):
            d = dst[at:at + _CHUNK]
            d.copy_(src[at:at + _CHUNK])
            h.update(d.numpy())
    return h.hexdigest()


def pack(bucket: Bucket, tensors: dict[str, torch.Tensor], slot: torch.Tensor) -> str:
    """Copy the bucket's pieces into `slot` (flat uint8, host memory); tensors already have the
    receiver's dtype. Returns the bucket's digest (the pieces lie end to end: it is the digest of the
    slot). Pieces on an accelerator come over by DMA, all queued before one wait, and the digest is
    taken of the host bytes they became."""
    pairs = [(slot[p.bucket_offset:p.bucket_offset + p.length], as_bytes(tensors[p.name])[p.offset:p.offset + p.length])
             for p in bucket.pieces]
    devices = {src.device for _, src in pairs if src.device.type != "cpu"}
    if not devices:
        return copy_hashed(pairs)
    for dst, src in pairs:
        dst.copy_(src, non_blocking=True)
    for device in devices:
        platform_of(device).synchronize(device)
    return digest(slot[:bucket.nbytes])


def unpack_verified(bucket: Bucket, slot: torch.Tensor, tensors: dict[str, torch.Tensor], like: str = "",
                    stream=None) -> str:
    """Copy the bucket's pieces out of `slot` into their places in `tensors`; return the digest of
    the bytes that landed there, in the form of `like` (the sender's digest: one of the whole
    bucket, or a parts digest). On the CPU a whole-bucket digest is that of the copy itself.
    Otherwise the slot is hashed before and after the copy: bytes that changed in between (a late
    write) make the two differ, and the result then matches no sender's digest. Copies to an
    accelerator run on `stream` (a copy stream, so they do not queue behind the engine's steps)."""
    pairs = [(as_bytes(tensors[p.name])[p.offset:p.offset + p.length], slot[p.bucket_offset:p.bucket_offset + p.length])
             for p in bucket.pieces]
    parts = is_parts_digest(like)
    if not parts and all(dst.device.type == "cpu" for dst, _ in pairs):
        return copy_hashed(pairs)
    ranges = parse_parts_digest(like) if parts else None
    check = (lambda: parts_digest(slot, ranges)) if parts else (lambda: digest(slot[:bucket.nbytes]))
    before = check()
    _copy_all(pairs, stream)
    after = check()
    return after if after == before else f"changed during the copy ({before} -> {after})"


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]], stream) -> None:
    """Every (dst, src) copy, host to device by DMA on `stream` where one is given; returns once done."""
    if stream is None:
        for dst, src in pairs:
            dst.copy_(src)
        return
    platform = platform_of(stream.device)
    with platform.module().stream(stream):
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
    stream.synchronize()


def host_buffer(nbytes: int, alignment: int = 1, pinned: bool = False) -> torch.Tensor:
    """A flat uint8 staging buffer in host memory, start and length multiples of `alignment`,
    page-locked when an accelerator copies from or into it by DMA."""
    length = -(-nbytes // alignment) * alignment
    raw = torch.empty(length + alignment - 1, dtype=torch.uint8, pin_memory=pinned)
    start = -raw.data_ptr() % alignment
    return raw[start:start + length]


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous in host memory: as it is when it already is; from an accelerator by one DMA
    into page-locked memory."""
    if t.device.type == "cpu":
        return t.contiguous()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    platform_of(t.device).synchronize(t.device)
    return out


# A bucket written by several senders (the ranks of a sharded trainer, each its own bytes) has no
# one sender that saw all of it: its digest is a list of parts, each range's own xxh3-128, ranges in
# order and covering the bucket: "parts:START+LENGTH=HEX;...". A range sent as a delta (delta.py)
# says how many bytes of it the encoding fills: "START+LENGTH~WIRE=HEX", HEX the rebuilt bytes'.
_PARTS = "parts:"


def is_parts_digest(d: str) -> bool:
    return d.startswith(_PARTS)


def format_parts_digest(parts: list[tuple], nbytes: int) -> str:
    """The digest of a bucket of `nbytes` from its parts (start, length, xxh3 hex[, delta bytes]); they
    must cover the bucket exactly, without overlap."""
    parts = sorted(parts)
    at = 0
    for start, length, *_ in parts:
        if start != at or length <= 0:
            raise ValueError(f"bucket parts do not tile it: a part at {start} (+{length}) where {at} was next")
        at += length
    if at != nbytes:
        raise ValueError(f"bucket parts cover {at} of its {nbytes} bytes")
    return _PARTS + ";".join(f"{p[0]}+{p[1]}" + (f"~{p[3]}" if len(p) > 3 and p[3] else "") + f"={p[2]}"
                             for p in parts)


def parse_parts(d: str) -> list[tuple[int, int, int | None]]:
    """(start, length, delta bytes or None) of each part of a parts digest."""
    out = []
    for item in d.removeprefix(_PARTS).split(";"):
        where, _, _ = item.partition("=")
        start, _, rest = where.partition("+")
        length, _, wire = rest.partition("~")
        out.append((int(start), int(length), int(wire) if wire else None))
    return out


def parse_parts_digest(d: str) -> list[tuple[int, int]]:
    return [(s, n) for s, n, _ in parse_parts(d)]


def parts_digest(slot: torch.Tensor, ranges: list[tuple[int, int]]) -> str:
    """The parts digest of the slot's bytes over `ranges`."""
    return _PARTS + ";".join(f"{s}+{n}={digest(slot[s:s + n])}" for s, n in ranges)


def digest(data: torch.Tensor) -> str:
    """xxh3-128 of a CPU uint8 tensor's bytes (~20 GB/s)."""
    return xxhash.xxh3_128_hexdigest(data.numpy())

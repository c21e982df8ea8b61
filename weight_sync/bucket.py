"""Bucket planning, packing and digests.

A plan lays every tensor's bytes into buckets of at most `bucket_bytes`. A tensor never spans two
buckets unless it alone is larger than a bucket; then it is cut into bucket-sized pieces. Both sides
derive the same plan from the same ordered specs, so only specs and the bucket size cross the wire.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import xxhash

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


def bucket_offsets(plan: list[Bucket]) -> list[int]:
    """Bucket k holds bytes [offsets[k], offsets[k] + nbytes) of all tensors laid end to end in
    spec order: the plan cuts that one byte stream, so a flat buffer in that layout takes every
    bucket in place."""
    out, pos = [], 0
    for b in plan:
        out.append(pos)
        pos += b.nbytes
    return out


def flat_views(specs: list[TensorSpec], flat: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """Tensors viewing `flat` (uint8) in spec order, or None when a dtype would sit misaligned."""
    views, pos = {}, 0
    for s in specs:
        dtype = DTYPES[s.dtype]
        if pos % dtype.itemsize:
            return None
        views[s.name] = flat[pos:pos + s.nbytes].view(dtype).view(s.shape)
        pos += s.nbytes
    return views


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def pack(bucket: Bucket, tensors: dict[str, torch.Tensor], slot: torch.Tensor) -> None:
    """Copy the bucket's pieces into `slot` (flat uint8); tensors already have the receiver's dtype."""
    for p in bucket.pieces:
        slot[p.bucket_offset:p.bucket_offset + p.length].copy_(as_bytes(tensors[p.name])[p.offset:p.offset + p.length])


def unpack(bucket: Bucket, slot: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
    """Copy the bucket's pieces out of `slot` into their places in `tensors`."""
    for p in bucket.pieces:
        as_bytes(tensors[p.name])[p.offset:p.offset + p.length].copy_(slot[p.bucket_offset:p.bucket_offset + p.length])


def digest(data: torch.Tensor) -> str:
    """xxh3-128 of a CPU uint8 tensor's bytes (~20 GB/s)."""
    return xxhash.xxh3_128_hexdigest(data.numpy())

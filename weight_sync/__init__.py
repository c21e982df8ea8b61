"""Weight sync: stream a trainer's new weights into running inference servers, verified, two-phase."""
from __future__ import annotations

import hashlib
from typing import Iterable, Mapping

import torch


def named_weights(source: torch.nn.Module | Mapping[str, torch.Tensor] | Iterable) -> dict[str, torch.Tensor]:
    """What a push sends, by checkpoint name: a module's parameters (a tied weight once, under its
    first name; buffers are not weights a trainer changes, and servers load their own), or a
    mapping / iterable of (name, tensor) as given."""
    if isinstance(source, torch.nn.Module):
        return {n: p.detach() for n, p in source.named_parameters()}
    return dict(source)


def live_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """blake2b over every tensor's bytes in name order: equal digests mean equal weights."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(tensors.items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

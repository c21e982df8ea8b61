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


def merge_lora(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """base + lora_B @ lora_A * scale, in fp32 as peft merges, rounded once to base's dtype (into
    `out` where given: in fp32 one pass, no temporaries). Every merge of an adapter (a receiver's, the
    engine's beside its steps, a served-weights digest) goes through here, so all give the same bits."""
    a, b = lora_a.float(), lora_b.float()
    if base.dtype == torch.float32:
        return torch.addmm(base, b, a, alpha=scale, out=out) if out is not None else torch.addmm(base, b, a, alpha=scale)
    merged = torch.addmm(base.float(), b, a, alpha=scale).to(base.dtype)
    return out.copy_(merged) if out is not None else merged

"""Contiguous per-slot KV cache: slot `i` holds sequence `running[i]`'s keys and values."""
from __future__ import annotations

import logging

import torch

from platforms import platform_of

log = logging.getLogger(__name__)

KV_MEMORY_FRACTION = 0.85   # of an accelerator's free memory once the weights are loaded; the rest: activations


def kv_slots_that_fit(requested: int, config, context_length: int, dtype: torch.dtype, device: torch.device) -> int:
    """How many sequences' KV caches to allocate: `requested`, or on an accelerator as many as fit
    in KV_MEMORY_FRACTION of its free memory (fewer with a warning; an error when not even one fits).
    `config`: the model's (layers, KV heads, head size)."""
    platform = platform_of(device)
    if not platform.accelerator:
        return requested
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    per_slot = 2 * config.num_hidden_layers * kv_heads * context_length * head_dim * dtype.itemsize
    free, total = platform.memory(device)
    fit = int(free * KV_MEMORY_FRACTION) // per_slot
    if fit < 1:
        raise ValueError(f"the KV cache of one sequence at context {context_length} takes {per_slot / 2**20:.0f} MiB; "
                         f"{device} has {free / 2**30:.2f} of {total / 2**30:.1f} GiB free after the weights: "
                         f"lower --context-length")
    if fit < requested:
        log.warning("%s: KV caches for %d of the %d requested running sequences fit in %.2f GiB free at context %d: "
                    "running at most %d", device, fit, requested, free / 2**30, context_length, fit)
    return min(requested, fit)


class SlotKVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, context_length: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        shape = (num_layers, num_slots, num_kv_heads, context_length, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write_prefill(self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [kv_heads, len, head_dim]
        n = k.shape[1]
        self.k[layer, slot, :, :n] = k
        self.v[layer, slot, :, :n] = v

    def write_decode(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     first_slot: int = 0) -> None:
        # k, v: [batch, kv_heads, head_dim]; batch row b lives in slot first_slot + b
        rows = torch.arange(first_slot, first_slot + k.shape[0], device=k.device)
        self.k[layer, rows, :, positions] = k
        self.v[layer, rows, :, positions] = v

    def rows(self, layer: int, start: int, end: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        # [end - start, kv_heads, length, head_dim] of slots [start, end), strided views: no copy
        return self.k[layer, start:end, :, :length], self.v[layer, start:end, :, :length]

    def move(self, src: int, dst: int, length: int) -> None:
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def permute(self, order: list[int], lengths: list[int]) -> None:
        """New slot i takes old slot order[i]; `lengths[j]`: valid positions of old slot j. Follows
        the permutation's cycles, so each moved slot is copied once (one spare copy per cycle)."""
        done = [False] * len(order)
        for first in range(len(order)):
            if done[first] or order[first] == first:
                continue
            spare = (self.k[:, first, :, :lengths[first]].clone(), self.v[:, first, :, :lengths[first]].clone())
            dst = first
            while True:
                done[dst] = True
                src = order[dst]
                if src == first:
                    n = lengths[first]
                    self.k[:, dst, :, :n], self.v[:, dst, :, :n] = spare
                    break
                self.move(src, dst, lengths[src])
                dst = src

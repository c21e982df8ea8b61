"""KV caches. `PagedKVCache` (the default): a pool of fixed-size blocks, each sequence holding the
blocks its tokens fill (`blocks.BlockAllocator` says which), so memory goes by tokens held.
`SlotKVCache`: one contiguous slot a running sequence, allocated at the full context length (slot `i`
holds sequence `running[i]`'s keys and values)."""
from __future__ import annotations

import logging

import torch

from platforms import platform_of

log = logging.getLogger(__name__)

KV_MEMORY_FRACTION = 0.85   # of an accelerator's free memory once the weights are loaded; the rest: activations
# Of the host's available memory, for a CPU server given no budget: the model, the trainer and the other
# servers of a job need the rest (a job gives each of its servers its share: trainer_bridge/memory.py).
# A real 8k-context model at max_running x context would take 24 GB (SmolLM2-135M: 64 x 8192 x 45 KiB).
CPU_KV_FRACTION = 0.25


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Keys and values of one position over all layers. `config`: the model's (layers, KV heads, head size)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def kv_budget(budget_gb: float | None, device: torch.device, cap: int | None = None) -> tuple[int, str]:
    """(bytes, where from) for the KV cache: `budget_gb` (--kv-cache-gb) on any device; else on an
    accelerator KV_MEMORY_FRACTION of its free memory once the weights are loaded; else (a CPU)
    CPU_KV_FRACTION of the host's available memory, or `cap` (what the cache could ever use: every
    running sequence at the full context) when that is less."""
    if budget_gb is not None:
        if budget_gb <= 0:
            raise ValueError(f"--kv-cache-gb must be > 0, got {budget_gb}")
        return int(budget_gb * 2**30), f"--kv-cache-gb {budget_gb:g}"
    platform = platform_of(device)
    free, total = platform.memory(device)
    if platform.accelerator:
        return int(free * KV_MEMORY_FRACTION), f"{free / 2**30:.2f} of {total / 2**30:.1f} GiB free on {device} after the weights"
    share = int(free * CPU_KV_FRACTION)
    source = f"{CPU_KV_FRACTION:.0%} of the host's {free / 2**30:.1f} GiB available"
    if cap is not None and cap < share:
        return cap, f"every running sequence at the full context, less than {source}"
    return share, source


def kv_blocks_that_fit(budget_gb: float | None, config, context_length: int, block_size: int, max_running: int,
                       dtype: torch.dtype, device: torch.device) -> int:
    """Blocks of the paged cache: as many as the budget holds (kv_budget; never more than
    `max_running` full contexts). An error when they do not hold one sequence at the full context,
    which could then never finish."""
    per_block = kv_bytes_per_token(config, dtype) * block_size
    per_context = -(-context_length // block_size)
    budget, source = kv_budget(budget_gb, device, cap=max_running * per_context * per_block)
    blocks = budget // per_block
    if blocks < per_context:
        raise ValueError(f"the KV budget ({source}: {budget / 2**30:.3g} GiB) holds {blocks * block_size} tokens, "
                         f"fewer than one sequence at context {context_length}: lower --context-length or raise "
                         f"--kv-cache-gb")
    return blocks


def kv_slots_that_fit(requested: int, config, context_length: int, dtype: torch.dtype, device: torch.device,
                      budget_gb: float | None = None) -> int:
    """How many sequences' contiguous KV slots to allocate: `requested`, or as many as fit in the
    budget (kv_budget): fewer with a warning, an error when not even one fits."""
    per_slot = kv_bytes_per_token(config, dtype) * context_length
    budget, source = kv_budget(budget_gb, device, cap=requested * per_slot)
    fit = budget // per_slot
    if fit < 1:
        raise ValueError(f"the KV cache of one sequence at context {context_length} takes {per_slot / 2**20:.0f} MiB; "
                         f"the budget is {source}: lower --context-length")
    if fit < requested:
        log.warning("%s: KV slots for %d of the %d requested running sequences fit in %s at context %d: "
                    "running at most %d", device, fit, requested, source, context_length, fit)
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


class PagedKVCache:
    """`k`, `v`: [layers, blocks, kv_heads, block_size, head_dim]: a block holds each KV head's
    positions contiguously, so that gathering a sequence's blocks head by head gives the
    [kv_heads, positions, head_dim] layout attention reads, with no copy after the gather. Position p
    of KV head h of a sequence holding blocks B is row (B[p // block_size] * kv_heads + h) *
    block_size + p % block_size of a layer's `flat` view."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        # zeros, not empty: a padded read past a row's length must see finite values (masked to 0)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size, self.num_kv_heads = block_size, num_kv_heads

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[blocks * kv_heads, block_size, head_dim] views of a layer: page b * kv_heads + h is KV
        head h of block b."""
        return self.k[layer].flatten(0, 1), self.v[layer].flatten(0, 1)

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[blocks * kv_heads * block_size, head_dim] views of a layer."""
        return self.k[layer].flatten(0, 2), self.v[layer].flatten(0, 2)

    def copy_block(self, src: int, dst: int) -> None:
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

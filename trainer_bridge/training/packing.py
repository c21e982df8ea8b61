"""Sequence packing: a micro-batch's right-padded rows laid end to end in a few rows of up to
`capacity` tokens, so a forward pass spends nothing on padding.

Each sequence's position ids start again at 0 and the model gets no attention mask: Hugging Face
causal LMs (transformers' `masking_utils`, and flash-attention's varlen path on GPUs) then keep
attention inside each sequence, as verl's `use_remove_padding` and TRL's `padding_free` do. A
row of a packed batch holds whole sequences (first-fit by length, longest first), so attention
costs no more than the padded batch's (a row is never longer than `capacity` or the longest
sequence), and the capacity that leaves fewer tokens in all is taken (the longest sequence's, when
packing would only widen the rows). `Packed.source` and `keep` lay the bins' per-token values back out as
the padded rows, [rows, seq - 1], zero past each sequence.

`micro_batches` cuts a mini-batch's rows into micro-batches by count and tokens
(trainer.max_tokens_per_micro_batch), like verl's ppo_max_token_len_per_gpu.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Packed:
    input_ids: Tensor       # [bins, width]
    position_ids: Tensor    # [bins, width]: 0.. per sequence (the tail of a bin counts on as one more)
    source: Tensor          # [kept]: flat index into [bins, width - 1] of each kept (row, t)
    keep: Tensor            # [rows, seq - 1] bool: t < the row's length - 1 (a next token exists)

    @property
    def bins(self) -> int:
        return self.input_ids.shape[0]


def pack(input_ids: Tensor, attention_mask: Tensor, capacity: int) -> Packed:
    """Right-padded `input_ids` [rows, seq] (length per row: `attention_mask`'s sum) as bins of up to
    max(capacity, longest) tokens."""
    rows, seq = input_ids.shape
    lengths = attention_mask.sum(1).tolist()
    if min(lengths, default=1) < 1:
        raise ValueError("pack: a row with no tokens (attention_mask all 0)")
    # Every bin is padded to the widest, so a wide bin costs every row: of the two capacities (the
    # longest sequence, which never widens a row, and `capacity`), the one with fewer tokens in all.
    options = [_first_fit(lengths, c) for c in sorted({max(lengths), max(capacity, max(lengths))})]
    bins = min(options, key=lambda b: len(b) * max(x[0] for x in b))
    width = max(b[0] for b in bins)
    ids = torch.zeros(len(bins), width, dtype=input_ids.dtype)
    pos = torch.zeros(len(bins), width, dtype=torch.long)
    start = [0] * rows                    # flat offset of each row's first token
    for i, (used, *members) in enumerate(bins):
        at = 0
        for row in members:
            n = lengths[row]
            ids[i, at:at + n] = input_ids[row, :n]
            pos[i, at:at + n] = torch.arange(n)
            start[row] = i * (width - 1) + at     # in [bins, width - 1] (next-token logprobs) flattened
            at += n
        pos[i, at:] = torch.arange(width - at)    # the tail: a sequence of its own, never read
    keep = torch.arange(seq - 1).unsqueeze(0) < (torch.tensor(lengths) - 1).unsqueeze(1)
    offsets = torch.tensor(start).unsqueeze(1) + torch.arange(seq - 1).unsqueeze(0)
    return Packed(ids.to(input_ids.device), pos.to(input_ids.device), offsets[keep].to(input_ids.device),
                  keep.to(input_ids.device))


def _first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows into bins of up to `capacity` tokens, longest first, each into the first bin it fits:
    [used, row, row, ...] per bin."""
    bins: list[list[int]] = []
    for row in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        for b in bins:
            if b[0] + lengths[row] <= capacity:
                b[0] += lengths[row]
                b.append(row)
                break
        else:
            bins.append([lengths[row], row])
    return bins


def micro_batches(lengths: list[int], max_rows: int, max_tokens: int) -> list[list[int]]:
    """Indexes into `lengths` (tokens per row) grouped into micro-batches of at most `max_rows` rows
    and `max_tokens` tokens (0: no token limit; a row longer than that is a micro-batch of its own):
    first fit, longest first, so the rows of a micro-batch have like lengths."""
    groups: list[list[int]] = []
    used: list[int] = []                  # tokens in each group
    for row in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        for g, group in enumerate(groups):
            if len(group) < max_rows and (max_tokens == 0 or used[g] + lengths[row] <= max_tokens):
                group.append(row)
                used[g] += lengths[row]
                break
        else:
            groups.append([row])
            used.append(lengths[row])
    return groups

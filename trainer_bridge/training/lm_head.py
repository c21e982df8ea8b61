"""Next-token logprobs and entropies from a causal LM's last hidden states, a chunk of positions at a
time, never the [tokens, vocab] logits of a whole micro-batch: the fused linear + log-softmax of
Liger-Kernel and verl.

Each chunk's logits, head(hidden) / temperature, live only inside a `torch.utils.checkpoint`: the
forward pass keeps the chunk's logprob and entropy ([chunk] each) and drops its logits; backward
recomputes them one chunk at a time. Peak memory is a few [chunk_tokens, vocab] float32 tensors
(trainer.logits_chunk_tokens), whatever the micro-batch's length; the cost is one more head matmul
a chunk in backward.

The head runs inside the model's own forward (`head_replaced` swaps the head's forward for the
chunked computation while the model runs), so the model's `.logits` come back as these values: a
model sharded with FSDP2 gathers the head's weights in its root forward and again before its
backward, as for full logits. Tied embeddings need nothing: the head's weight is the embedding's.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# Config fields of models whose logits are not head(hidden) alone (Gemma 2's soft cap, Cohere's and
# Granite's scales): those models keep the full-logits path rather than get wrong logprobs.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def output_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The linear layer whose output is the model's logits (a Hugging Face causal LM's lm_head), or
    None for a model without one to call apart (a custom model, or logits transformed after it)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    config = getattr(model, "config", None)
    if not isinstance(head, torch.nn.Linear) or config is None:
        return None
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    return head


@contextmanager
def head_replaced(head: torch.nn.Module, forward: Callable[[Tensor], Tensor]) -> Iterator[None]:
    """`head` computes `forward` instead of its logits while the block runs (an instance attribute,
    removed after, so hooks on the module, FSDP2's included, still run around it)."""
    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def positions_forward(head: torch.nn.Linear, input_ids: Tensor, index: Tensor, temperature: float,
                      entropy: bool, entropy_grad: bool, chunk_tokens: int) -> Callable[[Tensor], Tensor]:
    """A forward for `head_replaced`: from the hidden states [rows, seq, hidden] of `input_ids`
    [rows, seq], the logprob (and entropy) of the next token at `index` [kept], flat indexes into
    [rows, seq - 1], as [kept, 1 + entropy]."""
    def forward(hidden: Tensor) -> Tensor:
        width = input_ids.shape[1] - 1
        row, col = index // width, index % width
        return chunked_logprobs(hidden[row, col], input_ids[row, col + 1], head, temperature, entropy,
                                entropy_grad, chunk_tokens)
    return forward


def chunked_logprobs(hidden: Tensor, targets: Tensor, head: torch.nn.Linear, temperature: float,
                     entropy: bool, entropy_grad: bool, chunk_tokens: int) -> Tensor:
    """log softmax(head(hidden) / temperature) at `targets`, and with `entropy` the entropy of that
    distribution, for hidden [tokens, hidden] and targets [tokens]: [tokens, 1 + entropy], float32.
    The entropy carries gradient only with `entropy_grad` (an entropy bonus in the loss)."""
    def one(h: Tensor, t: Tensor) -> Tensor:
        return _chunk(h, t, head, temperature, entropy, entropy_grad)
    parts = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens]
        if torch.is_grad_enabled():          # backward recomputes the chunk's logits
            parts.append(checkpoint(one, h, t, use_reentrant=False))
        else:
            parts.append(one(h, t))
    return torch.cat(parts) if parts else hidden.new_zeros(0, 1 + entropy, dtype=torch.float32)


def _chunk(hidden: Tensor, targets: Tensor, head: torch.nn.Linear, temperature: float, entropy: bool,
           entropy_grad: bool) -> Tensor:
    # head.weight is read here, at the call: under FSDP2 it is the gathered weight in forward and in
    # the backward's recompute alike.
    logits = F.linear(hidden, head.weight, head.bias)                          # [chunk, vocab]
    logprobs, ent = LogprobEntropy.apply(logits, targets, temperature, entropy, entropy_grad)
    return torch.stack([logprobs, ent], -1) if entropy else logprobs.unsqueeze(-1)


class LogprobEntropy(torch.autograd.Function):
    """From logits [chunk, vocab]: log softmax(logits / temperature) at targets [chunk], and the
    entropy of that softmax (zeros without `entropy`; differentiable with `entropy_grad`), float32.

    Its gradient in closed form, computed in place: backward holds 2-3 [chunk, vocab] float32
    tensors where autograd's logsumexp + gather + softmax held 5-6 (a train step of 2048 tokens,
    vocab 49,152, chunks of 1024, entropy bonus on: peak RSS 1.16 GB above the model's, 0.75 GB
    this way)."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, entropy: bool,
                entropy_grad: bool) -> tuple[Tensor, Tensor]:
        scaled = logits.float() / temperature                                 # [chunk, vocab]
        lse = scaled.logsumexp(-1)                                            # [chunk]
        logprobs = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        ent = torch.zeros_like(lse)
        if entropy:             # H = lse - sum(p * scaled), p = softmax(scaled)
            ent = lse - (scaled - lse.unsqueeze(-1)).exp_().mul_(scaled).sum(-1)
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(scaled, targets, lse, ent)
        ctx.temperature, ctx.dtype = temperature, logits.dtype
        return logprobs, ent

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None):
        scaled, targets, lse, ent = ctx.saved_tensors
        g_lp = (grad_logprobs if grad_logprobs is not None else torch.zeros_like(lse)).unsqueeze(-1)  # [chunk, 1]
        # d logprob/d scaled = onehot(target) - p;  d H/d scaled = -p * (scaled - lse + H)
        grad = (scaled - lse.unsqueeze(-1)).exp_()                            # p, [chunk, vocab]
        if grad_entropy is None:
            grad.mul_(-g_lp)
        else:
            grad.mul_((scaled - (lse - ent).unsqueeze(-1)).mul_(grad_entropy.unsqueeze(-1)).add_(g_lp)).neg_()
        grad.scatter_add_(-1, targets.unsqueeze(-1), g_lp)
        return grad.div_(ctx.temperature).to(ctx.dtype), None, None, None, None

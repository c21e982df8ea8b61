"""Runs the model: prefill of newcomers, batched decode over the KV cache, logits of the last token.

Two runners behind one interface (`Runner`). `DecoderRunner` is the fast path for the Llama-style
decoder family (Llama, Mistral, Qwen2, Qwen3): it calls the transformers model's own submodules (so
its parameters, names and weight updates are the checkpoint's) but owns the attention and the KV
cache. `GenericRunner` serves any other causal LM through its own forward, one sequence at a time.
On a CPU with one thread a step, `cpu_split.SplitStepRunner` wraps a DecoderRunner.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from inference_server.blocks import BlockAllocator
from inference_server.kv_cache import PagedKVCache, SlotKVCache
from inference_server.paged_kernel import (cpu_gemm, decode_kernel, fused_ops, kv_writer, pack_panels, paged_decode,
                                          prefill_attention, prefill_kernel, sgemm, write_kv)
from inference_server.sequence import Sequence
from weight_sync import merge_lora

_FAST_FAMILIES = {"llama", "mistral", "qwen2", "qwen3"}

# What one attention call costs beyond its data, in key positions of one row (measured on CPU: a
# decode-attention call has ~20-40 us of fixed cost, a key position ~0.13 us).
CALL_COST = 256


def plan_chunks(lengths: list[int], call_cost: int = CALL_COST) -> list[tuple[int, int, int]]:
    """Split decode rows (in slot order) into contiguous chunks `(start, end, longest)`, each run as
    one attention call padded to its longest row, minimising padded key positions plus call
    overheads (exact, by dynamic programming over the cut points: O(rows^2), rows <= a few hundred).
    On length-sorted slots that gives a few chunks with little padding, where one padded call would
    read every row to the longest and per-row calls would pay the fixed cost once per row and layer."""
    n = len(lengths)
    best, cut = [0] + [0] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        longest, best_j, cut_j = 0, None, 0
        for i in range(j - 1, -1, -1):
            longest = max(longest, lengths[i])
            if best_j is not None and (j - i) * longest >= best_j:
                break                                   # longer chunks only cost more from here
            c = best[i] + (j - i) * longest + call_cost
            if best_j is None or c < best_j:
                best_j, cut_j = c, i
        best[j], cut[j] = best_j, cut_j
    chunks, j = [], n
    while j > 0:
        i = cut[j]
        chunks.append((i, j, max(lengths[i:j])))
        j = i
    return chunks[::-1]


def chunk_cost(lengths: list[int], call_cost: int = CALL_COST) -> int:
    """Key positions read (padding included) plus call overheads of `plan_chunks(lengths)`."""
    if not lengths:
        return 0
    return sum((end - start) * longest + call_cost for start, end, longest in plan_chunks(lengths, call_cost))


class Runner(Protocol):
    """What the engine calls. `decode[b]` owns KV slot b; a newcomer's slot is set by the scheduler."""

    def step(self, decode: list[Sequence], prefill: list[Sequence], sampler) -> tuple[list[int], list[float]]:
        """The next token and its logprob for each of decode + prefill."""

    def forward(self, decode: list[Sequence], prefill: list[Sequence]) -> torch.Tensor:
        """Next-token logits, [len(decode) + len(prefill), vocab]."""

    def move(self, src: int, dst: int, length: int) -> None:
        """The sequence in slot `src` now lives in slot `dst` (its first `length` positions)."""

    def release(self, seq: Sequence) -> None: ...

    def better_order(self, lengths: list[int]) -> list[int] | None:
        """A permutation of the slots (by `lengths`, per slot) worth a `reorder`, or None."""

    def reorder(self, order: list[int], lengths: list[int]) -> None:
        """New slot i takes old slot order[i]."""


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def supports_fast_path(model) -> bool:
    cfg = model.config
    layer_types = getattr(cfg, "layer_types", None) or []
    return (cfg.model_type in _FAST_FAMILIES
            and not getattr(cfg, "use_sliding_window", False)
            and "sliding_attention" not in layer_types
            and (cfg.model_type != "mistral" or cfg.sliding_window is None))


class _Linear:
    """One or more of the model's linear layers as one matmul (their weights stacked by output):
    q, k and v together, gate and up together. In bf16 the weight is packed once for oneDNN's AMX
    matmul (on SmolLM2's shapes at 64 rows: 0.64 ms against 0.94 for F.linear on the gate-and-up
    weights, the 49k-row head 9.7 ms against 19.3). In fp32 on a CPU with gemm.c's kernel, outputs a
    multiple of 64, it is packed in 64-column panels for that kernel (SmolLM2's 120 projections on
    two cores: 53 ms at 64 rows against oneDNN's 69, 26 at 16 rows against 34)."""

    def __init__(self, linears: list[torch.nn.Linear], pack: bool, weight: torch.Tensor | None = None):
        """`weight`: the stacked weight to use instead of the linears' own (an adapter merged in)."""
        w = weight if weight is not None else \
            torch.cat([m.weight for m in linears]) if len(linears) > 1 else linears[0].weight
        biases = [m.bias for m in linears]
        b = None if all(x is None for x in biases) else torch.cat(
            [x if x is not None else m.weight.new_zeros(m.out_features) for x, m in zip(biases, linears)])
        self.packed, self.panels = False, None
        if pack and w.dtype == torch.float32 and w.device.type == "cpu" and w.shape[0] % 64 == 0:
            self.gemm = cpu_gemm()
            if self.gemm is not None:
                self.panels = pack_panels(w.detach())
                self.weight, self.bias = None, None if b is None else b.detach().float().contiguous()
                return
        if pack:
            try:
                w, self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 64), True
            except (RuntimeError, AttributeError):      # a torch without oneDNN: F.linear
                pass
        self.weight, self.bias = w, b

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            return sgemm(self.gemm, x, self.panels, self.bias)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter served in the forward (weight_sync's adapter-only pushes, on the fused path): for
    each adapted module m, `tensors[m + ".lora_A"]` [r, in], `tensors[m + ".lora_B"]` [out, r] and
    `scales[m]`; the module computes base(x) + (x @ A^T) @ B^T * scale, as peft's unmerged forward."""
    tensors: dict
    scales: dict


class _Lora:
    """One stacked projection's adapters as two matmuls: x @ A^T with the members' A stacked by rank,
    then @ B^T with each member's B * scale in its block (its output rows, its ranks)."""

    def __init__(self, parts: list, rows: list[int], dtype: torch.dtype):
        ranks = sum(a.shape[0] for a, _, _ in parts if a is not None)
        self.a = torch.cat([a for a, _, _ in parts if a is not None]).to(dtype)
        self.b = torch.zeros(sum(rows), ranks, dtype=dtype, device=self.a.device)
        r = o = 0
        for (a, b, scale), out in zip(parts, rows):
            if a is not None:
                self.b[o:o + out, r:r + a.shape[0]] = (b.float() * scale).to(dtype)
                r += a.shape[0]
            o += out
        self.b = self.b.t().contiguous()        # [ranks, out]: y += (x @ A^T) @ this


class _Adapted:
    """A stacked projection (`_Linear`) with an adapter beside it."""

    def __init__(self, base: "_Linear", lora: _Lora):
        self.base, self.lora = base, lora

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        return y.addmm_(x @ self.lora.a.t(), self.lora.b)


class FusedWeights:
    """The CPU fast path's view of the model's weights (`_Linear` per projection, norms' weights),
    rebuilt whenever the model's parameters are swapped for a new version (a pointer check a step),
    with the adapter that serves beside them where one does (`adapter`, set between steps by the
    engine). A new adapter serves at once in the forward (`_Adapted`: a few small tensors, the stacked
    base weights stay), while a thread merges it into stacked weights of its own (each adapted
    module's base + B @ A * scale in fp32, as the receiver's merge and peft's merge_and_unload: the same
    bits); from the step after that is done, the adapter serves merged (an adapter in the forward cost
    13-21% of the generation speed on SmolLM2-135M)."""

    def __init__(self, model, layers, pack: bool):
        self.model, self.layers, self.pack = model, layers, pack
        self.params = [p for p in model.parameters()]
        self._key: tuple = ()
        self._lock = threading.Lock()
        self.built: list = []
        self.adapter: Adapter | None = None
        self._served: tuple = (None, [])        # (adapter, the view with it)
        self._names = {id(m): n for n, m in model.named_modules()}
        # the module names an adapter may target to be served in the forward: the stacked projections'
        self.adaptable = {self._names[id(m)] for layer in layers for group in self._groups(layer) for m in group}

    def current(self) -> list:
        key = tuple(p.data_ptr() for p in self.params)
        if key != self._key:
            with self._lock:
                if key != self._key:
                    self.built = self._build()
                    self._key = key
                    self._served = (None, [])
        adapter = self.adapter
        if adapter is None:
            return self.built
        if self._served[0] is not adapter:
            self._served = (adapter, self._with(adapter))
            threading.Thread(target=self._merge, args=(adapter, self._key), name="lora-merge", daemon=True).start()
        return self._served[1]

    @torch.no_grad()
    def _merge(self, adapter: Adapter, key: tuple) -> None:
        """The adapter merged into stacked weights of its own, then served instead of the forward's
        (unless another adapter or other weights serve by then)."""
        torch.set_num_threads(1)                 # beside the steps, not in their way
        t = adapter.tensors

        def merged(group, names, linear):
            rows = [merge_lora(m.weight, t[f"{n}.lora_A"], t[f"{n}.lora_B"], adapter.scales[n])
                    if n in adapter.scales else m.weight for n, m in zip(names, group)]
            return _Linear(group, self.pack, weight=torch.cat(rows) if len(rows) > 1 else rows[0])
        out = self._view(adapter, merged)
        with self._lock:
            if self.adapter is adapter and self._key == key and self._served[0] is adapter:
                self._served = (adapter, out)

    def _groups(self, layer) -> list:
        a, m = layer.self_attn, layer.mlp
        return [[a.q_proj, a.k_proj, a.v_proj], [a.o_proj], [m.gate_proj, m.up_proj], [m.down_proj]]

    def _build(self) -> list:
        out = []
        for layer in self.layers:
            out.append((*(_Linear(g, self.pack) for g in self._groups(layer)),
                        layer.input_layernorm.weight, layer.post_attention_layernorm.weight))
        out.append(_Linear([self.model.lm_head], self.pack))
        return out

    def _with(self, adapter: Adapter) -> list:
        t = adapter.tensors

        def beside(group, names, linear):
            parts = [(t.get(f"{n}.lora_A"), t.get(f"{n}.lora_B"), adapter.scales.get(n)) for n in names]
            return _Adapted(linear, _Lora(parts, [m.weight.shape[0] for m in group], self.params[0].dtype))
        return self._view(adapter, beside)

    def _view(self, adapter: Adapter, project) -> list:
        """`built` with each stacked projection that the adapter targets replaced by `project(its
        modules, their names, the base _Linear)`."""
        out = []
        for layer, built in zip(self.layers, self.built):
            projections = []
            for group, linear in zip(self._groups(layer), built[:4]):
                names = [self._names[id(m)] for m in group]
                projections.append(project(group, names, linear) if any(n in adapter.scales for n in names)
                                   else linear)
            out.append((*projections, *built[4:]))
        out.append(self.built[-1])
        return out


def fused_path_fits(model) -> bool:
    """A decoder the fused CPU path computes exactly as transformers: RMSNorm with a weight, SiLU
    MLP of gate, up and down projections, q/k/v/o projections, no q/k norms (Qwen3)."""
    cfg, layer = model.config, model.model.layers[0]
    a, m = layer.self_attn, getattr(layer, "mlp", None)
    return (getattr(cfg, "hidden_act", None) == "silu" and not hasattr(a, "q_norm")
            and all(isinstance(getattr(a, n, None), torch.nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
            and all(isinstance(getattr(m, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))
            and all(hasattr(n, "variance_epsilon") and hasattr(n, "weight")
                    for n in (layer.input_layernorm, layer.post_attention_layernorm, model.model.norm))
            and isinstance(getattr(model, "lm_head", None), torch.nn.Linear))


class DecoderRunner:
    def __init__(self, model, num_slots: int, context_length: int):
        self._init_common(model)
        self.kv = SlotKVCache(len(self.layers), num_slots, self.num_kv_heads, context_length,
                              self.head_dim, self.dtype, self.device)

    def _init_common(self, model) -> None:
        self.model = model
        cfg = model.config
        self.decoder = model.model
        self.layers = list(self.decoder.layers)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.kv_group = self.num_heads // self.num_kv_heads  # query heads per KV head
        self.scaling = attn.scaling
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._plan_key: tuple = ()
        self._cuts: list[tuple[int, int]] = []
        self.share_prompts = True        # newcomers of one step with the same tokens are computed once
        # on a CPU: the elementwise steps in one pass each (fused_ops.c), the projections stacked
        self.ops = fused_ops(self.device, self.dtype) if fused_path_fits(model) else None
        self.fused = FusedWeights(model, self.layers, pack=True) if self.ops else None
        self.prefill_kernel = prefill_kernel(self.dtype) if self.device.type == "cpu" else None
        self.eps = self.layers[0].input_layernorm.variance_epsilon if self.ops else 0.0

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.decoder.rotary_emb(x, positions[None])
        return cos[0, :, None, :], sin[0, :, None, :]   # [tokens, 1, head_dim]

    def _qkv(self, attn, h: torch.Tensor, cos, sin):
        t = h.shape[0]
        q = attn.q_proj(h).view(t, self.num_heads, self.head_dim)
        k = attn.k_proj(h).view(t, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(h).view(t, self.num_kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):    # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v                 # [tokens, heads, head_dim]

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        if self.ops is not None:
            return self._layers_fused(x, positions, attend)
        cos, sin = self._rope(x, positions)
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            q, k, v = self._qkv(layer.self_attn, h, cos, sin)
            x = x + layer.self_attn.o_proj(attend(i, q, k, v))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    def _layers_fused(self, x: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """`_layers` on a CPU: each layer's residual add and the next norm in one pass, q, k and v
        from one matmul and rotated in place, gate and up from one, SiLU-and-multiply in one pass.
        Leaves x ([tokens, hidden]) as the last layer's output, as `_layers` does."""
        ops, weights = self.ops, self.fused.current()
        t, hd = x.shape[0], self.head_dim
        qn, kn = self.num_heads * hd, self.num_kv_heads * hd
        cos, sin = self.decoder.rotary_emb(x, positions[None])
        cos, sin = cos[0].to(x.dtype).contiguous(), sin[0].to(x.dtype).contiguous()
        x = x.contiguous()
        h = ops.rms_norm(x, weights[0][4], self.eps)
        for i in range(len(self.layers)):
            qkv_proj, o_proj, gate_up, down, _, post_norm = weights[i]
            qkv = qkv_proj(h)
            ops.rope(qkv, cos, sin, self.num_heads + self.num_kv_heads, hd)
            q = qkv[:, :qn].view(t, self.num_heads, hd)
            k = qkv[:, qn:qn + kn].view(t, self.num_kv_heads, hd)
            v = qkv[:, qn + kn:].view(t, self.num_kv_heads, hd)
            h = ops.rms_norm(x, post_norm, self.eps, residual=o_proj(attend(i, q, k, v)))
            d = down(ops.silu_mul(gate_up(h)))
            if i + 1 < len(self.layers):
                h = ops.rms_norm(x, weights[i + 1][4], self.eps, residual=d)
            else:
                x += d
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            weights = self.fused.current()
            return weights[-1](self.ops.rms_norm(x.contiguous(), self.decoder.norm.weight, self.decoder.norm.variance_epsilon)).float()
        return self.model.lm_head(self.decoder.norm(x)).float()

    def forward(self, decode: list[Sequence], prefill: list[Sequence]) -> torch.Tensor:
        """One step: a token for each decoding sequence (`decode[b]` owns slot b) and the whole
        prompt (prompt + any output so far) of each newcomer, in one pass through the layers.
        Returns the next-token logits, [len(decode) + len(prefill), vocab], in that order."""
        pos = [s.num_tokens - 1 for s in decode]
        return self.part(decode, pos, 0, self.plan(decode, pos), prefill)

    def step(self, decode: list[Sequence], prefill: list[Sequence], sampler) -> tuple[list[int], list[float]]:
        """`forward`, then `sampler`: the next token and its logprob for each of decode + prefill."""
        return sampler(self.forward(decode, prefill), decode + prefill)

    def part(self, decode: list[Sequence], pos: list[int], slot0: int, chunks,
             prefill: list[Sequence], verify: list[tuple[Sequence, list[int]]] = ()) -> torch.Tensor:
        """Decode rows `decode` at positions `pos` (slots slot0 ...; `chunks` in absolute slots)
        plus the newcomers. `verify` (paged runners; speculative decoding): running sequences, each
        with drafted tokens: its last token and the drafts are computed as one span over its cached
        keys and values, and every one of their rows comes back. Returns the logits of the decode
        rows, then of each verify span's rows, then of each newcomer's last token."""
        b = len(decode)
        ids = [s.output_ids[-1] if s.output_ids else s.prompt_ids[-1] for s in decode]
        pos = list(pos)                              # extended below by the spans' positions
        spans = []                                   # (seq, first row, rows, first position) of each span
        copies = []                                  # (seq, span index): the same tokens as that newcomer
        for s, drafts in verify:
            p0 = s.num_tokens - 1
            spans.append((s, len(ids), 1 + len(drafts), p0))
            ids += [s.output_ids[-1] if s.output_ids else s.prompt_ids[-1], *drafts]
            pos += range(p0, p0 + 1 + len(drafts))
        checked = len(ids)
        first: dict[tuple, int] = {}
        for s in prefill:
            key = (s.cached, *s.all_ids)
            if self.share_prompts and key in first:  # a GRPO group's samples: compute the prompt once
                copies.append((s, first[key]))
                continue
            first[key] = len(spans)
            spans.append((s, len(ids), s.num_tokens - s.cached, s.cached))
            ids += s.all_ids[s.cached:]
            pos += range(s.cached, s.num_tokens)
        tokens = torch.tensor(ids, device=self.device)
        positions = torch.tensor(pos, device=self.device)
        attend = self._attention(decode, pos, slot0, chunks, positions, spans, copies, len(verify))
        x = self._layers(self.decoder.embed_tokens(tokens), positions, attend)
        if not prefill:
            return self._logits(x)
        last = {id(s): start + n - 1 for s, start, n, _ in spans}
        for s, i in copies:
            last[id(s)] = spans[i][1] + spans[i][2] - 1
        rows = list(range(checked)) + [last[id(s)] for s in prefill]
        return self._logits(x[torch.tensor(rows, device=self.device)])

    def _prefill_attention(self, out, q, k, v, spans) -> None:
        """Each newcomer attends over its own tokens, computed this step (causal): prefill_attention.c
        in fp32 on a CPU where it was built for the sizes (SmolLM2-135M: 1.4-1.7x torch's SDPA at
        100-500 tokens), else SDPA."""
        for s, start, n, _ in spans:
            if self.prefill_kernel is not None and prefill_attention(
                    self.prefill_kernel, q[start:start + n], k[start:start + n], v[start:start + n],
                    out[start:start + n], self.scaling):
                continue
            qs, ks, vs = (t[start:start + n].transpose(0, 1) for t in (q, k, v))  # [heads, n, d]
            o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], is_causal=True,
                                               scale=self.scaling, enable_gqa=True)
            out[start:start + n] = o[0].transpose(0, 1)

    def _decode_attention(self, out, q, start: int, end: int, ks, vs, mask) -> None:
        # one query a row: the query heads that share a KV head go in as that head's query
        # positions, so the keys are read once per KV head, not expanded per head (10% faster a
        # call than enable_gqa on CPU). ks, vs: [rows, kv_heads, length, head_dim]
        qs = q[start:end].view(end - start, self.num_kv_heads, self.kv_group, self.head_dim)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.scaling)
        out[start:end] = o.view(end - start, self.num_heads, self.head_dim)

    def _attention(self, decode, pos, slot0, chunks, positions, spans, copies, nverify: int = 0):
        """attend(layer, q, k, v) for `_layers`: writes this step's keys and values into the slots
        and returns the attention output of every token (the first `nverify` spans verify drafts:
        paged runners only)."""
        b = len(decode)
        planned = self._decode_chunks(chunks, slot0, pos, positions[:b]) if b else []

        def attend(layer, q, k, v):
            out = torch.empty_like(q)
            if b:
                self.kv.write_decode(layer, positions[:b], k[:b], v[:b], first_slot=slot0)
                for start, end, longest, mask in planned:
                    ks, vs = self.kv.rows(layer, slot0 + start, slot0 + end, longest)
                    self._decode_attention(out, q, start, end, ks, vs, mask)
            self._prefill_attention(out, q, k, v, spans)
            for s, start, n, _ in spans:
                self.kv.write_prefill(layer, s.slot, k[start:start + n].transpose(0, 1), v[start:start + n].transpose(0, 1))
            for s, i in copies:
                _, start, n, _ = spans[i]
                self.kv.write_prefill(layer, s.slot, k[start:start + n].transpose(0, 1), v[start:start + n].transpose(0, 1))
            return out.flatten(1)
        return attend

    def _decode_chunks(self, chunks, slot0: int, pos: list[int], dec_pos: torch.Tensor) -> list[tuple]:
        """(start, end, longest, additive mask or None) of each chunk of decode rows, in part rows:
        a mask only where a row's position is short of the chunk's longest."""
        planned = []
        for start, end, longest in chunks:
            start, end = start - slot0, end - slot0
            mask = None
            if any(p + 1 != longest for p in pos[start:end]):
                valid = torch.arange(longest, device=self.device)[None, :] <= dec_pos[start:end, None]
                mask = torch.zeros(valid.shape, dtype=self.dtype, device=self.device)
                mask.masked_fill_(~valid, float("-inf"))
                mask = mask[:, None, None, :]
            planned.append((start, end, longest, mask))
        return planned

    def plan(self, decode: list[Sequence], pos: list[int]) -> list[tuple[int, int, int]]:
        """plan_chunks for this step. Every running row grows by one token a step, so the cut points
        stay right until the batch changes: they are recomputed only then."""
        key = tuple(id(s) for s in decode)
        if key != self._plan_key:
            self._plan_key = key
            self._cuts = [(start, end) for start, end, _ in plan_chunks([p + 1 for p in pos])]
        return [(start, end, max(pos[start:end]) + 1) for start, end in self._cuts]

    def move(self, src: int, dst: int, length: int) -> None:
        self.kv.move(src, dst, length)

    def share(self, donor: Sequence, seq: Sequence, n: int) -> None:
        """`seq` takes `donor`'s first `n` positions (the same tokens): copied into its slot."""
        self.kv.move(donor.slot, seq.slot, n)

    def release(self, seq: Sequence) -> None:
        pass

    def better_order(self, lengths: list[int]) -> list[int] | None:
        """Longest first, when that makes decode attention (plan_chunks) cheaper by more than the
        copy costs: a reorder copies the moved slots once and pays off within a few steps when the
        gain is real. Every running row grows by one token a step, so an order holds until a
        sequence joins or leaves."""
        if len(lengths) < 3 or all(a >= b for a, b in zip(lengths, lengths[1:])):
            return None
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        now, best = chunk_cost(lengths), chunk_cost([lengths[i] for i in order])
        return order if now - best > max(0.1 * best, 4 * CALL_COST) else None

    def reorder(self, order: list[int], lengths: list[int]) -> None:
        """Permute KV slots: new slot i takes old slot order[i] (`lengths` by old slot)."""
        self.kv.permute(order, lengths)


# Positions a decode-attention call gathers at most (a chunk with more rows runs as several calls):
# bounds the gather workspace, two per thread, at 64k positions' keys or values of one layer.
WORKSPACE_POSITIONS = 65536


class PagedDecoderRunner(DecoderRunner):
    """A DecoderRunner over a paged KV cache: each sequence holds the blocks its tokens fill
    (`seq.blocks`, allocated by the scheduler as it grows, freed by `release`), so a sequence costs
    memory by the tokens it holds, not by the context length. Decode attention gathers each chunk's
    blocks into a workspace (one copy a layer, reused across steps, no page faults) and attends
    there; a slot is only a row number, so moving or reordering sequences copies nothing. A prompt
    shared by the samples of a group is held once: its full blocks by reference."""

    def __init__(self, model, num_blocks: int, block_size: int):
        self._init_common(model)
        self.blocks = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size
        self.kv = PagedKVCache(len(self.layers), num_blocks, block_size, self.num_kv_heads, self.head_dim,
                               self.dtype, self.device)
        self._workspace = threading.local()        # cpu_split runs two parts at once: one each
        self.workspace_positions = WORKSPACE_POSITIONS
        # decode attention read in place from the blocks (paged_attention.c) where it can be built
        self.kernel = decode_kernel(self.device, self.dtype) if self.kv_group <= 64 and self.head_dim <= 512 else None
        self.kv_writer = kv_writer() if self.device.type == "cpu" else None

    def _gather(self, pages: torch.Tensor, idx: torch.Tensor, which: int) -> torch.Tensor:
        """Pages `idx` of a layer's keys (which=0) or values (1), in order, into this thread's
        workspace: [len(idx), block_size, head_dim]."""
        buffers = self._workspace.__dict__.setdefault("buffers", {})
        ws = buffers.get(which)
        if ws is None or ws.shape[0] < idx.numel():
            ws = buffers[which] = pages.new_empty((max(idx.numel(), 2 * (0 if ws is None else ws.shape[0])),
                                                   *pages.shape[1:]))
        return torch.index_select(pages, 0, idx, out=ws[:idx.numel()])

    def _table(self, seqs: list[Sequence], nb: int) -> torch.Tensor:
        """The pages to gather for rows `seqs`, row by row, KV head by head, block by block: each
        row's first nb blocks, padded with block 0 (masked)."""
        rows = torch.tensor([s.blocks[:nb] + [0] * (nb - len(s.blocks[:nb])) for s in seqs], device=self.device)
        heads = torch.arange(self.num_kv_heads, device=self.device)
        return (rows[:, None, :] * self.num_kv_heads + heads[None, :, None]).flatten()

    def _writes(self, decode, pos, spans, copies) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens of this step, the flat pool's row of each one's KV head 0): where this step's keys
        and values go (KV head h block_size rows after head 0). A copy (a newcomer with the same tokens as an earlier one this
        step) takes that one's full blocks by reference and writes only its last, partial block."""
        bs, kvh, src, base = self.block_size, self.num_kv_heads, [], []

        def at(s: Sequence, p: int) -> int:           # head 0's row of position p
            return s.blocks[p // bs] * kvh * bs + p % bs
        for i, s in enumerate(decode):
            src.append(i)
            base.append(at(s, pos[i]))
        for s, start, n, p0 in spans:
            src += range(start, start + n)
            base += [at(s, p) for p in range(p0, p0 + n)]
        for s, i in copies:                           # s.cached == first.cached: a multiple of bs
            first, start, n, _ = spans[i]
            lo, full = s.cached // bs, (s.cached + n) // bs
            self.blocks.free(s.blocks[lo:full])
            s.blocks[lo:full] = self.blocks.ref(first.blocks[lo:full])
            src += range(start + full * bs - s.cached, start + n)
            base += [at(s, p) for p in range(full * bs, s.cached + n)]
        return (torch.tensor(src, dtype=torch.long, device=self.device),
                torch.tensor(base, dtype=torch.long, device=self.device))

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, base: torch.Tensor) -> None:
        """This step's keys and values (`_writes`' places) into the layer's blocks: on a CPU one C call
        (a decode step of 64 rows spent ~8 ms in two index_select and two index_copy_ a layer)."""
        if self.kv_writer is not None and write_kv(self.kv_writer, k, v, src, base, self.kv.k[layer], self.kv.v[layer]):
            return
        kvh = self.num_kv_heads
        heads = torch.arange(kvh, dtype=torch.long, device=self.device)
        rows, dst = (src[:, None] * kvh + heads).flatten(), (base[:, None] + heads * self.block_size).flatten()
        kf, vf = self.kv.flat(layer)
        kf.index_copy_(0, dst, k.flatten(0, 1).index_select(0, rows))
        vf.index_copy_(0, dst, v.flatten(0, 1).index_select(0, rows))

    def _attention(self, decode, pos, slot0, chunks, positions, spans, copies, nverify: int = 0):
        if self.kernel is not None:
            return self._attention_in_place(decode, pos, spans, copies, nverify)
        b, bs = len(decode), self.block_size
        planned = []
        for start, end, longest, mask in (self._decode_chunks(chunks, slot0, pos, positions[:b]) if b else []):
            rows = max(1, self.workspace_positions // longest)     # the workspace stays bounded
            planned += [(a, min(end, a + rows), longest, None if mask is None else mask[a - start:min(end, a + rows) - start])
                        for a in range(start, end, rows)]
        tables = [self._table(decode[start:end], -(-longest // bs)) for start, end, longest, _ in planned]
        src, dst = self._writes(decode, pos, spans, copies)

        def attend(layer, q, k, v):
            out = torch.empty_like(q)
            self._write(layer, k, v, src, dst)
            kp, vp = self.kv.pages(layer)
            for (start, end, longest, mask), idx in zip(planned, tables):
                ks, vs = (self._gather(pages, idx, w).view(end - start, self.num_kv_heads, -1, self.head_dim)[:, :, :longest]
                          for w, pages in ((0, kp), (1, vp)))
                self._decode_attention(out, q, start, end, ks, vs, mask)
            self._prefill_attention(out, q, k, v, spans, layer)
            return out.flatten(1)
        return attend

    def _prefill_attention(self, out, q, k, v, spans, layer: int = 0) -> None:
        """Newcomers with a cached prefix, and sequences verifying drafts, attend over their earlier
        positions (read from their blocks, this step's keys and values already written there) and
        over their own tokens, causally; the rest as usual."""
        fresh = [span for span in spans if not span[3]]
        super()._prefill_attention(out, q, k, v, fresh)
        for s, start, n, p0 in spans:
            if not p0:
                continue
            total = p0 + n
            idx = self._table([s], -(-total // self.block_size))
            ks, vs = (pages.index_select(0, idx).view(self.num_kv_heads, -1, self.head_dim)[:, :total]
                      for pages in self.kv.pages(layer))
            seen = torch.arange(total, device=self.device)[None, :] <= torch.arange(p0, total, device=self.device)[:, None]
            o = F.scaled_dot_product_attention(q[start:start + n].transpose(0, 1)[None], ks[None], vs[None],
                                               attn_mask=seen, scale=self.scaling, enable_gqa=True)
            out[start:start + n] = o[0].transpose(0, 1)

    def verify_step(self, decode: list[Sequence], verify: list[tuple[Sequence, list[int]]],
                    prefill: list[Sequence], sampler) -> tuple[list[int], list[float]]:
        """A step whose `verify` rows check drafted tokens (speculative.py): a token and logprob
        sampled at every row, in the order decode, each verify span's rows, prefill."""
        pos = [s.num_tokens - 1 for s in decode]
        logits = self.part(decode, pos, 0, self.plan(decode, pos), prefill, verify)
        return sampler(logits, decode + [s for s, d in verify for _ in range(1 + len(d))] + prefill)

    def _attention_in_place(self, decode, pos, spans, copies, nverify: int = 0):
        """attend() whose decode rows read their keys and values from the blocks (the kernel), with
        no gather and no padding: one call a layer for every decode row. A span verifying drafts
        goes in as rows of its own, one a position, each over its sequence's blocks up to and
        including its position (this step's keys and values are written before the kernel reads)."""
        bs = self.block_size
        rows = list(decode) + [s for s, _, n, _ in spans[:nverify] for _ in range(n)]
        b = len(rows)
        nb = -(-(max(pos[:b], default=0) + 1) // bs)
        table = torch.tensor([s.blocks[:nb] + [0] * (nb - len(s.blocks[:nb])) for s in rows], dtype=torch.long)
        lens = torch.tensor([p + 1 for p in pos[:b]], dtype=torch.long)
        src, dst = self._writes(decode, pos, spans, copies)
        threads = torch.get_num_threads()
        rest = spans[nverify:]

        def attend(layer, q, k, v):
            out = torch.empty_like(q)
            self._write(layer, k, v, src, dst)
            if b:
                paged_decode(self.kernel, q[:b], self.kv.k[layer], self.kv.v[layer], table, lens, out[:b],
                             self.scaling, threads)
            self._prefill_attention(out, q, k, v, rest, layer)
            return out.flatten(1)
        return attend

    def move(self, src: int, dst: int, length: int) -> None:
        pass                                        # blocks follow the sequence, not its slot

    def share(self, donor: Sequence, seq: Sequence, n: int) -> None:
        """`seq` takes `donor`'s first `n` positions: the full blocks by reference, the partial
        last one copied (its next positions are seq's own)."""
        full = n // self.block_size
        self.blocks.free(seq.blocks[:full])
        seq.blocks[:full] = self.blocks.ref(donor.blocks[:full])
        if n % self.block_size:
            self.kv.copy_block(donor.blocks[full], seq.blocks[full])

    def release(self, seq: Sequence) -> None:
        self.blocks.release(seq)

    def better_order(self, lengths: list[int]) -> list[int] | None:
        """Longest first whenever that makes decode attention cheaper: reordering copies nothing."""
        if len(lengths) < 3 or all(a >= b for a, b in zip(lengths, lengths[1:])):
            return None
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        return order if chunk_cost([lengths[i] for i in order]) < chunk_cost(lengths) else None

    def reorder(self, order: list[int], lengths: list[int]) -> None:
        pass


class GenericRunner:
    """Any causal LM: its own forward and cache, one sequence at a time. Correct, not fast."""

    def __init__(self, model, num_slots: int, context_length: int):
        self.model = model
        self.device = next(model.parameters()).device
        self.caches: list = [None] * num_slots

    def step(self, decode: list[Sequence], prefill: list[Sequence], sampler) -> tuple[list[int], list[float]]:
        return sampler(self.forward(decode, prefill), decode + prefill)

    def forward(self, decode: list[Sequence], prefill: list[Sequence]) -> torch.Tensor:
        rows = []
        for s in decode:
            ids = torch.tensor([[s.output_ids[-1] if s.output_ids else s.prompt_ids[-1]]], device=self.device)
            out = self.model(ids, past_key_values=self.caches[s.slot], use_cache=True)
            self.caches[s.slot] = out.past_key_values
            rows.append(out.logits[0, -1])
        for s in prefill:
            out = self.model(torch.tensor([s.all_ids], device=self.device), use_cache=True)
            self.caches[s.slot] = out.past_key_values
            rows.append(out.logits[0, -1])
        return torch.stack(rows).float()

    def move(self, src: int, dst: int, length: int) -> None:
        self.caches[dst], self.caches[src] = self.caches[src], None

    def release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self.caches[seq.slot] = None

    def better_order(self, lengths: list[int]) -> None:
        return None                  # its caches do not care where a sequence's slot is

    def reorder(self, order: list[int], lengths: list[int]) -> None:
        raise NotImplementedError

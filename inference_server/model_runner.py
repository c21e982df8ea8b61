"""Runs the model: prefill of newcomers, batched decode over the KV cache, logits of the last token.

Two runners behind one interface. `DecoderRunner` is the fast path for the Llama-style decoder
family (Llama, Mistral, Qwen2, Qwen3): it calls the transformers model's own submodules (so its
parameters, names and weight updates are the checkpoint's) but owns the attention and the KV
cache. `GenericRunner` serves any other causal LM through its own forward, one sequence at a time.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from inference_server.kv_cache import SlotKVCache
from inference_server.sequence import Sequence

_FAST_FAMILIES = {"llama", "mistral", "qwen2", "qwen3"}

# What one attention call costs beyond its data, in key positions of one row (measured on CPU: a
# decode-attention call has ~20-40 us of fixed cost, a key position ~0.13 us).
CALL_COST = 256
# Where a split step cuts its rows, in the same units: a decode row's work beyond its key positions,
# and a prefill token's (rough CPU figures for a tiny decoder: a prefill token costs about as much
# as 200 key positions of decode attention). The runner's learnt share corrects them step by step.
ROW_WORK, PREFILL_WORK = 64, 200


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


class DecoderRunner:
    def __init__(self, model, num_slots: int, context_length: int):
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
        self.device = param.device
        self.kv = SlotKVCache(len(self.layers), num_slots, self.num_kv_heads, context_length,
                              self.head_dim, param.dtype, param.device)
        self._plan_key: tuple = ()
        self._helper = None                          # enable_split()
        self.split_min_rows = 0
        self._share = 0.5                            # of a split step's work that the helper takes
        self._cuts: list[tuple[int, int]] = []

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
        cos, sin = self._rope(x, positions)
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            q, k, v = self._qkv(layer.self_attn, h, cos, sin)
            x = x + layer.self_attn.o_proj(attend(i, q, k, v))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.decoder.norm(x)).float()

    def forward(self, decode: list[Sequence], prefill: list[Sequence]) -> torch.Tensor:
        """One step: a token for each decoding sequence (`decode[b]` owns slot b) and the whole
        prompt (prompt + any output so far) of each newcomer, in one pass through the layers.
        Returns the next-token logits, [len(decode) + len(prefill), vocab], in that order."""
        pos = [s.num_tokens - 1 for s in decode]
        return self._part(decode, pos, 0, self._plan(decode, pos), prefill)

    def step(self, decode: list[Sequence], prefill: list[Sequence], sampler) -> tuple[list[int], list[float]]:
        """`forward`, then `sampler`: the next token and its logprob for each of decode + prefill.

        With a helper thread (`split`), a large step runs as two parts of the rows, one per thread,
        each an ordinary single-threaded pass that also samples its rows: on a CPU whose second core
        is shared with the HTTP thread and a rollout client, the helper's part picks up whatever that
        core has free, with none of an OpenMP team's barrier stalls when it has none."""
        b = len(decode)
        if self._helper is None or b < self.split_min_rows:
            return sampler(self.forward(decode, prefill), decode + prefill)
        pos = [s.num_tokens - 1 for s in decode]
        chunks = self._plan(decode, pos)
        # cut the rows where the work (padded key positions and a per-row share) splits evenly between
        # the two threads; the engine thread's side also takes the newcomers' prefill. A chunk that
        # spans the cut becomes two, each padded only to its own longest row.
        work = []
        for start, end, longest in chunks:
            work += [longest + ROW_WORK] * (end - start)
        total = sum(work)
        target = self._share * (total + PREFILL_WORK * sum(s.num_tokens for s in prefill))
        acc, mid = 0, 0
        for w in work[:-1] if not prefill else work:
            if acc + w / 2 > target:
                break
            acc += w
            mid += 1
        mid = max(mid, 1)

        def part(lo: int, hi: int) -> list[tuple[int, int, int]]:
            return [(max(a, lo), min(e, hi), max(pos[max(a, lo):min(e, hi)]) + 1)
                    for a, e, _ in chunks if a < hi and e > lo]
        u = sampler.draw(decode + prefill)
        u1, u2 = (None, None) if u is None else (u[:mid], u[mid:])
        first = self._helper.submit(self._sampled_part_in_helper, sampler, u1,
                                    decode[:mid], pos[:mid], 0, part(0, mid), [])
        t = time.perf_counter()
        logits = self._part(decode[mid:], pos[mid:], mid, part(mid, b), prefill)
        tokens, logprobs = sampler.sample(logits, decode[mid:] + prefill, u2)
        t_own = time.perf_counter() - t
        (tokens1, logprobs1), t_helper = first.result()
        # move the cut toward equal times: the thread that took longer gets less next step
        self._share = min(0.95, max(0.05, self._share + 0.02 * (t_own - t_helper) / (t_own + t_helper)))
        return tokens1 + tokens, logprobs1 + logprobs

    def _sampled_part_in_helper(self, sampler, u, decode, *args) -> tuple[tuple[list, list], float]:
        t = time.perf_counter()
        with torch.inference_mode():
            out = sampler.sample(self._part(decode, *args), decode, u)
        return out, time.perf_counter() - t

    def _part(self, decode: list[Sequence], pos: list[int], slot0: int, chunks,
              prefill: list[Sequence]) -> torch.Tensor:
        """Decode rows `decode` at positions `pos` (slots slot0 ...; `chunks` in absolute slots)
        plus the newcomers."""
        b = len(decode)
        ids = [s.output_ids[-1] if s.output_ids else s.prompt_ids[-1] for s in decode]
        pos = list(pos)                              # extended below by the newcomers' positions
        spans = []                                   # (seq, first row, length) of each newcomer
        for s in prefill:
            spans.append((s, len(ids), s.num_tokens))
            ids += s.all_ids
            pos += range(s.num_tokens)
        tokens = torch.tensor(ids, device=self.device)
        positions = torch.tensor(pos, device=self.device)
        if b:
            dec_pos = positions[:b]
            planned = []                             # (start, end, longest, additive mask or None), part rows
            for start, end, longest in chunks:
                start, end = start - slot0, end - slot0
                mask = None
                if any(p + 1 != longest for p in pos[start:end]):
                    valid = torch.arange(longest, device=self.device)[None, :] <= dec_pos[start:end, None]
                    mask = torch.zeros(valid.shape, dtype=self.kv.k.dtype, device=self.device)
                    mask.masked_fill_(~valid, float("-inf"))
                    mask = mask[:, None, None, :]
                planned.append((start, end, longest, mask))

        def attend(layer, q, k, v):
            out = torch.empty_like(q)
            if b:
                self.kv.write_decode(layer, dec_pos, k[:b], v[:b], first_slot=slot0)
                for start, end, longest, mask in planned:
                    ks, vs = self.kv.rows(layer, slot0 + start, slot0 + end, longest)
                    # one query a row: the query heads that share a KV head go in as that head's
                    # query positions, so the keys are read once per KV head, not expanded per head
                    # (10% faster a call than enable_gqa on CPU)
                    qs = q[start:end].view(end - start, self.num_kv_heads, self.kv_group, self.head_dim)
                    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.scaling)
                    out[start:end] = o.view(end - start, self.num_heads, self.head_dim)
            for s, start, n in spans:
                qs, ks, vs = (t[start:start + n].transpose(0, 1) for t in (q, k, v))  # [heads, n, d]
                self.kv.write_prefill(layer, s.slot, ks, vs)
                o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], is_causal=True,
                                                   scale=self.scaling, enable_gqa=True)
                out[start:start + n] = o[0].transpose(0, 1)
            return out.flatten(1)

        x = self._layers(self.decoder.embed_tokens(tokens), positions, attend)
        rows = list(range(b)) + [start + n - 1 for _, start, n in spans]
        return self._logits(x[torch.tensor(rows, device=self.device)] if spans else x)

    def enable_split(self, threads: int, min_rows: int = 16) -> None:
        """Run steps of at least `min_rows` decode rows as two halves, one on a helper thread."""
        import concurrent.futures
        self.split_min_rows = min_rows
        self._helper = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="riptide-step-half", initializer=torch.set_num_threads, initargs=(threads,))

    def _plan(self, decode: list[Sequence], pos: list[int]) -> list[tuple[int, int, int]]:
        """plan_chunks for this step. Every running row grows by one token a step, so the cut points
        stay right until the batch changes: they are recomputed only then."""
        key = tuple(id(s) for s in decode)
        if key != self._plan_key:
            self._plan_key = key
            self._cuts = [(start, end) for start, end, _ in plan_chunks([p + 1 for p in pos])]
        return [(start, end, max(pos[start:end]) + 1) for start, end in self._cuts]

    def move(self, src: int, dst: int, length: int) -> None:
        self.kv.move(src, dst, length)

    def release(self, seq: Sequence) -> None:
        pass

    sorts_slots = True      # decode attention is cheapest with slots in length order (plan_chunks)

    def reorder(self, order: list[int], lengths: list[int]) -> None:
        """Permute KV slots: new slot i takes old slot order[i] (`lengths` by old slot)."""
        self.kv.permute(order, lengths)


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


def make_runner(model, num_slots: int, context_length: int):
    cls = DecoderRunner if supports_fast_path(model) else GenericRunner
    return cls(model, num_slots, context_length)

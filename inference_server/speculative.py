"""Speculative decoding of the tail: drafts from a request's group siblings and its prompt's history,
verified by the policy itself. Imports no torch.

Drafts (`DraftIndex`): per prompt (its token ids), counts of the token that followed each n-gram
(n = min_ngram..max_ngram) in the prompt itself, in every sample of that prompt running on this server (the
siblings of a GRPO group, the sequence itself) and in the samples that ended under the last
`keep_versions` weight versions. A decode row's draft follows the longest n-gram its own last tokens
end with, the most frequent next token each time, for up to k tokens while the counts' product
stays above `min_score`.

Verification (the engine, with the runner's verify spans): the row's last token and its k drafts go
through one forward over the paged KV cache; each of the k + 1 positions is sampled from the policy
as it would be without drafts (its own uniform, the same temperature, top-p, top-k and min-p); the
row keeps the sampled tokens up to and including the first that differs from its draft, and all k + 1
when every draft matched. Accepting draft d with probability p(d), and otherwise taking a token drawn
from p given that it is not d, is the standard rule for a one-hot draft: every sequence is
distributed exactly as without drafts, and a greedy row's tokens are the same tokens. The logprobs
and the weight version are those of the verifying forward, which the weights serving now compute.

When it pays (`SpecPolicy`, `--speculative auto`): a decode step reads every weight once whatever
its rows, so on few rows k more positions cost little, while at 64 rows a CPU step is bound by
arithmetic and k more per row cost about k times as much. The engine keeps the measured seconds of
its decode steps by the rows they computed and drafts when the tokens it expects (the acceptance so
far) per second beat a step without drafts.
"""
from __future__ import annotations

import math
from collections import OrderedDict

MODES = ("off", "auto", "on")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"speculative={mode!r}: expected one of {', '.join(MODES)}")
    return mode


class _Prompt:
    """One prompt's n-gram tables (n-gram -> {next token: count}): one per weight version its samples
    were made under, and the positions they hold."""

    __slots__ = ("tables", "tokens")

    def __init__(self):
        self.tables: dict[int, dict[tuple, dict[int, int]]] = {}
        self.tokens: dict[int, int] = {}


class DraftIndex:
    """`max_tokens` bounds the positions indexed over every prompt (about a kilobyte each at most):
    the prompts used least recently go first."""

    def __init__(self, max_ngram: int = 4, keep_versions: int = 2, max_tokens: int = 200_000,
                 min_score: float = 0.3, min_ngram: int = 2):
        self.max_ngram, self.keep_versions, self.min_ngram = max_ngram, keep_versions, min_ngram
        self.max_tokens, self.min_score = max_tokens, min_score
        self._prompts: OrderedDict[tuple, _Prompt] = OrderedDict()
        self._indexed: dict[int, tuple[tuple, int]] = {}   # id(sequence) -> (its prompt, positions indexed so far)
        self.tokens = 0                             # positions indexed, every prompt's

    def _entry(self, prompt: tuple, version: int) -> _Prompt:
        entry = self._prompts.get(prompt)
        if entry is None:
            entry = self._prompts[prompt] = _Prompt()
        else:
            self._prompts.move_to_end(prompt)
        for v in [v for v in entry.tables if v < version - self.keep_versions]:
            del entry.tables[v]
            self.tokens -= entry.tokens.pop(v)
        return entry

    def _trim(self) -> None:
        while self.tokens > self.max_tokens and len(self._prompts) > 1:
            _, entry = self._prompts.popitem(last=False)
            self.tokens -= sum(entry.tokens.values())

    def _add(self, entry: _Prompt, version: int, ids: list[int], lo: int) -> None:
        """The n-grams of `ids` that end before position i, with ids[i] after them, for i >= lo."""
        table = entry.tables[version]
        lo = max(1, lo)
        for i in range(lo, len(ids)):
            nxt = ids[i]
            for n in range(self.min_ngram, min(self.max_ngram, i) + 1):     # the lengths `_next` looks up
                key = tuple(ids[i - n:i])
                c = table.get(key)
                if c is None:
                    table[key] = {nxt: 1}
                else:
                    c[nxt] = c.get(nxt, 0) + 1
        added = max(0, len(ids) - lo)
        entry.tokens[version] = entry.tokens.get(version, 0) + added
        self.tokens += added

    def update(self, seq, version: int) -> None:
        """Index what `seq` generated since the last call (its prompt, the first time this prompt is
        seen under `version`)."""
        prompt, done = self._indexed.get(id(seq)) or (tuple(seq.prompt_ids), None)
        entry = self._entry(prompt, version)
        ids = seq.all_ids
        if version not in entry.tables:
            entry.tables[version] = {}
            self._add(entry, version, ids, 1)            # the prompt (and what the sequence has so far)
        else:
            self._add(entry, version, ids, len(prompt) if done is None else done)   # new: a sibling, the prompt is in
        self._indexed[id(seq)] = (prompt, len(ids))
        self._trim()

    def forget(self, seq) -> None:
        self._indexed.pop(id(seq), None)

    def _next(self, entry: _Prompt, ctx: list[int]) -> tuple[int, float] | None:
        for n in range(min(self.max_ngram, len(ctx)), self.min_ngram - 1, -1):
            key = tuple(ctx[-n:])
            found = [c for table in entry.tables.values() if (c := table.get(key))]
            if not found:
                continue
            total = found[0]
            if len(found) > 1:
                total = dict(total)
                for c in found[1:]:
                    for t, n_ in c.items():
                        total[t] = total.get(t, 0) + n_
            token, count = max(total.items(), key=lambda kv: kv[1])
            return token, count / (sum(total.values()) + 1)     # one unseen continuation: a lone match is no certainty
        return None

    def propose(self, seq, k: int) -> list[int]:
        """Up to k drafted tokens to follow `seq`'s tokens (none when nothing matches)."""
        known = self._indexed.get(id(seq))
        entry = self._prompts.get(known[0] if known else tuple(seq.prompt_ids))
        if entry is None or k <= 0:
            return []
        ctx = seq.all_ids[-self.max_ngram:]
        out, score = [], 1.0
        while len(out) < k:
            nxt = self._next(entry, ctx)
            if nxt is None:
                break
            score *= nxt[1]
            if score < self.min_score:
                break
            out.append(nxt[0])
            ctx = (ctx + [nxt[0]])[-self.max_ngram:]
        return out


class SpecPolicy:
    """Whether a step drafts (`auto`): from the measured seconds of decode steps by the rows they
    computed (a point per power of two of rows: the running means of rows and seconds), the
    acceptance so far and the drafts a row gets, a step drafts when (rows + accepted tokens expected)
    per second of a step of rows + drafts beats rows per second of a step of rows. A step whose
    cost is not measured yet is tried now and then (`explore_every` steps), and so is drafting where
    it lost, since acceptance and load change."""

    def __init__(self, k: int, explore_every: int = 64, margin: float = 1.03):
        self.k, self.explore_every, self.margin = k, explore_every, margin
        self.points: dict[int, list[float]] = {}     # bucket -> [mean rows, mean seconds]
        self.acceptance = 0.5                        # accepted / drafted tokens (running)
        self.drafts_per_row = float(k)               # drafted tokens a row gets when it asks (running)
        self._since = 0

    def record(self, rows: int, seconds: float) -> None:
        """A step without newcomers computed `rows` query positions in `seconds`."""
        b = max(1, rows).bit_length()
        p = self.points.get(b)
        if p is None:
            self.points[b] = [float(rows), seconds]
        else:
            p[0] += 0.25 * (rows - p[0])
            p[1] += 0.25 * (seconds - p[1])

    def drafted(self, rows: int, drafted: int, accepted: int) -> None:
        if rows:
            self.drafts_per_row += 0.1 * (drafted / rows - self.drafts_per_row)
        if drafted:
            self.acceptance += 0.1 * (accepted / drafted - self.acceptance)

    def cost(self, rows: float) -> float | None:
        """Seconds of a step of `rows` positions, interpolated between the measured points (linear
        beyond the last two); None until there are two."""
        pts = sorted(self.points.values())
        if len(pts) < 2:
            return None
        for (n0, t0), (n1, t1) in zip(pts, pts[1:]):
            if rows <= n1 or (n1, t1) == pts[-1]:
                if n1 == n0:
                    return t1
                return max(t0 + (t1 - t0) * (rows - n0) / (n1 - n0), 1e-6)
        return None

    def expected_accepted(self, rows: int, acceptance: float | None = None) -> float:
        a = min(self.acceptance if acceptance is None else acceptance, 0.999)
        k = max(1e-9, self.drafts_per_row)
        return rows * a * (1 - a ** k) / (1 - a)

    def should_draft(self, rows: int, prefill_tokens: int = 0) -> bool:
        """Whether a step of `rows` decode rows (and newcomers' `prefill_tokens`) drafts: when the
        measured costs and the acceptance so far say it pays; now and then (`explore_every` steps)
        also where it would pay at an acceptance of 0.9 though not at the one so far (acceptance
        changes with the prompts and the weights), and every 16 steps while fewer than two step sizes
        are measured (at 16 rows or fewer). Never where it could not pay even if nearly every draft were accepted."""
        self._since += 1
        plain = rows + prefill_tokens
        t0, t1 = self.cost(plain), self.cost(plain + rows * self.drafts_per_row)
        if t0 is None or t1 is None:
            explore = self._since >= 16 and rows <= 16
        else:
            gain = self.margin * rows / t0
            if (rows + self.expected_accepted(rows)) / t1 > gain:
                return True
            explore = (rows + self.expected_accepted(rows, 0.9)) / t1 > gain and self._since >= self.explore_every
        if explore:
            self._since = 0
        return explore

"""Tasks: prompts with answers, and their rewards.

Built in: digit-string tasks generated in code (copy, reverse, sort, add), small enough that a tiny
model learns them from scratch by RL on a CPU, rewarded with partial credit. Bring your own: a
JSONL or Parquet file of prompt/answer rows (e.g. GSM8K) with the maths answer reward.
"""
from __future__ import annotations

import random
from pathlib import Path

from rollout.types import Sample

DIGIT_TASKS = ("copy", "reverse", "sort", "add")


def digit_items(kind: str, num_digits: int, count: int, seed: int, min_digits: int = 0) -> list[dict]:
    """`count` problems of num_digits digits each, or of min_digits..num_digits (uniform) when
    min_digits > 0: then the answers vary in length, and the long ones are the hard ones."""
    if kind not in DIGIT_TASKS:
        raise ValueError(f"task.name={kind!r}: built-in tasks are {DIGIT_TASKS} (or 'dataset' with task.path)")
    rng = random.Random(seed)
    items = []
    for _ in range(count):
        n = rng.randint(min_digits, num_digits) if min_digits else num_digits
        digits = "".join(rng.choice("0123456789") for _ in range(n))
        if kind == "add":
            a, b = int(digits), rng.randrange(10 ** n)
            prompt, answer = f"add:{a}+{b}=", str(a + b)
        else:
            answer = {"copy": digits, "reverse": digits[::-1], "sort": "".join(sorted(digits))}[kind]
            prompt = f"{kind}:{digits}="
        items.append({"prompt": prompt, "answer": answer})
    return items


def partial_credit_score(got: str, want: str) -> float:
    """Half for the right characters in any order, half for the right characters in the right place;
    extra characters cost as much as missing ones, so only exactly the answer scores 1."""
    got = got.strip()
    size = max(len(want), len(got), 1)
    pool = list(want)
    present = 0
    for c in got:
        if c in pool:
            pool.remove(c)
            present += 1
    placed = sum(a == b for a, b in zip(got, want))
    return 0.5 * present / size + 0.5 * placed / size


async def partial_credit(sample: Sample) -> float:
    return partial_credit_score(sample.response_text, str(sample.label))


def dataset_items(path: str, prompt_key: str = "prompt", answer_key: str = "answer") -> list[dict]:
    """Rows of a JSONL or Parquet file, read with `datasets`."""
    import datasets
    p = Path(path)
    if not p.exists():
        raise ValueError(f"task.path={path!r}: no such file")
    kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(p.suffix)
    if kind is None:
        raise ValueError(f"task.path={path!r}: expected a .jsonl, .json or .parquet file")
    rows = datasets.load_dataset(kind, data_files=str(p), split="train")
    for key in (prompt_key, answer_key):
        if key not in rows.column_names:
            raise ValueError(f"task.path={path!r} has no column {key!r} (columns: {rows.column_names}); "
                             f"set task.prompt_key / task.answer_key")
    return [{"prompt": r[prompt_key], "answer": r[answer_key]} for r in rows]

"""A dataset task of your own with a custom reward, as a user brings one:

    python examples/digit_map.py /tmp/digit_map.jsonl          # writes the dataset
    riptide-train task.name=dataset task.path=/tmp/digit_map.jsonl task.reward=examples.digit_map:reward

The data: a fixed one-digit mapping (a permutation of 0-9) asked as "map:3=" with the mapped digit as
the answer, 2,000 rows. The reward: 1 for exactly the answer, 0.2 for a single digit that is wrong
(the right format), 0 otherwise.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

MAPPING = {str(d): str(m) for d, m in zip(range(10), [7, 2, 9, 0, 5, 1, 8, 3, 6, 4])}


def write(path: str | Path, rows: int = 2000, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for _ in range(rows):
            d = str(rng.randrange(10))
            f.write(json.dumps({"prompt": f"map:{d}=", "answer": MAPPING[d]}) + "\n")
    return path


async def reward(sample) -> float:
    got = sample.response_text.strip()
    if got == str(sample.label):
        return 1.0
    return 0.2 if len(got) == 1 and got.isdigit() else 0.0


if __name__ == "__main__":
    print(write(sys.argv[1] if len(sys.argv) > 1 else "digit_map.jsonl"))

"""Tasks: prompts with answers, and their rewards.

Built in, generated in code: digit-string tasks (copy, reverse, sort, add), small enough that a tiny
model learns them from scratch by RL on a CPU, rewarded with partial credit; and reasoning-gym's
problems (e.g. basic_arithmetic), scored by reasoning-gym's own `score_answer`. Bring your own: a
JSONL, JSON or Parquet file, a folder of them, or a `datasets.save_to_disk` folder, with
prompt/answer rows (e.g. GSM8K) or verl's rows (`prompt` as chat messages, `reward_model.ground_truth`).

Every item is `{"prompt", "answer", "data_source", "extra_info"}`: the last two reach the reward in
the sample's metadata, as verl's compute_score wants them.
"""
from __future__ import annotations

import dataclasses
import functools
import random
from pathlib import Path
from typing import Callable

from rollout.rewards import final_answer
from rollout.types import Sample

DIGIT_TASKS = ("copy", "reverse", "sort", "add")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")     # what save_to_disk writes
VAL_SEED = 1_000_003       # a held-out split is generated with the job's seed plus this: streams apart
REASONING_GYM_MISSING = "reasoning-gym is not installed: `make setup-real` installs it (or pip install reasoning-gym)"


def item(prompt, answer, data_source: str, extra_info: dict | None = None) -> dict:
    return {"prompt": prompt, "answer": answer, "data_source": data_source, "extra_info": extra_info or {}}


# ---- digit tasks -------------------------------------------------------------------------------

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
        items.append(item(prompt, answer, kind))
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


# ---- reasoning-gym -----------------------------------------------------------------------------

def reasoning_gym():
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(f"task.name=reasoning_gym: {REASONING_GYM_MISSING}") from None
    return reasoning_gym


def reasoning_gym_dataset(name: str, config: dict, count: int, seed: int):
    """reasoning-gym's generator `name`; its own errors (an unknown name, a config field it lacks or
    a value its validate() refuses) named by the field to change."""
    rg, config = reasoning_gym(), dict(config)
    if problem := reasoning_gym_problem(rg, name, config):
        raise ValueError(problem)
    try:
        return rg.create_dataset(name, seed=seed, size=count, **config)
    except (TypeError, AssertionError, ValueError) as e:
        raise ValueError(f"task.rg_config={config} is refused by reasoning-gym's {name}: {type(e).__name__}: {e}") \
            from None


def reasoning_gym_problem(rg, name: str, config: dict) -> str | None:
    if name not in rg.factory.DATASETS:
        return (f"task.rg_dataset={name!r} is not one of reasoning-gym's datasets, e.g. basic_arithmetic, chain_sum, "
                f"gsm_symbolic (all: reasoning_gym.factory.DATASETS)")
    config_class = rg.factory.DATASETS[name][1]
    fields = [f.name for f in dataclasses.fields(config_class) if f.name not in ("seed", "size")] \
        if dataclasses.is_dataclass(config_class) else list(config)
    if unknown := sorted(set(config) - set(fields)):
        return (f"task.rg_config has {unknown}, which reasoning-gym's {name} does not take here: it takes {fields} "
                f"(seed and size come from seed and task.num_prompts). task=arith sets basic_arithmetic's: another "
                f"generator wants a task yaml of its own")
    if name == "basic_arithmetic" and config.get("allow_parentheses") is False \
            and set(config.get("operators", "*")) & {"*", "/"}:
        # reasoning-gym 0.1.19 computes these left to right: "4 - 5 * 3" comes with the answer -3
        return (f"task.rg_config={config}: basic_arithmetic without parentheses gets '*' and '/' wrong "
                f"(4 - 5 * 3 = -3); set operators: ['+', '-'] or allow_parentheses: true")
    return None


def reasoning_gym_items(name: str, config: dict, count: int, seed: int, template: str) -> list[dict]:
    """`count` problems of reasoning-gym's `name`; the prompt is `template` with {question} replaced
    (replaced, not str.format: a template may ask for \\boxed{})."""
    return [item(template.replace("{question}", e["question"]), e["answer"], f"reasoning_gym/{name}",
                 {"question": e["question"], "metadata": e.get("metadata", {})})
            for e in reasoning_gym_dataset(name, config, count, seed)]


@functools.lru_cache(maxsize=None)
def reasoning_gym_scorer(name: str) -> Callable:
    return reasoning_gym().get_score_answer_fn(name)


def reasoning_gym_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None):
    """verl's signature: reasoning-gym's own score_answer on the response's final answer ('#### N',
    \\boxed{N} or the last number; rollout.rewards.final_answer). 1 for the right answer, 0 for none;
    some generators give partial credit for a near miss."""
    extra_info = extra_info or {}
    entry = {"question": extra_info.get("question", ""), "answer": ground_truth,
             "metadata": extra_info.get("metadata") or {}}
    return float(reasoning_gym_scorer(data_source.removeprefix("reasoning_gym/"))(final_answer(solution_str), entry))


# ---- your own data -----------------------------------------------------------------------------

def data_path_problem(field: str, path: str) -> str | None:
    """Why `path` is not data Riptide reads (None when it is)."""
    p = Path(path)
    if not p.exists():
        return f"{field}={path!r}: no such file or folder"
    if p.is_file() and p.suffix not in DATA_SUFFIXES:
        return f"{field}={path!r}: expected a {', '.join(DATA_SUFFIXES)} file, or a folder of them"
    if p.is_dir() and not any((p / m).exists() for m in SAVED_MARKERS) \
            and not any(f.suffix in (*DATA_SUFFIXES, ".csv", ".arrow") for f in p.rglob("*")):
        return (f"{field}={path!r}: the folder holds no data files ({', '.join(DATA_SUFFIXES)}) and is not a "
                f"datasets save_to_disk folder")
    return None


def read_rows(path: str, split: str, field: str = "task.path"):
    """A `datasets.Dataset` from a file, a folder of data files or a save_to_disk folder. A folder
    with several splits (files named train*/test*, or a saved DatasetDict) gives `split`."""
    import datasets
    if problem := data_path_problem(field, path):
        raise ValueError(problem)
    p = Path(path)
    if p.is_file():
        return datasets.load_dataset(p.suffix.lstrip(".").replace("jsonl", "json"), data_files=str(p), split="train")
    saved = any((p / m).exists() for m in SAVED_MARKERS)
    rows = datasets.load_from_disk(str(p)) if saved else datasets.load_dataset(str(p))
    if isinstance(rows, datasets.Dataset):
        return rows
    if len(rows) == 1:
        return next(iter(rows.values()))
    if split not in rows:
        split_field = "task.split" if field == "task.path" else "task.val_split"
        raise ValueError(f"{field}={path!r} has splits {sorted(rows)}, not {split!r}: set {split_field}")
    return rows[split]


def dataset_items(path: str, prompt_key: str = "prompt", answer_key: str = "answer", split: str = "train",
                  field: str = "task.path") -> list[dict]:
    """Items of a file or folder: prompt/answer rows, or verl's rows, told by a `reward_model`
    column where there is no answer column."""
    rows = read_rows(path, split, field)
    columns = rows.column_names
    verl = "reward_model" in columns and answer_key not in columns
    for key in (prompt_key,) if verl else (prompt_key, answer_key):
        if key not in columns:
            raise ValueError(f"{field}={path!r} has no column {key!r} (columns: {columns}); "
                             f"set task.prompt_key / task.answer_key")
    source = Path(path).stem
    return [item(messages_or_text(r[prompt_key]), verl_answer(r, path, field) if verl else r[answer_key],
                 r.get("data_source") or source, r.get("extra_info")) for r in rows]


def verl_answer(row: dict, path: str, field: str):
    reward_model = row["reward_model"] or {}
    if "ground_truth" not in reward_model:
        raise ValueError(f"{field}={path!r}: a verl row's reward_model has no ground_truth: {reward_model!r}")
    return reward_model["ground_truth"]


def messages_or_text(prompt):
    """Chat messages as read from Arrow carry every key any message has, None where this one has
    none (e.g. tool_calls); a chat template reads a None key as present, so drop them."""
    if isinstance(prompt, list):
        return [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in prompt]
    return prompt


# ---- held out ----------------------------------------------------------------------------------

def prompt_key_of(prompt) -> str:
    return prompt if isinstance(prompt, str) else repr(prompt)


def held_out(generate: Callable[[int, int], list[dict]], train: list[dict], size: int, seed: int) -> list[dict]:
    """`size` generated items none of whose prompts is a training prompt (nor another's), drawn with
    seeds apart from training's. Fewer when the task has few problems beyond its training set
    (copy of one digit has ten in all): a few draws, then what there is."""
    seen = {prompt_key_of(it["prompt"]) for it in train}
    out = []
    for attempt in range(4):
        for it in generate(2 * size, seed + VAL_SEED + attempt * 7919):
            key = prompt_key_of(it["prompt"])
            if key not in seen:
                seen.add(key)
                out.append(it)
            if len(out) == size:
                return out
    return out

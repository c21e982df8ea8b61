"""Reward functions, named in config as `module:function`: `reward(sample) -> float`, or verl's
`compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict`, unchanged.
Either may be sync or async; `get_reward` makes each an `async (sample) -> float`."""
from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from typing import Awaitable, Callable

from rollout.types import Sample

RewardFn = Callable[[Sample], Awaitable[float]]
_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*(?:[eE][-+]?\d+)?|-?\.\d+")


def import_module(module: str):
    """Import `module`, also from the working directory (as `python -m` would): an entry-point
    script like riptide-train does not put it on sys.path."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        cwd = os.getcwd()
        if cwd in sys.path or not (e.name or "").split(".")[0] == module.split(".")[0]:
            raise
        sys.path.append(cwd)
        return importlib.import_module(module)


def load_callable(spec: str):
    """'package.module:function' -> the function; a clear error when it is not there."""
    if ":" not in spec:
        raise ValueError(f"{spec!r}: expected 'module:function'")
    module, name = spec.split(":", 1)
    try:
        fn = getattr(import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{spec!r} cannot be loaded: {e}") from None
    if not callable(fn):
        raise ValueError(f"{spec!r} is not callable")
    return fn


def verl_args(sample: Sample) -> dict:
    """What verl passes a compute_score, from a sample: data_source and extra_info come from the
    item's metadata (rollout.tasks puts them there), the ground truth is the label."""
    return {"data_source": sample.metadata.get("data_source", ""), "solution_str": sample.response_text,
            "ground_truth": sample.label, "extra_info": sample.metadata.get("extra_info") or {}}


def caller(fn, spec: str) -> Callable[[Sample], object]:
    """`fn` as a function of a sample. verl's signature is told by its `solution_str` parameter;
    only the arguments it names are passed (verl's own gsm8k scorer takes two of the four)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):           # a builtin or C callable: no signature to read
        return fn
    if "solution_str" not in params:
        required = [p for p in params.values() if p.default is p.empty
                    and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(required) > 1:
            raise ValueError(f"{spec!r} takes ({', '.join(params)}): a reward takes (sample), or verl's "
                             f"(data_source, solution_str, ground_truth, extra_info=None)")
        return fn
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return lambda sample: fn(**verl_args(sample))
    return lambda sample: fn(**{k: v for k, v in verl_args(sample).items() if k in params})


def as_score(out, sample: Sample, spec: str) -> float:
    """A reward's return value as a float. verl's scorers may return a dict with "score" and more
    (e.g. "acc", "pred"): the rest is kept on the sample, in metadata["reward_info"]."""
    if not isinstance(out, dict):
        return float(out)
    if "score" not in out:
        raise ValueError(f"{spec!r} returned a dict without 'score' (keys: {sorted(out)})")
    sample.metadata["reward_info"] = {k: v for k, v in out.items() if k != "score"}
    return float(out["score"])


def as_async(fn, spec: str = "") -> RewardFn:
    """Either signature, sync or async, as an `async (sample) -> float`."""
    call = caller(fn, spec or getattr(fn, "__name__", repr(fn)))

    async def reward(sample: Sample) -> float:
        out = call(sample)
        if inspect.isawaitable(out):
            out = await out
        return as_score(out, sample, spec)
    return reward


async def exact_match(sample: Sample) -> float:
    """1 when the response, stripped, equals the label."""
    return float(sample.response_text.strip() == str(sample.label).strip())


def final_answer(text: str) -> str | None:
    """The final answer a response gives, as text: the last number in its last \\boxed{}, else after
    its last '####', else anywhere; commas dropped and "12.0" written "12" (scorers that compare
    strings, like reasoning-gym's, then see what the model meant). No number: what the box or
    '####' holds, if anything."""
    boxed = re.findall(r"\\boxed\{([^}]*)\}", text)
    part = boxed[-1] if boxed else text.split("####")[-1]
    candidates = _NUMBER.findall(part)
    if not candidates:
        return (part.strip() or None) if (boxed or "####" in text) else None
    number = candidates[-1].replace(",", "").rstrip(".")
    return re.sub(r"\.0*$", "", number) if re.fullmatch(r"-?\d+\.0*", number) else number


def last_number(text: str) -> float | None:
    answer = final_answer(text)
    try:
        return float(answer) if answer is not None else None
    except ValueError:
        return None


async def math_answer(sample: Sample) -> float:
    """GSM8K-style: the last number in the response (or in \\boxed{}, or after ####) equals the label's."""
    got = last_number(sample.response_text)
    want = last_number(str(sample.label))
    return float(got is not None and want is not None and abs(got - want) < 1e-6 * max(1.0, abs(want)))


async def format_check(sample: Sample) -> float:
    """1 when the response puts its final answer in \\boxed{} or after '####'."""
    return float(bool(re.search(r"\\boxed\{[^}]+\}|####\s*\S", sample.response_text)))


BUILTIN = {"exact_match": exact_match, "math_answer": math_answer, "format_check": format_check}


def get_reward(spec: str) -> RewardFn:
    return BUILTIN[spec] if spec in BUILTIN else as_async(load_callable(spec), spec)

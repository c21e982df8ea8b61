"""Reward functions: `async def reward(sample) -> float`, named in config as `module:function`."""
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


def as_async(fn) -> RewardFn:
    if inspect.iscoroutinefunction(fn):
        return fn

    async def wrapper(sample: Sample) -> float:
        return fn(sample)
    return wrapper


async def exact_match(sample: Sample) -> float:
    """1 when the response, stripped, equals the label."""
    return float(sample.response_text.strip() == str(sample.label).strip())


def last_number(text: str) -> float | None:
    boxed = re.findall(r"\\boxed\{([^}]*)\}", text)
    candidates = _NUMBER.findall(boxed[-1] if boxed else text.split("####")[-1])
    if not candidates:
        return None
    try:
        return float(candidates[-1].replace(",", "").rstrip("."))
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
    return BUILTIN[spec] if spec in BUILTIN else as_async(load_callable(spec))

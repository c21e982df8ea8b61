"""A multi-turn rollout with a tool call, chosen from the Hydra config:

    riptide-train task=add rollout.rollout_fn=examples.tool_rollout:calculator \
        task.reward=examples.tool_rollout:final_answer rollout.max_new_tokens=12

Each sample is a short episode on the built-in `add` task ("add:123+456="):
1. the model's turn: it writes a few tokens of working (trained on: loss_mask 1);
2. the tool's turn: a calculator evaluates the sum in the prompt and its output, "[579]", is appended
   to the context with `sample.append_environment` (kept in context, never trained on: loss_mask 0);
3. the model's turn again: its final answer (trained on).

The reward reads only what the model wrote after the tool's output, so the model is rewarded for
copying the tool's result into its answer, which a tiny model learns from scratch. Weight updates,
aborts and dead servers are handled inside `ctx.generate`: a turn cut short by a new weight version
resumes from its partial tokens under the new weights.
"""
from __future__ import annotations

import re

from rollout.types import Sample, SampleStatus

WORKING_TOKENS = 2          # the model's first turn
TOOL_OPEN, TOOL_CLOSE = "[", "]"


def evaluate(prompt: str) -> str:
    """The calculator: the sum in an `add:a+b=` prompt."""
    match = re.search(r"(\d+)\s*\+\s*(\d+)", prompt)
    return str(int(match.group(1)) + int(match.group(2))) if match else "?"


async def calculator(sample: Sample, ctx) -> Sample:
    budget = ctx.max_new_tokens
    if not sample.response_ids:               # (a resumed sample may have done its first turn already)
        await ctx.generate(sample, max_new_tokens=min(WORKING_TOKENS, budget))
    if TOOL_OPEN not in ctx.tokenizer.decode(sample.response_ids, skip_special_tokens=True):
        tool = ctx.tokenizer(f"{TOOL_OPEN}{evaluate(sample.prompt)}{TOOL_CLOSE}", add_special_tokens=False).input_ids
        sample.append_environment(tool)
    left = budget - sample.num_generated
    if left > 0:
        await ctx.generate(sample, max_new_tokens=left)
    else:
        sample.status = SampleStatus.TRUNCATED
    return sample


async def final_answer(sample: Sample) -> float:
    """Partial credit for what the model wrote after the tool's output."""
    from rollout.tasks import partial_credit_score
    text = sample.response_text
    answer = text.rsplit(TOOL_CLOSE, 1)[-1] if TOOL_CLOSE in text else ""
    return partial_credit_score(answer, str(sample.label))

"""The rollout-function contract: `async def rollout(sample, ctx) -> Sample`.

`ctx.generate(sample)` continues the sample from its current tokens and appends what the model
generates (loss_mask 1). A multi-turn function appends tool or environment output with
`sample.append_environment(ids)` (loss_mask 0) and calls `ctx.generate` again. Aborts (a new weight
version landed) and dead servers are handled inside `ctx.generate`: the request resumes from the
partial response, on the same server if it lives, under the newest weights.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Awaitable, Callable

from rollout.types import Sample, SampleStatus

if TYPE_CHECKING:
    from rollout.context import RolloutContext

RolloutFn = Callable[[Sample, "RolloutContext"], Awaitable[Sample]]


async def single_turn(sample: Sample, ctx: "RolloutContext") -> Sample:
    """One response; a sample resumed after a restart continues within the same token budget."""
    left = ctx.max_new_tokens - sample.num_generated
    if left > 0:
        await ctx.generate(sample, max_new_tokens=left)
    else:
        sample.status = SampleStatus.TRUNCATED
    return sample


def get_rollout_fn(spec: str) -> RolloutFn:
    if spec in ("", "single_turn"):
        return single_turn
    from rollout.rewards import load_callable
    return load_callable(spec)

"""One request's state as the engine sees it: tokens in, tokens out, and how it ended."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable

class Finish(str, enum.Enum):
    """Why a sequence ended. On the wire it stays SGLang's `finish_reason` dict, `{"type": ..., ...}`
    (`reason`)."""
    STOP = "stop"          # a stop token or string: "matched" says which
    LENGTH = "length"      # max_new_tokens or the context: "length" generated
    ABORT = "abort"        # aborted (a weight update, a client, a shutdown): "message"

    def reason(self, **detail) -> dict:
        return {"type": self.value, **detail}


class SeqStatus(enum.Enum):
    WAITING = "waiting"      # queued; holds no KV slot
    RUNNING = "running"      # holds a KV slot; decoded every step
    FINISHED = "finished"


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    top_logprobs: int = 0                      # also report this many most likely tokens per step

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


@dataclass(eq=False)
class Sequence:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    group_rid: str | None = None             # the request a sample of n > 1 belongs to
    stream: bool = False
    on_update: Callable[["Sequence"], Any] | None = None  # called from the engine thread
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    next_top: list[tuple[int, float]] | None = None    # the sampler's top logprobs for the token it draws
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: dict | None = None
    slot: int | None = None
    blocks: list[int] = field(default_factory=list)    # paged KV cache: the blocks its positions fill
    cached: int = 0                          # paged: its first positions, taken from the prefix cache at admission
    cached_tokens: int = 0                   # paged: positions its last admission took from the prefix cache (and tier)
    kv_epoch: int | None = None              # paged: the weights epoch all its keys and values were computed under
    prefill_version: int | None = None       # weights that computed the KV cache of the prompt (the oldest of them)
    keep_old_kv: bool = False                # paged: may take cached blocks of older weights (kv_policy "continue")
    kv_versions: list[list[int]] = field(default_factory=list)  # [start, end, weights version] of the positions
                                                                # it was admitted with (the last admission)
    num_retractions: int = 0
    arrival: float = field(default_factory=time.monotonic)
    generator: Any = None                     # torch.Generator when params.seed is set
    forwards: int = 0                         # forward passes its tokens came from (fewer than tokens with drafts)
    spec_drafted: int = 0                     # speculative decoding: tokens drafted for it, and accepted
    spec_accepted: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def matches(self, rid: str) -> bool:
        return self.rid == rid or self.group_rid == rid

    def append(self, token: int, logprob: float, version: int) -> None:
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        self.output_versions.append(version)
        if self.next_top is not None:
            self.output_top_logprobs.append(self.next_top)
            self.next_top = None

    def finish(self, reason: dict) -> None:
        self.status = SeqStatus.FINISHED
        self.finish_reason = reason
        self.slot = None

"""Rollout data: a Sample per trajectory, a Group of n per prompt. No torch here: the rollout process
imports only plain Python (trainer_bridge.batch pads groups into tensors, on the trainer's side)."""
from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field
from typing import Any



class Finish(str, enum.Enum):
    """Why a generation ended, as a server's `finish_reason["type"]` says (SGLang's names)."""
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class SampleStatus(str, enum.Enum):
    PENDING = "pending"        # not started
    RUNNING = "running"        # a request is in flight
    PARTIAL = "partial"        # aborted mid-response; keeps its tokens and resumes later
    COMPLETED = "completed"    # the model stopped (EOS / stop string)
    TRUNCATED = "truncated"    # hit max_new_tokens or the context
    FAILED = "failed"          # an error (reward function raised, server refused): see `error`

    @property
    def finished(self) -> bool:
        return self in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED, SampleStatus.FAILED)


class DropReason(str, enum.Enum):
    """Why the manager dropped a group (a user's filter may give its own reason, as a string)."""
    STALE = "stale"                          # past max_staleness (regenerated instead, by config)
    FAILED = "failed"                        # requests or reward failed, retries used up
    ALL_EQUAL = "all_equal_rewards"          # the all_equal filter: no advantage anywhere


@dataclass(eq=False)
class Sample:
    group_id: str
    index: int                                  # position in its group
    prompt_ids: list[int]
    prompt: str | list = ""                     # text, or chat messages [{role, content}]
    label: Any = None                           # the reference answer, for rewards
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)       # behaviour logprobs, one per response token
    versions: list[int] = field(default_factory=list)         # weight version per response token (-1: not generated)
    loss_mask: list[int] = field(default_factory=list)        # 1: the model generated it; 0: tool/environment
    response_text: str = ""
    reward: float | None = None
    status: SampleStatus = SampleStatus.PENDING
    error: str | None = None
    metadata: dict = field(default_factory=dict)
    uid: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    num_aborts: int = 0                         # times a request for it was aborted and resumed
    num_retries: int = 0                        # times a failed request was moved to another server
    segments: list = field(default_factory=list)  # [server url, wall start, wall end, tokens] per request

    # ---- appending ------------------------------------------------------------------------------
    def append_generated(self, ids: list[int], logprobs: list[float], versions: list[int],
                         segment: list | None = None) -> None:
        """`segment`: [server url, wall-clock start, end] of the request that generated them (kept
        with the token count, for an audit of which weights served which tokens)."""
        if not (len(ids) == len(logprobs) == len(versions)):
            raise ValueError(f"sample {self.uid}: {len(ids)} tokens, {len(logprobs)} logprobs, "
                             f"{len(versions)} versions")
        if segment is not None and ids:
            self.segments.append([*segment, len(ids)])
        self.response_ids += ids
        self.logprobs += logprobs
        self.versions += versions
        self.loss_mask += [1] * len(ids)

    def append_environment(self, ids: list[int]) -> None:
        """Tokens the model did not generate (tool output, user turns): kept in context, not trained on."""
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self.loss_mask += [0] * len(ids)

    # ---- derived ---------------------------------------------------------------------------------
    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    @property
    def min_version(self) -> int | None:
        gen = [v for v in self.versions if v >= 0]
        return min(gen) if gen else None

    def staleness(self, trainer_version: int) -> int:
        """How many versions behind the trainer its oldest token is (0 for a sample with no tokens)."""
        v = self.min_version
        return 0 if v is None else trainer_version - v

    def reset(self) -> None:
        """Drop the response (to regenerate it from the prompt)."""
        self.response_ids, self.logprobs, self.versions, self.loss_mask = [], [], [], []
        self.segments = []
        self.response_text, self.reward, self.error = "", None, None
        self.status = SampleStatus.PENDING

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Sample":
        return cls(**{**d, "status": SampleStatus(d["status"])})


@dataclass(eq=False)
class Group:
    """The n samples of one prompt (GRPO's group)."""
    group_id: str
    samples: list[Sample]
    data_index: int = -1                        # where its prompt came from in the data source
    retries: int = 0                            # times its prompt ran again after the group failed

    @property
    def finished(self) -> bool:
        return all(s.status.finished for s in self.samples)

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    def staleness(self, trainer_version: int) -> int:
        return max(s.staleness(trainer_version) for s in self.samples)

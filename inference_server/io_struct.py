"""Wire messages of the HTTP API, in SGLang's native shape plus Riptide's extras.

Fields are strict (a string is not an int); unknown sampling fields that SGLang accepts are ignored,
so SGLang clients work unchanged. Checks that need the model (vocabulary, context) live in the server.
"""
from __future__ import annotations

from typing import Literal, Union

import orjson

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

Number = Union[StrictInt, StrictFloat]
MAX_N = 64
MAX_TOP_LOGPROBS = 20



def dumps(obj) -> str:
    """JSON text of a reply (orjson: ~20x json.dumps on a reply of a few hundred logprobs)."""
    return orjson.dumps(obj).decode()

class SamplingParamsIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    max_new_tokens: StrictInt = 128
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: StrictInt = -1
    min_p: Number = 0.0
    stop: Union[StrictStr, list[StrictStr], None] = None
    stop_token_ids: Union[list[StrictInt], None] = None
    ignore_eos: StrictBool = False
    n: StrictInt = 1
    seed: Union[StrictInt, None] = None
    top_logprobs: StrictInt = 0               # report this many most likely tokens per step (OpenAI's)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v):
        if not 0 <= v <= MAX_TOP_LOGPROBS:
            raise ValueError(f"must be in [0, {MAX_TOP_LOGPROBS}]")
        return v

    @field_validator("max_new_tokens")
    @classmethod
    def _max_new(cls, v):
        if v < 0:
            raise ValueError("must be >= 0")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v):
        if v < 0:
            raise ValueError("must be >= 0 (0 means greedy)")
        return float(v)

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v):
        if not 0 < v <= 1:
            raise ValueError("must be in (0, 1]")
        return float(v)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        if v == 0 or v < -1:
            raise ValueError("must be -1 (off) or >= 1")
        return v

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, v):
        if not 0 <= v <= 1:
            raise ValueError("must be in [0, 1]")
        return float(v)

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if not 1 <= v <= MAX_N:
            raise ValueError(f"must be in [1, {MAX_N}]")
        return v

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class GenerateReqInput(BaseModel):
    model_config = ConfigDict(extra="ignore")
    text: Union[StrictStr, list[StrictStr], None] = None
    input_ids: Union[list[StrictInt], list[list[StrictInt]], None] = None
    sampling_params: Union[SamplingParamsIn, list[SamplingParamsIn], None] = None
    return_logprob: Union[StrictBool, list[StrictBool]] = False
    stream: StrictBool = False
    rid: Union[StrictStr, list[StrictStr], None] = None
    # "continue": the prompt may take cached keys and values made under older weights (the server's
    # --kv-keep-versions), as a request running across an update keeps its own; meta_info's
    # kv_versions says which weights made which positions. "fresh" (default): only the serving weights'.
    kv_policy: Literal["fresh", "continue"] = "fresh"


class EndEpisodeReqInput(BaseModel):
    """A multi-turn episode is over: its tokens (prompt and every turn), and how many of the first are
    shared with other episodes (a GRPO group's prompt), whose blocks stay where they are."""
    input_ids: list[StrictInt]
    shared_tokens: StrictInt = Field(0, ge=0)


class AbortReqInput(BaseModel):
    rid: Union[StrictStr, list[StrictStr]] = ""     # a list is Riptide's extension: one call, many aborts
    abort_all: StrictBool = False


class PauseGenerationReqInput(BaseModel):
    mode: Literal["abort", "in_place", "retract"] = "abort"


class UpdateWeightsFromDiskReqInput(BaseModel):
    model_path: StrictStr
    weight_version: Union[StrictInt, StrictStr, None] = None
    load_format: Union[StrictStr, None] = None
    abort_all_requests: StrictBool = False


# OpenAI fields that change nothing here and are taken as given; any other field Riptide does not
# implement (tools, penalties, logit_bias, ...) is refused with a 400 naming it, not ignored.
OPENAI_HARMLESS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
OPENAI_NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1, "best_of": 1,
                  "echo": False, "response_format": {"type": "text"}, "tool_choice": "none", "tools": []}


class _OpenAISampling(BaseModel):
    """The sampling fields both OpenAI-shaped endpoints share."""
    model_config = ConfigDict(extra="allow")
    model: Union[StrictStr, None] = None
    temperature: Union[Number, None] = 1.0
    top_p: Union[Number, None] = 1.0
    top_k: StrictInt = -1
    min_p: Number = 0.0
    n: Union[StrictInt, None] = 1
    stop: Union[StrictStr, list[StrictStr], None] = None
    stop_token_ids: Union[list[StrictInt], None] = None
    seed: Union[StrictInt, None] = None
    stream: Union[StrictBool, None] = False
    stream_options: Union[dict, None] = None
    ignore_eos: StrictBool = False          # vLLM's and SGLang's extension: generate max_tokens whatever comes

    def unsupported(self) -> list[str]:
        """The fields this request sets that Riptide does not implement (a neutral value passes)."""
        out = []
        for key, value in (self.model_extra or {}).items():
            if key in OPENAI_HARMLESS or value is None:
                continue
            if key in OPENAI_NEUTRAL and value == OPENAI_NEUTRAL[key]:
                continue
            out.append(key)
        return sorted(out)


class CompletionRequest(_OpenAISampling):
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    max_tokens: Union[StrictInt, None] = 16
    logprobs: Union[StrictInt, None] = None          # how many top logprobs per token (0: the chosen one)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: Union[StrictStr, None] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: Union[StrictStr, list[ContentPart], None] = None

    def text(self, index: int) -> str | None:
        """The content as one string; list-style content may hold only text parts."""
        if not isinstance(self.content, list):
            return self.content
        bad = [p.type for p in self.content if p.type != "text"]
        if bad:
            raise ValueError(f"messages[{index}].content: only text parts are served, not {', '.join(sorted(set(bad)))}")
        return "".join(p.text or "" for p in self.content)


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Union[StrictInt, None] = None
    max_completion_tokens: Union[StrictInt, None] = None
    logprobs: Union[StrictBool, None] = False
    top_logprobs: Union[StrictInt, None] = None


def parse_version(value: int | str | None, field: str = "weight_version") -> int | None:
    """Riptide's weight versions are integers (staleness is a difference of versions)."""
    if value is None or isinstance(value, int):
        return value
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{field}: {value!r} is not an integer version") from None

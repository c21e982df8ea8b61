"""OpenAI-shaped /v1/completions, /v1/chat/completions and /v1/models over the same engine, for agent
frameworks and the official `openai` client.

Served: whole answers and `stream=true` (server-sent events, `stream_options.include_usage`), `n`,
`stop`, `seed`, `logprobs` / `top_logprobs`, list-style message content (text parts). Riptide's
extras on every choice (and every streamed chunk): `token_ids` and `weight_versions`, the weight
version that sampled each token, which a trainer needs to bound staleness. A field Riptide does not
implement (tools, penalties, logit_bias, ...) is refused with a 400 naming it, never ignored.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from inference_server.io_struct import (ChatCompletionRequest, CompletionRequest, GenerateReqInput, SamplingParamsIn,
                                        dumps)
from inference_server.sequence import Finish

_FINISH = {Finish.STOP: "stop", Finish.LENGTH: "length", Finish.ABORT: "abort"}   # OpenAI's names


def _refuse_unsupported(req) -> None:
    bad = req.unsupported()
    if bad:
        raise ValueError(f"unsupported field{'s' if len(bad) > 1 else ''}: {', '.join(bad)} "
                         f"(Riptide serves sampling, stop, n, seed, logprobs and streaming; not tools or penalties)")


def _sampling(req, max_tokens: int, top_logprobs: int) -> SamplingParamsIn:
    return SamplingParamsIn(max_new_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k, min_p=req.min_p,
                            stop=req.stop, stop_token_ids=req.stop_token_ids, n=req.n or 1, seed=req.seed,
                            top_logprobs=top_logprobs, ignore_eos=req.ignore_eos)


def _usage(seqs) -> dict:
    prompt = sum(len(s.prompt_ids) for s in {id(s.prompt_ids): s for s in seqs}.values())
    completion = sum(len(s.output_ids) for s in seqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish(seq, finished: bool = True) -> str | None:
    return _FINISH[Finish(seq.finish_reason["type"])] if finished and seq.finish_reason else None


class _Texts:
    """The text of each sequence as it grows, handed out in pieces that never take back what was
    sent: a piece stops short of anything a stop string could still cut, and of an incomplete
    character."""

    def __init__(self, server, seqs):
        self.server, self.seqs = server, seqs
        self.sent = [0] * len(seqs)
        self.tokens = [0] * len(seqs)
        self.hold = max((len(s) for seq in seqs for s in seq.params.stop), default=1) - 1

    def delta(self, i: int, n: int, finished: bool) -> tuple[str, list[int], range]:
        text = self.server.output(self.seqs[i], n, False, finished)["text"]
        end = len(text) if finished else max(self.sent[i], len(text) - self.hold)
        while not finished and end > self.sent[i] and text[end - 1] == "\ufffd":
            end -= 1
        piece, self.sent[i] = text[self.sent[i]:end], max(self.sent[i], end)
        new = range(self.tokens[i], n)
        self.tokens[i] = n
        return piece, self.seqs[i].output_ids[new.start:new.stop], new


async def _stream(server, seqs, chunk, usage: bool) -> AsyncIterator[str]:
    texts = _Texts(server, seqs)
    async for i, n, finished in server.updates(seqs):
        piece, ids, new = texts.delta(i, n, finished)
        if piece or ids or finished:
            yield f"data: {dumps(chunk(i, piece, ids, new, _finish(seqs[i], finished)))}\n\n"
    if usage:
        yield f"data: {dumps(chunk(None, '', [], range(0), None) | {'choices': [], 'usage': _usage(seqs)})}\n\n"
    yield "data: [DONE]\n\n"


def _extras(seq, new: range) -> dict:
    return {"token_ids": seq.output_ids[new.start:new.stop], "weight_versions": seq.output_versions[new.start:new.stop]}


async def _generate(server, prompt_ids: list[list[int]], sp: SamplingParamsIn, stream: bool):
    req = GenerateReqInput(input_ids=prompt_ids, sampling_params=[sp] * len(prompt_ids), return_logprob=True,
                           stream=stream)
    seqs, _, _ = server.sequences(req)
    if not stream:
        await server.run(seqs)
    return seqs


async def completion(server, req: CompletionRequest):
    _refuse_unsupported(req)
    p = req.prompt
    prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    ids = [x if isinstance(x, list) else server.tokenizer(x, add_special_tokens=False).input_ids for x in prompts]
    top = req.logprobs or 0
    seqs = await _generate(server, ids, _sampling(req, 16 if req.max_tokens is None else req.max_tokens, top),
                           bool(req.stream))
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": req.model or server.model_path}

    def logprobs(seq, new: range) -> dict | None:
        if req.logprobs is None:
            return None
        tops = seq.output_top_logprobs[new.start:new.stop] if top else []
        return {"tokens": [server.token_text(t) for t in seq.output_ids[new.start:new.stop]],
                "token_logprobs": seq.output_logprobs[new.start:new.stop],
                "top_logprobs": [{server.token_text(t): lp for t, lp in step} for step in tops] if top else None,
                "text_offset": None}

    if req.stream:
        def chunk(i, piece, ids, new, finish):
            choice = [] if i is None else [{"index": i, "text": piece, "finish_reason": finish,
                                            "logprobs": logprobs(seqs[i], new), **_extras(seqs[i], new)}]
            return {**head, "choices": choice}
        include = bool((req.stream_options or {}).get("include_usage"))
        return StreamingResponse(_stream(server, seqs, chunk, include), media_type="text/event-stream")
    choices = []
    for i, s in enumerate(seqs):
        whole = range(len(s.output_ids))
        choices.append({"index": i, "text": server.output(s, len(s.output_ids), False)["text"],
                        "finish_reason": _finish(s), "logprobs": logprobs(s, whole), **_extras(s, whole)})
    return {**head, "choices": choices, "usage": _usage(seqs)}


async def chat_completion(server, req: ChatCompletionRequest):
    _refuse_unsupported(req)
    if req.top_logprobs and not req.logprobs:
        raise ValueError("top_logprobs: set logprobs=true to get top_logprobs")
    messages = []
    for i, m in enumerate(req.messages):
        messages.append({**m.model_dump(exclude_none=True), "content": m.text(i) or ""})
    if not getattr(server.tokenizer, "chat_template", None):
        raise ValueError("messages: the model's tokenizer has no chat template; use /v1/completions")
    ids = server.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    max_tokens = req.max_completion_tokens or req.max_tokens or 128
    top = req.top_logprobs or 0
    seqs = await _generate(server, [list(ids)], _sampling(req, max_tokens, top), bool(req.stream))
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": req.model or server.model_path}

    def logprobs(seq, new: range) -> dict | None:
        if not req.logprobs:
            return None
        tops = seq.output_top_logprobs[new.start:new.stop] if top else [[]] * len(new)
        content = []
        for t, lp, step in zip(seq.output_ids[new.start:new.stop], seq.output_logprobs[new.start:new.stop], tops):
            token = server.token_text(t)
            content.append({"token": token, "logprob": lp, "bytes": list(token.encode()),
                            "top_logprobs": [{"token": server.token_text(u), "logprob": v,
                                              "bytes": list(server.token_text(u).encode())} for u, v in step]})
        return {"content": content}

    if req.stream:
        def chunk(i, piece, ids, new, finish):
            choice = [] if i is None else [{
                "index": i, "delta": {**({"role": "assistant"} if new.start == 0 else {}), "content": piece},
                "finish_reason": finish, "logprobs": logprobs(seqs[i], new), **_extras(seqs[i], new)}]
            return {**head, "object": "chat.completion.chunk", "choices": choice}
        include = bool((req.stream_options or {}).get("include_usage"))
        return StreamingResponse(_stream(server, seqs, chunk, include), media_type="text/event-stream")
    choices = []
    for i, s in enumerate(seqs):
        whole = range(len(s.output_ids))
        choices.append({"index": i, "message": {"role": "assistant",
                                                "content": server.output(s, len(s.output_ids), False)["text"]},
                        "finish_reason": _finish(s), "logprobs": logprobs(s, whole), **_extras(s, whole)})
    return {**head, "object": "chat.completion", "choices": choices, "usage": _usage(seqs)}


def models(server) -> dict:
    engine = server.engine
    return {"object": "list", "data": [{
        "id": server.model_path, "object": "model", "created": int(time.time()), "owned_by": "riptide",
        "root": server.model_path, "max_model_len": engine.context_length, "weight_version": str(engine.version)}]}

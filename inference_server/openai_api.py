"""OpenAI-shaped /v1/completions and /v1/chat/completions over the same engine, for agent frameworks."""
from __future__ import annotations

import time
import uuid

from inference_server.io_struct import ChatCompletionRequest, CompletionRequest, SamplingParamsIn

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def _sampling(req, max_tokens: int) -> SamplingParamsIn:
    return SamplingParamsIn(max_new_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                            top_k=req.top_k, min_p=req.min_p, stop=req.stop, n=req.n, seed=req.seed)


def _usage(seqs) -> dict:
    prompt = sum(len(s.prompt_ids) for s in {id(s.prompt_ids): s for s in seqs}.values())
    completion = sum(len(s.output_ids) for s in seqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish(seq) -> str:
    return _FINISH[seq.finish_reason["type"]]


async def _run(server, prompt_ids: list[list[int]], sp: SamplingParamsIn):
    from inference_server.io_struct import GenerateReqInput
    req = GenerateReqInput(input_ids=prompt_ids, sampling_params=[sp] * len(prompt_ids), return_logprob=True)
    seqs, flags, _ = server.sequences(req)
    await server.run(seqs)
    return [server.output(s, len(s.output_ids), True) for s in seqs], seqs


async def completion(server, req: CompletionRequest) -> dict:
    if req.stream:
        raise ValueError("stream: streaming is served on /generate; /v1/completions answers whole")
    prompts = req.prompt if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str) \
        else [req.prompt]
    ids = [p if isinstance(p, list) else server.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    outs, seqs = await _run(server, ids, _sampling(req, req.max_tokens))
    choices = []
    for i, (o, s) in enumerate(zip(outs, seqs)):
        choice = {"index": i, "text": o["text"], "finish_reason": _finish(s), "logprobs": None}
        if req.logprobs is not None:
            choice["logprobs"] = {"tokens": [server.tokenizer.decode([t]) for t in s.output_ids],
                                  "token_logprobs": s.output_logprobs, "token_ids": s.output_ids}
        choices.append(choice)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": req.model or server.model_path, "choices": choices, "usage": _usage(seqs)}


async def chat_completion(server, req: ChatCompletionRequest) -> dict:
    if req.stream:
        raise ValueError("stream: streaming is served on /generate; /v1/chat/completions answers whole")
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    ids = server.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    max_tokens = req.max_completion_tokens or req.max_tokens or 128
    outs, seqs = await _run(server, [list(ids)], _sampling(req, max_tokens))
    choices = []
    for i, (o, s) in enumerate(zip(outs, seqs)):
        choice = {"index": i, "message": {"role": "assistant", "content": o["text"]},
                  "finish_reason": _finish(s), "logprobs": None}
        if req.logprobs:
            choice["logprobs"] = {"content": [
                {"token": server.tokenizer.decode([t]), "logprob": lp, "token_id": t}
                for t, lp in zip(s.output_ids, s.output_logprobs)]}
        choices.append(choice)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": req.model or server.model_path, "choices": choices, "usage": _usage(seqs)}

"""HTTP API in SGLang's native shape (plus OpenAI-shaped completions) over one Engine.

One event loop. Each request waits on an asyncio queue that the engine thread feeds; nothing here
blocks the loop on the model. Errors cross one boundary: validation and ValueError become 400 with
the field named, anything else a logged 500.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import re
import time
import uuid
from dataclasses import asdict
from typing import AsyncIterator, Awaitable, Callable

import orjson
import torch
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from pydantic import BaseModel, ValidationError

from inference_server.engine import Engine, PauseMode
from inference_server.io_struct import (AbortReqInput, ChatCompletionRequest, CompletionRequest, EndEpisodeReqInput,
                                        GenerateReqInput, PauseGenerationReqInput, SamplingParamsIn,
                                        UpdateWeightsFromDiskReqInput, dumps, parse_version)
from inference_server.metrics import metrics_text
from inference_server.openai_api import chat_completion, completion, models
from inference_server.sequence import Finish, SamplingParams, Sequence
from platforms.process import is_loopback

log = logging.getLogger(__name__)
class _Gate:
    """Refuses requests before they reach a route (see `gate` in create_app). Plain ASGI: Starlette's
    BaseHTTPMiddleware would pipe every response through a memory stream, on the engine's GIL."""

    def __init__(self, app, gate):
        self.app, self.gate = app, gate

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            auth = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
            refusal = self.gate(scope["path"], auth)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Reply(Response):
    """A JSON reply rendered by orjson straight from the route's dict. FastAPI would first walk a
    returned dict through jsonable_encoder (~1 ms for a completion with its logprobs, all of it
    holding the GIL the engine's step threads need between ops)."""
    media_type = "application/json"

    def render(self, content) -> bytes:
        return orjson.dumps(content)


def reply(result):
    """A route's result as a Reply, unless it is a response already (a stream)."""
    return result if isinstance(result, Response) else Reply(result)


class BadRequest(ValueError):
    """A request the server understood but cannot serve; the message names the field, and `field`
    carries it (`sampling_params.max_new_tokens`) into the 400 reply for clients to act on."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


_TYPE_NAMES = {"str", "int", "float", "bool", "none"}


def _field(loc: tuple) -> str:
    """'body.sampling_params.list[...].0.top_p' -> 'sampling_params[0].top_p' (drop pydantic's union tags)."""
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif re.fullmatch(r"[a-z_][a-z0-9_]*", p) and p not in _TYPE_NAMES:
            out += f".{p}" if out else p
    return out or "body"


_BRANCH_TYPES = {"list_type", "dict_type", "model_type", "model_attributes_type", "none_required"}


def validation_message(errors: list[dict]) -> str:
    # A union reports a mismatch per branch; the branch the client meant has the useful error.
    specific = [e for e in errors if e.get("type") not in _BRANCH_TYPES]
    errors = specific or errors
    seen, out = set(), []
    for e in errors:
        f = _field(tuple(e["loc"]))
        if f not in seen:
            seen.add(f)
            out.append(f"field '{f}': {e['msg']}")
    return "; ".join(out)


def body(model: type[BaseModel]):
    """Parse the body as JSON whatever its Content-Type (curl -d sends a form type)."""
    async def parse(request: Request) -> BaseModel:
        raw = await request.body()
        try:
            data = json.loads(raw) if raw.strip() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"malformed JSON body: {e}") from None
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise BadRequest(validation_message(e.errors()), _field(tuple(e.errors()[0]["loc"]))) from None
    return Depends(parse)


class Server:
    """Turns HTTP requests into engine sequences and engine sequences into SGLang-shaped replies."""

    def __init__(self, engine: Engine, model_path: str):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_path = model_path
        self._token_texts: dict[int, str] = {}

    def token_text(self, token: int) -> str:
        """One token's text on its own (OpenAI's per-token logprob entries), decoded once per id."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text

    # ---- requests -> sequences ------------------------------------------------------------
    def prompts(self, text, input_ids) -> tuple[list[list[int]], bool]:
        if text is None and input_ids is None:
            raise BadRequest("one of 'text' or 'input_ids' is required")
        if text is not None and input_ids is not None:
            raise BadRequest("give either 'text' or 'input_ids', not both")
        if text is not None:
            batch = isinstance(text, list)
            texts = text if batch else [text]
            ids = [self.tokenizer(t, add_special_tokens=False).input_ids for t in texts]
            field = "text"
        else:
            batch = bool(input_ids) and isinstance(input_ids[0], list)
            ids = input_ids if batch else [input_ids]
            field = "input_ids"
        if not ids:
            raise BadRequest(f"'{field}' is an empty batch")
        for i, p in enumerate(ids):
            where = f"{field}[{i}]" if batch else field
            if not p:
                raise BadRequest(f"'{where}' is empty: a prompt needs at least one token")
            if len(p) >= self.engine.context_length:
                raise BadRequest(f"'{where}' has {len(p)} tokens; the context length is "
                                 f"{self.engine.context_length}")
            bad = next((t for t in p if not 0 <= t < self.engine.vocab_size), None)
            if bad is not None:
                raise BadRequest(f"'{where}' holds token id {bad}, outside the vocabulary "
                                 f"[0, {self.engine.vocab_size})")
        return ids, batch

    def sampling(self, sp: SamplingParamsIn, field: str = "sampling_params") -> SamplingParams:
        if sp.max_new_tokens > self.engine.context_length:
            raise BadRequest(f"'{field}.max_new_tokens' is {sp.max_new_tokens}, more than the context "
                             f"length {self.engine.context_length}", f"{field}.max_new_tokens")
        bad = next((t for t in sp.stop_token_ids or [] if not 0 <= t < self.engine.vocab_size), None)
        if bad is not None:
            raise BadRequest(f"'{field}.stop_token_ids' holds {bad}, outside the vocabulary", f"{field}.stop_token_ids")
        return SamplingParams(max_new_tokens=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p,
                              top_k=sp.top_k, min_p=sp.min_p, stop=sp.stop_list,
                              stop_token_ids=list(sp.stop_token_ids or []), ignore_eos=sp.ignore_eos,
                              seed=sp.seed, top_logprobs=sp.top_logprobs)

    def sequences(self, req: GenerateReqInput) -> tuple[list[Sequence], list[bool], bool]:
        """One Sequence per prompt per sample, prompt-major, with its return_logprob flag."""
        prompts, batch = self.prompts(req.text, req.input_ids)
        sps = req.sampling_params if isinstance(req.sampling_params, list) else \
            [req.sampling_params or SamplingParamsIn()] * len(prompts)
        rids = req.rid if isinstance(req.rid, list) else \
            [req.rid] if req.rid is not None and not batch else [None] * len(prompts)
        lps = req.return_logprob if isinstance(req.return_logprob, list) else [req.return_logprob] * len(prompts)
        for name, values in (("sampling_params", sps), ("rid", rids), ("return_logprob", lps)):
            if len(values) != len(prompts):
                raise BadRequest(f"'{name}' has {len(values)} entries for {len(prompts)} prompts")
        seqs, flags = [], []
        for i, (ids, sp, rid, lp) in enumerate(zip(prompts, sps, rids, lps)):
            params = self.sampling(sp, f"sampling_params[{i}]" if batch else "sampling_params")
            rid = rid or uuid.uuid4().hex
            for j in range(sp.n):
                p = params if sp.n == 1 or params.seed is None else \
                    SamplingParams(**{**asdict(params), "seed": params.seed + j})
                seqs.append(Sequence(rid if sp.n == 1 else f"{rid}-{j}", list(ids), p,
                                     group_rid=rid if sp.n > 1 else None, stream=req.stream,
                                     keep_old_kv=req.kv_policy == "continue"))
                flags.append(lp)
        return seqs, flags, batch or len(seqs) > 1

    # ---- sequences -> replies -------------------------------------------------------------
    def output(self, seq: Sequence, n: int, return_logprob: bool, finished: bool | None = None) -> dict:
        """The reply for `seq`'s first n tokens. A stream passes `finished` as its event saw it: the
        engine thread may have finished the sequence since, and that must not show on an earlier event."""
        ids = seq.output_ids[:n]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        reason = seq.finish_reason if (seq.finished if finished is None else finished) else None
        if reason and reason["type"] == Finish.STOP and isinstance(reason.get("matched"), str):
            cut = text.find(reason["matched"])
            text = text[:cut] if cut >= 0 else text
        meta = {
            "id": seq.rid,
            "finish_reason": reason,
            "prompt_tokens": len(seq.prompt_ids),
            "completion_tokens": len(ids),
            "cached_tokens": seq.cached_tokens,            # prompt positions taken from the prefix cache or its host tier
            "weight_version": str(seq.output_versions[n - 1] if n else self.engine.version),
            "output_token_versions": seq.output_versions[:n],
            "kv_cache_weight_version": seq.prefill_version,
            "kv_versions": seq.kv_versions,                 # [start, end, version]: the weights that made each
                                                            # admitted position's keys and values
            "kv_age": (seq.output_versions[n - 1] if n else self.engine.version) - seq.prefill_version
            if seq.prefill_version is not None else 0,      # versions between the oldest KV and the last token
            "spec_verify_ct": seq.forwards,                 # forwards its tokens came from (speculative: fewer)
            "spec_draft_tokens": seq.spec_drafted,
            "spec_accepted_tokens": seq.spec_accepted,
            "e2e_latency": time.monotonic() - seq.arrival,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(seq.output_logprobs[:n], ids)]
        return {"text": text, "output_ids": ids, "meta_info": meta}

    def attach(self, seqs: list[Sequence]) -> asyncio.Queue:
        """The engine reports (index, tokens so far) into this queue from its own thread."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        for i, s in enumerate(seqs):
            s.on_update = lambda seq, i=i: loop.call_soon_threadsafe(
                events.put_nowait, (i, len(seq.output_ids), seq.finished))
        return events

    async def updates(self, seqs: list[Sequence],
                      disconnected: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator[tuple[int, int, bool]]:
        """(index, tokens so far, finished) as the engine reports them, until every sequence has
        finished. Leaving early aborts what is left: the caller cancelled or stopped reading, or
        `disconnected()` turned true (a client that gave up on a frozen server and moved on)."""
        events = self.attach(seqs)
        await asyncio.wrap_future(self.engine.add(seqs))
        pending = len(seqs)
        watch = asyncio.ensure_future(self._abort_on_disconnect(seqs, disconnected)) if disconnected else None
        try:
            while pending:
                i, n, finished = await events.get()
                pending -= finished
                yield i, n, finished
        finally:
            if watch is not None:
                watch.cancel()
            if pending:
                self.engine.abort([s.rid for s in seqs])

    async def run(self, seqs: list[Sequence], disconnected: Callable[[], Awaitable[bool]] | None = None) -> None:
        """Wait for every sequence to finish (see `updates`)."""
        async for _ in self.updates(seqs, disconnected):
            pass

    async def _abort_on_disconnect(self, seqs: list[Sequence], disconnected) -> None:
        while not await disconnected():
            await asyncio.sleep(1.0)
        self.engine.abort([s.rid for s in seqs])

    async def stream(self, seqs: list[Sequence], flags: list[bool], batch: bool) -> AsyncIterator[str]:
        async for i, n, finished in self.updates(seqs):
            out = self.output(seqs[i], n, flags[i], finished)
            if batch:
                out["index"] = i
            yield f"data: {dumps(out)}\n\n"
        yield "data: [DONE]\n\n"

    async def generate(self, req: GenerateReqInput, disconnected=None):
        seqs, flags, batch = self.sequences(req)
        if req.stream:
            return StreamingResponse(self.stream(seqs, flags, batch), media_type="text/event-stream")
        await self.run(seqs, disconnected)
        outs = [self.output(s, len(s.output_ids), f) for s, f in zip(seqs, flags)]
        return outs if batch else outs[0]


def create_app(engine: Engine, model_path: str, host: str = "127.0.0.1", api_key: str | None = None) -> FastAPI:
    """SGLang's native API and OpenAI's over `engine`. More routes mount on it (weight sync does):
    they extend `app.state.cold_prefixes` (reachable before a cold server has weights) and the
    `on_startup` / `on_shutdown` hooks. With `api_key` every path but /health needs it as a bearer
    token; off loopback a server without one refuses every path but /health."""
    server = Server(engine, model_path)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        if engine.device.type == "cpu":      # to_thread's threads (a load from disk): no OpenMP team of their
            asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(   # own
                4, thread_name_prefix="riptide-io", initializer=torch.set_num_threads, initargs=(1,)))
        engine.start()
        for hook in app.state.on_startup:
            hook()
        yield
        for hook in app.state.on_shutdown:
            hook()
        engine.shutdown()

    app = FastAPI(title="Riptide inference server", lifespan=lifespan)
    app.state.server = server
    app.state.cold_prefixes = ["/get_", "/metrics", "/v1/models", "/progress"]
    app.state.on_startup, app.state.on_shutdown = [], []
    app.add_middleware(_Gate, gate=_gate(app, engine, host, api_key))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        return JSONResponse({"error": validation_message(exc.errors())}, status_code=400)

    @app.exception_handler(ValueError)
    async def _bad(request: Request, exc: ValueError):
        field = getattr(exc, "field", None)
        if request.url.path.startswith("/v1/"):          # OpenAI's error shape, which its clients show
            return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error", "param": field,
                                           "code": None}}, status_code=400)
        return JSONResponse({"error": str(exc), **({"field": field} if field else {})}, status_code=400)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        log.exception("%s failed", request.url.path)
        return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=500)

    _generation_routes(app, server)
    _control_routes(app, engine)
    _info_routes(app, server, host)
    return app


def _gate(app: FastAPI, engine: Engine, host: str, api_key: str | None):
    # Off loopback a server without a token would serve anyone on the network: everything but
    # /health is refused then (the launcher refuses to start that way; this covers other callers).
    open_off_loopback = api_key is None and not is_loopback(host)
    if open_off_loopback:
        log.warning("listening on %s without an API key: every endpoint but /health is refused", host)

    def gate(path: str, authorization: str | None) -> JSONResponse | None:
        """The refusal for a request, if any: bearer token (not for /health), cold start."""
        if path != "/health" and open_off_loopback:
            return JSONResponse({"error": f"{path}: this server listens on {host} without an API key; start it "
                                          f"with RIPTIDE_API_KEY (or --api-key) to serve off loopback"},
                                status_code=403)
        if path != "/health" and api_key is not None and authorization != f"Bearer {api_key}":
            return JSONResponse({"error": "missing or wrong bearer token (Authorization: Bearer <api-key>)"},
                                status_code=401)
        if not engine.has_weights and not path.startswith(tuple(app.state.cold_prefixes)):
            return JSONResponse({"error": "no weights yet: waiting for a push (cold start)"}, status_code=503)
        return None
    return gate


def _generation_routes(app: FastAPI, server: Server) -> None:
    @app.post("/generate")
    async def generate(request: Request, req: GenerateReqInput = body(GenerateReqInput)):
        return reply(await server.generate(req, request.is_disconnected))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest = body(CompletionRequest)):
        return reply(await completion(server, req))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest = body(ChatCompletionRequest)):
        return reply(await chat_completion(server, req))

    @app.get("/v1/models")
    async def list_models():
        return models(server)


def _control_routes(app: FastAPI, engine: Engine) -> None:
    @app.post("/abort_request")
    async def abort_request(req: AbortReqInput = body(AbortReqInput)):
        if not req.abort_all and not req.rid:
            raise BadRequest("give 'rid' or 'abort_all': true")
        seqs = await asyncio.wrap_future(engine.abort(None if req.abort_all else req.rid))
        return {"success": True, "aborted": [s.rid for s in seqs]}

    @app.post("/pause_generation")
    async def pause_generation(req: PauseGenerationReqInput = body(PauseGenerationReqInput)):
        await asyncio.wrap_future(engine.pause(PauseMode(req.mode)))
        return {"success": True, "mode": req.mode}

    @app.post("/continue_generation")
    async def continue_generation():
        await asyncio.wrap_future(engine.resume())
        return {"success": True}

    @app.post("/flush_cache")
    async def flush_cache():
        n = await asyncio.wrap_future(engine.flush_cache())
        return {"success": True, "message": f"{n} cached KV blocks forgotten", "blocks": n}

    @app.post("/end_episode")
    async def end_episode(req: EndEpisodeReqInput = body(EndEpisodeReqInput)):
        """Riptide's: a multi-turn episode is over, its cached blocks go first (blocks.BlockAllocator.end)."""
        n = await asyncio.wrap_future(engine.end_episode(req.input_ids, req.shared_tokens))
        return {"success": True, "blocks": n}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(req: UpdateWeightsFromDiskReqInput = body(UpdateWeightsFromDiskReqInput)):
        version = parse_version(req.weight_version)
        version = engine.version + 1 if version is None else version
        try:
            tensors = await asyncio.to_thread(engine.load_from_disk, req.model_path)
        except FileNotFoundError as e:
            raise BadRequest(f"model_path: {e}") from None
        if req.abort_all_requests:
            await asyncio.wrap_future(engine.abort(None))
        stall = await asyncio.wrap_future(engine.swap_weights(tensors, version))
        await asyncio.to_thread(engine.free_retired)
        return {"success": True, "message": f"loaded {req.model_path}", "weight_version": str(version),
                "stall_seconds": stall}


def _info_routes(app: FastAPI, server: Server, host: str) -> None:
    engine, model_path = server.engine, server.model_path

    @app.get("/health")
    async def health():
        alive = engine.running
        torn = engine.weights_torn
        ok = alive and not torn
        status = "ok" if ok else "engine stopped" if not alive else "weights torn by a failed in-place update"
        return JSONResponse({"status": status}, status_code=200 if ok else 503)

    @app.get("/health_generate")
    async def health_generate():
        """OK once the engine makes progress: a step if it is busy (the probe need not wait for a
        slot), else the probe's own token. A hung engine never answers; callers time out."""
        steps = engine.stats.steps
        seq = Sequence(f"health-{uuid.uuid4().hex}", [0], SamplingParams(max_new_tokens=1, temperature=0))
        probe = asyncio.ensure_future(server.run([seq]))
        try:
            while not probe.done() and engine.stats.steps == steps:
                await asyncio.wait({probe}, timeout=0.05)
        finally:
            probe.cancel()
        return {"status": "ok"}

    @app.get("/progress")
    async def progress():
        """What the engine has done so far, for liveness: a slow server's steps, or the CPU time of
        every thread but this event loop's (the engine's step under way), move between two probes;
        a hung one's do not, however many probes it answers; a frozen one does not answer."""
        running, waiting = engine.counts()
        return {"steps": engine.stats.steps, "generation_tokens": engine.stats.generation_tokens,
                "cpu_s": time.process_time() - time.thread_time(), "num_running": running, "num_waiting": waiting}

    @app.get("/get_model_info")
    async def get_model_info():
        return {"model_path": model_path, "tokenizer_path": model_path, "is_generation": True,
                "weight_version": str(engine.version), "vocab_size": engine.vocab_size,
                "context_length": engine.context_length}

    @app.get("/get_server_info")
    async def get_server_info():
        running, waiting = engine.counts()
        return {**asdict(engine.args), "host": host, "context_length": engine.context_length,
                "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
                "runner": type(engine.runner).__name__, "weight_version": str(engine.version),
                "paused": engine.scheduler.paused, "num_running": running, "num_waiting": waiting,
                "stats": asdict(engine.stats), "kv_tier": engine.tier_stats(),
                "cached_prompt_tokens": engine.scheduler.cached_tokens, "preemptions": engine.scheduler.preemptions,
                "cpu_steps_by_way": dict(getattr(getattr(engine.runner, "ways", None), "taken", {}))}

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": str(engine.version)}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(metrics_text(engine), media_type="text/plain; version=0.0.4")

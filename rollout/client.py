"""An async client for one inference server, speaking only SGLang's native API (plus Riptide's
optional `output_token_versions`), so it drives a real SGLang server unchanged; `VllmClient` speaks
vLLM's token-in/token-out API to a stock vLLM server (`client_for` picks by `server.engine`).

Every call has a timeout. Only errors where the request never reached the server (connection
refused, DNS) are retried here, on the same server; a 4xx is raised as RequestRefused (the request
itself is wrong), anything else as ServerError for the router to move the request elsewhere.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

from rollout.types import Finish


class ServerError(RuntimeError):
    """A request that did not get an answer (or got a 5xx): it may succeed on another server."""

    def __init__(self, server: str, message: str):
        super().__init__(f"server {server}: {message}")
        self.server = server


class RequestRefused(ServerError):
    """The server answered 4xx: this request, as sent, fails on any server. `field` names the
    request field it refused when the server says so (Riptide's servers do)."""

    def __init__(self, server: str, message: str, field: str | None = None):
        super().__init__(server, message)
        self.field = field

    @property
    def refuses_sampling_params(self) -> bool:
        """The sampling parameters themselves (the rollout config) are refused, not this prompt."""
        return self.field is not None and self.field.startswith("sampling_params")


@dataclass
class Generation:
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish: Finish
    text: str
    segment: list | None = None      # [server url, wall-clock start, end]: where and when it was generated
    forwards: int = 0                # forward passes the tokens came from (speculative decoding: fewer than tokens)
    drafted: int = 0                 # speculative decoding: tokens drafted, and accepted
    accepted: int = 0
    cached: int = 0                  # prompt positions the server took from its KV caches (prefix cache, tiers)
    old_kv: int = 0                  # ... of those, positions whose KV older weights made (kv_policy continue)


def old_kv_positions(meta: dict) -> int:
    """Positions of an answer's context whose keys and values weights older than its last token's made
    (Riptide's meta_info kv_versions: [start, end, version] runs; 0 where a server gives none)."""
    runs = meta.get("kv_versions") or []
    try:
        newest = max(int(v) for _, _, v in runs) if runs else 0
        return sum(int(e) - int(s) for s, e, v in runs if int(v) < newest)
    except (TypeError, ValueError):
        return 0


class ServerClient:
    """aiohttp, not httpx: with 64 requests in flight, httpcore's pool spent ~70% of the rollout
    process's CPU matching requests to connections (py-spy, bench/e2e.py); aiohttp's does not."""

    def __init__(self, url: str, timeout_s: float = 600.0, api_key: str | None = None, connect_retries: int = 2,
                 max_connections: int = 128):
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s, self.max_connections = timeout_s, max_connections
        self.connect_retries = connect_retries
        self._session: aiohttp.ClientSession | None = None     # made on first use, on the running loop
        self._no_progress_route, self._probes = False, 0

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            # keep-alive shorter than the server's (75 s), so it never closes a connection under us
            self._session = aiohttp.ClientSession(
                self.url, headers=self._headers, timeout=aiohttp.ClientTimeout(total=self.timeout_s, connect=5.0),
                connector=aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=30.0))
        return self._session

    async def _request(self, method: str, path: str, body: dict | None = None, timeout: float | None = None):
        """(status, JSON body or text) of one call; ServerError when it got no answer."""
        kw = {"timeout": aiohttp.ClientTimeout(total=timeout, connect=min(5.0, timeout))} if timeout else {}
        for attempt in range(self.connect_retries + 1):
            try:
                async with self._http().request(method, path, json=body, **kw) as r:
                    if r.content_type == "application/json":
                        return r.status, await r.json()
                    return r.status, await r.text()
            except aiohttp.ClientConnectorError as e:      # never reached the server: safe to try again
                if attempt == self.connect_retries:
                    raise ServerError(self.url, f"{path}: cannot connect ({e})") from None
                await asyncio.sleep(0.2 * 2 ** attempt)
            except asyncio.TimeoutError:
                raise ServerError(self.url, f"{path}: timed out after {timeout or self.timeout_s}s") from None
            except aiohttp.ClientError as e:
                raise ServerError(self.url, f"{path}: {type(e).__name__}: {e}") from None

    async def _post(self, path: str, body: dict, timeout: float | None = None) -> dict:
        status, out = await self._request("POST", path, body, timeout)
        if status >= 500:
            raise ServerError(self.url, f"{path} answered {status}: {str(out)[:300]}")
        if status >= 400:
            field = out.get("field") if isinstance(out, dict) else None
            raise RequestRefused(self.url, f"{path} refused the request ({status}): {str(out)[:300]}", field)
        return out

    async def generate(self, input_ids: list[int], sampling_params: dict, rid: str,
                       fallback_version: int = -1, kv_policy: str = "fresh") -> Generation:
        body = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": True, "rid": rid}
        if kv_policy != "fresh":                 # Riptide's field: a plain SGLang server gets none it lacks
            body["kv_policy"] = kv_policy
        out = await self._post("/generate", body)
        meta = out["meta_info"]
        ids = out["output_ids"]
        lps = [lp for lp, _, _ in meta.get("output_token_logprobs", [])]
        versions = meta.get("output_token_versions")
        if versions is None:                     # a plain SGLang server: one version per request
            try:
                versions = [int(meta.get("weight_version"))] * len(ids)
            except (TypeError, ValueError):
                versions = [fallback_version] * len(ids)
        return Generation(ids, lps, versions, Finish(meta["finish_reason"]["type"]), out.get("text", ""),
                          forwards=int(meta.get("spec_verify_ct") or len(ids)),
                          drafted=int(meta.get("spec_draft_tokens") or 0), accepted=int(meta.get("spec_accepted_tokens") or 0),
                          cached=int(meta.get("cached_tokens") or 0), old_kv=old_kv_positions(meta))

    async def end_episode(self, input_ids: list[int], shared_tokens: int) -> None:
        """A multi-turn episode is over: its cached KV blocks may go first (Riptide's /end_episode). A
        hint: a server without the endpoint, or one that fails, changes nothing."""
        try:
            await self._post("/end_episode", {"input_ids": input_ids, "shared_tokens": shared_tokens}, timeout=10)
        except Exception:  # noqa: BLE001 - a hint: nothing of the episode depends on it
            pass

    async def abort(self, rids: list[str]) -> None:
        """Abort requests by rid: one call on a Riptide server; one call per rid on a plain SGLang one."""
        if not rids:
            return
        try:
            await self._post("/abort_request", {"rid": rids if len(rids) > 1 else rids[0]}, timeout=10)
        except RequestRefused:
            if len(rids) == 1:
                raise
            await asyncio.gather(*(self._post("/abort_request", {"rid": r}, timeout=10) for r in rids))

    async def get(self, path: str, timeout: float = 10) -> dict:
        status, out = await self._request("GET", path, timeout=timeout)
        if status != 200:
            raise ServerError(self.url, f"{path} answered {status}")
        return out

    async def healthy(self) -> bool:
        try:
            await self.get("/health", timeout=5)
            return True
        except ServerError:
            return False

    async def progress(self, timeout_s: float) -> tuple[float, float] | None:
        """(steps, CPU seconds) the server has done so far, or None when it does not answer within
        `timeout_s` (frozen, unreachable). A plain SGLang server has no /progress: its
        /health_generate answers once it has stepped, and counts as one step each time."""
        if not self._no_progress_route:
            try:
                status, out = await self._request("GET", "/progress", timeout=timeout_s)
            except ServerError:
                return None
            if status == 200:
                return float(out["steps"]), float(out["cpu_s"])
            if status != 404:
                return None
            self._no_progress_route = True
        if not await self.steps_again(timeout_s):
            return None
        self._probes += 1
        return float(self._probes), 0.0

    async def steps_again(self, timeout_s: float) -> bool:
        """Does the server step? SGLang's /health_generate answers once it has stepped (or
        generated a token for the probe, so an idle server proves itself too)."""
        try:
            await self.get("/health_generate", timeout=timeout_s)
            return True
        except ServerError:
            return False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


ENGINES = ("riptide", "vllm")


class VllmClient(ServerClient):
    """A stock vLLM server started with Riptide's middleware and `--enable-scale-out`
    (inference_server/vllm_plugin.py): token ids in, per-token logprobs out, through
    `/inference/v1/generate`; each token's version from vLLM's `weight_versions` spans (exact: vLLM
    labels each step's tokens with the version it ran on); aborts through `/abort_requests`, which
    end a request with its partial tokens (finish "abort"), as Riptide's server does. Health and
    progress are the middleware's (`/health_generate`), weight versions `/get_weight_version`."""

    PARAMS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
              "stop": "stop", "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "seed": "seed",
              "min_p": "min_p", "min_new_tokens": "min_tokens", "repetition_penalty": "repetition_penalty",
              "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty"}

    @classmethod
    def sampling(cls, params: dict) -> dict:
        """SGLang's sampling parameters (the rollout config's) as vLLM's; a key vLLM lacks is named."""
        unknown = sorted(set(params) - set(cls.PARAMS))
        if unknown:
            raise ValueError(f"sampling parameters {unknown} have no vLLM equivalent (known: {sorted(cls.PARAMS)})")
        out = {cls.PARAMS[k]: v for k, v in params.items() if v is not None}
        if out.get("top_k", 0) < 0:             # SGLang's -1 (all tokens) is vLLM's 0
            out["top_k"] = 0
        return {**out, "logprobs": 0, "detokenize": bool(out.get("stop"))}

    def _rid(self, rid: str) -> str:
        return f"generate-tokens-{rid}"          # vLLM's name for a request sent to /inference/v1/generate

    async def generate(self, input_ids: list[int], sampling_params: dict, rid: str,
                       fallback_version: int = -1, kv_policy: str = "fresh") -> Generation:
        try:
            params = self.sampling(sampling_params)
        except ValueError as e:
            raise RequestRefused(self.url, str(e), "sampling_params") from None
        out = await self._post("/inference/v1/generate", {"request_id": rid, "token_ids": input_ids,
                                                          "sampling_params": params, "output_mode": "tokens"})
        choice = out["choices"][0]
        ids = list(choice.get("token_ids") or [])
        lps = [c["logprob"] for c in ((choice.get("logprobs") or {}).get("content") or [])]
        versions = [fallback_version] * len(ids)
        for span in choice.get("weight_versions") or []:
            try:
                v = int(span["version"])
            except (TypeError, ValueError):
                continue
            versions[span["start"]:span["end"]] = [v] * (span["end"] - span["start"])
        reason = choice.get("finish_reason") or "stop"
        finish = Finish(reason) if reason in {f.value for f in Finish} else Finish.STOP
        return Generation(ids, lps, versions, finish, "")

    async def end_episode(self, input_ids: list[int], shared_tokens: int) -> None:
        pass                                      # vLLM's prefix cache has no such hint

    async def abort(self, rids: list[str]) -> None:
        if rids:
            await self._post("/abort_requests", {"request_ids": [self._rid(r) for r in rids]}, timeout=10)

    def __init__(self, url: str, **kw):
        super().__init__(url, **kw)
        self._no_progress_route = True            # vLLM counts no steps we can read: probe the engine


def client_for(engine: str, url: str, **kw) -> ServerClient:
    """The client of a server run by `engine` (server.engine: riptide, or vllm)."""
    if engine not in ENGINES:
        raise ValueError(f"server.engine={engine!r}: use one of {ENGINES}")
    return (VllmClient if engine == "vllm" else ServerClient)(url, **kw)

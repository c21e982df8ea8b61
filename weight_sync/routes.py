"""The /weight_sync/* endpoints a server mounts on its app, and its cold start from a live peer.

`mount(app, receiver, ...)` adds them to any FastAPI app that runs `app.state.on_startup` /
`app.state.on_shutdown` hooks and gates every path by its bearer token (the inference server's does);
the launcher wires the two packages together, so neither imports the other.
"""
from __future__ import annotations

import asyncio
import logging

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from weight_sync import live_digest
from weight_sync.protocol import (ApplyRequest, CommitRequest, OpenRequest, PrepareRequest,
                                  PushToRequest, UpdateRef)
from weight_sync.receiver import Receiver, ReceiverError

log = logging.getLogger(__name__)
PREFIX = "/weight_sync/"


def mount(app: FastAPI, receiver: Receiver, api_key: str | None = None, weights_from_peer: str | None = None,
          self_url: str | None = None) -> None:
    """`weights_from_peer`: this server starts without weights and asks that live peer to push
    them to `self_url`; it serves only once they landed (the app answers 503 until then)."""
    app.state.cold_prefixes.append(PREFIX)          # reachable before the weights are in
    app.state.on_shutdown.append(receiver.close)
    if weights_from_peer:
        pulling: list[asyncio.Task] = []
        app.state.on_startup.append(lambda: pulling.append(
            asyncio.create_task(_pull_from_peer(weights_from_peer, self_url, api_key))))
        app.state.on_shutdown.append(lambda: [t.cancel() for t in pulling])

    @app.exception_handler(ReceiverError)
    async def _refused(_, exc: ReceiverError):
        return JSONResponse({"error": str(exc), "kind": exc.kind.value, "detail": exc.detail}, status_code=409)

    _protocol_routes(app, receiver)
    _serving_routes(app, receiver, api_key)


def _protocol_routes(app: FastAPI, receiver: Receiver) -> None:
    """One update, as the sender drives it (see protocol.py)."""
    @app.post(PREFIX + "open")
    async def ws_open(req: OpenRequest):
        return (await asyncio.to_thread(receiver.open, req)).model_dump()

    @app.post(PREFIX + "apply")
    async def ws_apply(req: ApplyRequest):
        return (await asyncio.to_thread(receiver.apply, req)).model_dump()

    @app.post(PREFIX + "prepare")
    async def ws_prepare(req: PrepareRequest):
        await asyncio.to_thread(receiver.prepare, req)
        return {"success": True}

    @app.post(PREFIX + "commit")
    async def ws_commit(req: CommitRequest):
        return (await asyncio.to_thread(receiver.commit, req)).model_dump()

    @app.post(PREFIX + "abort")
    async def ws_abort(req: UpdateRef):
        await asyncio.to_thread(receiver.abort, req)
        return {"success": True}

    @app.get(PREFIX + "status")
    async def ws_status():
        return receiver.status()


def _serving_routes(app: FastAPI, receiver: Receiver, api_key: str | None) -> None:
    """What the live weights are, and pushing them to a peer."""
    engine = receiver.engine

    @app.get(PREFIX + "digest")
    async def ws_digest():
        """blake2b of the live weights: equal digests mean the same weights are being served."""
        return {"digest": await asyncio.to_thread(lambda: live_digest(receiver.served_weights())),
                "weight_version": engine.version}

    @app.post(PREFIX + "push_to")
    async def ws_push_to(req: PushToRequest):
        """Push the weights being served to another server (its cold start): no disk involved."""
        from weight_sync.sender import WeightSync
        if not engine.has_weights:
            raise ValueError("this server has no weights yet to push")

        def push():
            # zero_copy off: the receiver's transport registers only staging slots, never the live weights
            sync = WeightSync([req.receiver_url], transport=receiver.transport, bucket_bytes=req.bucket_bytes,
                              timeout_s=req.timeout_s, api_key=api_key, zero_copy=False)
            try:
                return sync.push(receiver.served_weights(), engine.version)
            finally:
                sync.close(close_transport=False)
        stats = await asyncio.to_thread(push)
        return {"success": True, "version": stats.version, "bytes": stats.bytes, "seconds": stats.seconds}


async def _pull_from_peer(peer: str, self_url: str, api_key: str | None) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=600, headers=headers) as client:
        for attempt in range(30):      # our own endpoints may not be up for the first moments
            try:
                r = await client.post(f"{peer.rstrip('/')}{PREFIX}push_to", json={"receiver_url": self_url})
            except httpx.HTTPError as e:
                log.warning("cold start: %s not reachable (%s); retrying", peer, e)
                await asyncio.sleep(1)
                continue
            if r.status_code == 200:
                log.info("cold start: weights pulled from %s: %s", peer, r.json())
                return
            log.error("cold start from %s failed: %s", peer, r.text)
            await asyncio.sleep(1)
        log.error("cold start from %s gave up: this server keeps answering 503", peer)

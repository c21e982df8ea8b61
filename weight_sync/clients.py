"""How a sender reaches a receiver: over HTTP (a server process) or by direct call (colocated)."""
from __future__ import annotations

import httpx

from weight_sync.protocol import (ApplyReply, ApplyRequest, CommitReply, CommitRequest, ErrorKind, OpenReply,
                                  OpenRequest, PrepareRequest, UpdateRef)


class ReceiverCallError(RuntimeError):
    """A receiver refused or did not answer; `kind` is the protocol's ErrorKind when it refused."""

    def __init__(self, name: str, message: str, kind: ErrorKind | None = None, detail: dict | None = None):
        super().__init__(f"receiver {name}: {message}")
        self.receiver, self.kind, self.detail = name, kind, detail or {}


class HttpReceiverClient:
    def __init__(self, url: str, timeout_s: float = 30.0, api_key: str | None = None):
        self.url = self.name = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, headers=headers)

    def _call(self, method: str, path: str, msg=None, timeout_s: float | None = None) -> dict:
        timeout = self._http.timeout if timeout_s is None else httpx.Timeout(timeout_s)
        try:
            r = self._http.request(method, f"/weight_sync/{path}",
                                   json=msg.model_dump(mode="json") if msg is not None else None, timeout=timeout)
        except httpx.TimeoutException:
            raise ReceiverCallError(self.name, f"/{path} timed out after {timeout.read}s "
                                               f"(frozen or overloaded?)") from None
        except httpx.HTTPError as e:
            raise ReceiverCallError(self.name, f"/{path} failed: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
            kind = body.get("kind")
            raise ReceiverCallError(self.name, f"/{path} answered {r.status_code}: {body.get('error', r.text)}",
                                    ErrorKind(kind) if kind else None, body.get("detail"))
        return r.json()

    def open(self, req: OpenRequest) -> OpenReply:
        return OpenReply.model_validate(self._call("POST", "open", req))

    def apply(self, req: ApplyRequest) -> ApplyReply:
        # a relaying receiver also waits on its own writes onward (each bounded by forward_timeout_s)
        extra = req.forward_timeout_s * len(req.forward)
        return ApplyReply.model_validate(self._call("POST", "apply", req, self._http.timeout.read + extra))

    def prepare(self, req: PrepareRequest) -> None:
        self._call("POST", "prepare", req)

    def commit(self, req: CommitRequest) -> CommitReply:
        return CommitReply.model_validate(self._call("POST", "commit", req))

    def abort(self, ref: UpdateRef) -> None:
        self._call("POST", "abort", ref)

    def status(self) -> dict:
        return self._call("GET", "status")

    def close(self) -> None:
        self._http.close()


def receiver_status(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> dict:
    """One call to a server's /weight_sync/status (a receiver asking its peers how an update ended)."""
    client = HttpReceiverClient(url, timeout_s, api_key)
    try:
        return client.status()
    finally:
        client.close()


class LocalReceiverClient:
    """A receiver in this process (colocated server): the same calls, no HTTP."""

    def __init__(self, receiver, name: str = "local"):
        self.receiver, self.name = receiver, name

    def _call(self, fn, *args):
        from weight_sync.receiver import ReceiverError
        try:
            return fn(*args)
        except ReceiverError as e:
            raise ReceiverCallError(self.name, str(e), e.kind, e.detail) from None

    def open(self, req: OpenRequest) -> OpenReply:
        return self._call(self.receiver.open, req)

    def apply(self, req: ApplyRequest) -> ApplyReply:
        return self._call(self.receiver.apply, req)

    def prepare(self, req: PrepareRequest) -> None:
        self._call(self.receiver.prepare, req)

    def commit(self, req: CommitRequest) -> CommitReply:
        return self._call(self.receiver.commit, req)

    def abort(self, ref: UpdateRef) -> None:
        self._call(self.receiver.abort, ref)

    def status(self) -> dict:
        return self.receiver.status()

    def close(self) -> None:
        pass

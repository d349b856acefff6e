"""The Files and Batches API (`/v1/files*`, `/v1/batches*`), passed through to the control plane.

The gateway never reads Postgres, so the control plane's views serve these at the same paths and
check the key themselves; the gateway checks it first too (a bad key never reaches them), then
forwards the request: the body streamed both ways (uploads up to `--max-file-bytes`, downloads of
any size, never whole in memory), a short list of headers, its client's address appended to
`X-Forwarded-For`. They are not inference: no usage event, no rate limit, one counter by route
and status. A control plane that is down or slow costs interactive requests nothing; these get a
503 (504 when it timed out) that says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import httpx

logger = logging.getLogger(__name__)

ROUTES = ("files", "batches")
# The only request headers passed on (X-Request-Id and X-Forwarded-For are set here).
REQUEST_HEADERS = (b"authorization", b"content-type", b"content-length", b"accept")
RESPONSE_HEADERS = ("content-type", "content-length", "content-disposition", "retry-after", "content-encoding")
# The limit is on the file (like OpenAI's 200 MB batch input); a multipart body adds its
# boundaries and the `purpose` field, which this covers. The control plane checks the file itself.
MULTIPART_ALLOWANCE = 64 * 1024
CLIENT_CLOSED_REQUEST = 499
INTERACTIVE = "interactive requests (/v1/chat/completions, /v1/completions, /v1/embeddings) are unaffected"


def route_of(path: str) -> str | None:
    """`files` or `batches` for a path this forwards, else None. A `.` or `..` segment is never
    forwarded: the HTTP client would resolve it into another control-plane path."""
    for route in ROUTES:
        prefix = f"/v1/{route}"
        if path == prefix or path.startswith(prefix + "/"):
            return None if any(part in (".", "..") for part in path.split("/")) else route
    return None


class TooLarge(Exception):
    pass


class ClientGone(Exception):
    pass


class ControlPlane:
    """One HTTP client to the control plane per gateway; `forward` serves one request."""

    def __init__(self, url: str, max_file_bytes: int, connect_timeout_s: float, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.max_file_bytes = max_file_bytes
        self.max_body_bytes = max_file_bytes + MULTIPART_ALLOWANCE
        # Read and write timeouts bound each silence, not the transfer: a 200 MB upload may take
        # minutes, but never `timeout_s` without a byte moving.
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self.client: httpx.AsyncClient | None = None

    def start(self) -> None:
        # trust_env off: a proxy meant for the internet (HTTP_PROXY) has no business on this hop.
        self.client = httpx.AsyncClient(timeout=self.timeout, follow_redirects=False, trust_env=False,
                                        limits=httpx.Limits(max_connections=256, max_keepalive_connections=32))
        self.client.headers.clear()  # httpx's own defaults (user-agent, accept-encoding...) stay home

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def forward(self, scope: dict, receive: Any, send: Any, request_id: str) -> int:
        """Forwards one request whose key the gateway accepted; returns the status answered
        (499 when the client went away)."""
        exchange = Exchange(self, scope, receive, send, request_id)
        return await exchange.run()


class Exchange:
    """One forwarded request: the client's body streamed up, the answer streamed down."""

    def __init__(self, control_plane: ControlPlane, scope: dict, receive: Any, send: Any, request_id: str) -> None:
        self.control_plane = control_plane
        self.scope = scope
        self.receive = receive
        self.send = send
        self.request_id = request_id
        self.status = 500
        self.headers_sent = False
        self.response_done = False
        self.client_gone = False
        self.task: asyncio.Task[Any] | None = None
        self.watcher: asyncio.Task[None] | None = None

    async def run(self) -> int:
        self.task = asyncio.current_task()
        try:
            await self._forward()
        except TooLarge:
            await self._error(413, f"Request body larger than the file limit of {self.control_plane.max_file_bytes} "
                              f"bytes allows.", "BadRequestError", "file_too_large")
        except (ClientGone, asyncio.CancelledError) as exc:
            if isinstance(exc, asyncio.CancelledError):
                if not self.client_gone:
                    raise  # the server is shutting down
                self.task.uncancel()
            self.client_gone = True
            if not self.headers_sent:
                self.status = CLIENT_CLOSED_REQUEST
        except httpx.TransportError as exc:
            if self.headers_sent:
                # Too late for an error answer: cut the connection so the client cannot take a
                # truncated download for a whole one.
                raise ConnectionError(f"the control plane broke the answer: {exc!r}") from exc
            await self._unreachable(exc)
        except Exception:
            if self.headers_sent:
                raise
            logger.exception("forwarding %s %s failed", self.scope["method"], self.scope["path"])
            await self._error(500, "Internal gateway error.", "InternalServerError", "internal")
        finally:
            if self.watcher is not None:
                self.watcher.cancel()
        return self.status

    async def _forward(self) -> None:
        scope = self.scope
        declared = self._header(b"content-length")
        if declared is not None and declared.isdigit() and (
                len(declared) > 15 or int(declared) > self.control_plane.max_body_bytes):
            raise TooLarge()  # refused before a byte of it is read
        has_body = declared is not None or self._header(b"transfer-encoding") is not None
        if not has_body:
            self._watch()
        path = scope.get("raw_path") or scope["path"].encode()
        url = self.control_plane.url + path.decode("latin-1")
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        client = self.control_plane.client
        request = client.build_request(scope["method"], url, headers=self._request_headers(),
                                       content=self._body() if has_body else None)
        response = await client.send(request, stream=True)
        try:
            headers = [(name.encode(), response.headers[name].encode("latin-1"))
                       for name in RESPONSE_HEADERS if name in response.headers]
            upstream_id = response.headers.get("x-request-id")
            headers.append((b"x-request-id", (upstream_id or self.request_id).encode("latin-1")))
            self.status = response.status_code
            self.headers_sent = True
            await self.send({"type": "http.response.start", "status": response.status_code, "headers": headers})
            async for chunk in response.aiter_raw():
                await self.send({"type": "http.response.body", "body": chunk, "more_body": True})
            self.response_done = True
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()

    def _request_headers(self) -> list[tuple[bytes, bytes]]:
        headers = [(name, value) for name, value in self.scope["headers"] if name in REQUEST_HEADERS]
        headers.append((b"x-request-id", self.request_id.encode()))
        forwarded = [value.strip() for name, value in self.scope["headers"] if name == b"x-forwarded-for"]
        client = self.scope.get("client")
        if client:
            forwarded.append(client[0].encode())
        if forwarded:
            headers.append((b"x-forwarded-for", b", ".join(forwarded)))
        return headers

    async def _body(self) -> Any:
        """The client's body as it arrives, refused past the limit whether or not it was declared."""
        size = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.control_plane.max_body_bytes:
                raise TooLarge()
            if chunk:
                yield chunk
            if not message.get("more_body"):
                self._watch()
                return

    def _watch(self) -> None:
        """Once the body is in, watch for the client leaving: that cancels the forwarding, which
        closes the upstream connection (a large download stops there too)."""
        self.watcher = asyncio.create_task(self._watch_disconnect())

    async def _watch_disconnect(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        # After the last byte went out the server reports a disconnect too; that one is normal.
        if not self.response_done:
            self.client_gone = True
            self.task.cancel()

    def _header(self, name: bytes) -> bytes | None:
        for key, value in self.scope["headers"]:
            if key == name:
                return value
        return None

    async def _unreachable(self, exc: httpx.TransportError) -> None:
        url = self.control_plane.url
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            status, code, what = 503, "control_plane_unreachable", f"The control plane ({url}) is unreachable"
        elif isinstance(exc, httpx.TimeoutException):
            status, code, what = 504, "control_plane_timeout", f"The control plane ({url}) did not answer in time"
        else:
            status, code, what = 502, "control_plane_error", f"The control plane ({url}) broke the connection"
        logger.warning("%s %s: %s: %r", self.scope["method"], self.scope["path"], what, exc)
        await self._error(status, f"{what}: files and batches are unavailable for now; {INTERACTIVE}. "
                          "Retry shortly.", "ServiceUnavailableError", code, retry_after_s=5)

    async def _error(self, status: int, message: str, error_type: str, code: str,
                     retry_after_s: int | None = None) -> None:
        self.status = status
        if self.headers_sent or self.client_gone:
            return
        body = json.dumps({"error": {"message": message, "type": error_type, "param": None, "code": code}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"x-request-id", self.request_id.encode())]
        if retry_after_s is not None:
            headers.append((b"retry-after", str(retry_after_s).encode()))
        self.headers_sent = self.response_done = True
        with contextlib.suppress(OSError):
            await self.send({"type": "http.response.start", "status": status, "headers": headers})
            await self.send({"type": "http.response.body", "body": body, "more_body": False})

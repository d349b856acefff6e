"""Talking to replicas: one shared connection pool, attempts that may fail over, SSE observed in passing.

An attempt counts as failed (and may be retried on another replica) on a connection error, a
timeout, or a 5xx (except a built-in replica's refusal of a late request, answered as it is), but
only until the first body byte has been read: for streams the gateway
waits for the upstream's first chunk before it sends the client any header, so a replica that
dies before its first token costs the client nothing but time. Once bytes went out there is no
retry: the client's stream ends with an error event (and no [DONE]).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from runtime.gateway.contract import SLO_LATE, UPSTREAM_CONNECT, UPSTREAM_ERROR, UPSTREAM_TIMEOUT
from runtime.gateway.http1 import Http1Pool, Response, UpstreamBroken, UpstreamConnectError, UpstreamTimeout

CONNECT, TIMEOUT, ERROR = UPSTREAM_CONNECT, UPSTREAM_TIMEOUT, UPSTREAM_ERROR


class UpstreamFailure(Exception):
    """A failed attempt: retryable on another replica before the first byte, not after."""

    def __init__(self, kind: str, detail: str, status: int | None = None, body: bytes = b"",
                 content_type: str = "application/json") -> None:
        super().__init__(detail)
        self.kind = kind
        self.status = status
        self.body = body
        self.content_type = content_type


@dataclass
class Opened:
    """An upstream answer whose first bytes were read; `streaming`: more may follow."""

    response: Response
    first: bytes
    streaming: bool
    # A built-in replica refused it as late (503, code slo_late): another replica would only be
    # as late, so it is answered as it is.
    refused_late: bool = False

    @property
    def status(self) -> int:
        return self.response.status

    @property
    def content_type(self) -> str:
        return self.response.headers.get(b"content-type", b"application/json").decode("latin-1")

    async def remaining(self) -> AsyncIterator[bytes]:
        """The chunks after the first; a broken stream raises UpstreamFailure."""
        if not self.streaming:
            return
        while True:
            try:
                chunk = await self.response.next_chunk()
            except (UpstreamBroken, UpstreamTimeout) as exc:
                raise _failure(exc) from exc
            if chunk is None:
                return
            yield chunk

    def close(self) -> None:
        # A stream not read to the end closes its connection, which is what makes the replica
        # abort the request when the client went away; a finished one goes back to the pool.
        self.response.close()


class Upstream:
    def __init__(self, connect_timeout_s: float = 2.0, first_token_timeout_s: float = 60.0,
                 request_timeout_s: float = 600.0) -> None:
        self.first_token_timeout_s = first_token_timeout_s
        self.request_timeout_s = request_timeout_s
        self.pool = Http1Pool(connect_timeout_s)

    def close(self) -> None:
        self.pool.close()

    async def open(self, url: str, body: bytes, stream: bool, headers: dict[str, str]) -> Opened:
        """Sends the request and reads its first bytes; raises UpstreamFailure if that fails."""
        # Streams: the read timeout is the first-token timeout (and then the longest silence
        # between chunks). Whole answers come in one piece at the end, so they get the request
        # timeout instead.
        read_timeout = self.first_token_timeout_s if stream else self.request_timeout_s
        try:
            response = await self.pool.post(url, body, {"Content-Type": "application/json", **headers},
                                            head_timeout_s=read_timeout, read_timeout_s=read_timeout)
        except (UpstreamConnectError, UpstreamBroken, UpstreamTimeout) as exc:
            raise _failure(exc) from exc
        try:
            content_type = response.headers.get(b"content-type", b"application/json").decode("latin-1")
            if response.status >= 500:
                body = await response.read()
                if response.status == 503 and _refused_late(body):
                    response.close()  # a deliberate answer, not a failure: no retry, no ejection
                    return Opened(response, body, False, refused_late=True)
                raise UpstreamFailure(ERROR, f"replica answered {response.status}", response.status, body,
                                      content_type)
            if not stream or response.status != 200:
                body = await response.read()
                response.close()
                return Opened(response, body, False)
            return Opened(response, await response.next_chunk() or b"", True)
        except (UpstreamBroken, UpstreamTimeout) as exc:
            response.close()
            raise _failure(exc) from exc
        except BaseException:
            response.close()
            raise


def _failure(exc: Exception) -> UpstreamFailure:
    if isinstance(exc, UpstreamConnectError):
        return UpstreamFailure(CONNECT, str(exc))
    if isinstance(exc, UpstreamTimeout):
        return UpstreamFailure(TIMEOUT, str(exc))
    return UpstreamFailure(ERROR, f"the replica broke the connection: {exc}")


def _refused_late(body: bytes) -> bool:
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == SLO_LATE


def _has_usage(event: bytes) -> bool:
    return b'"usage":{' in event or b'"usage": {' in event


def _has_finish_reason(event: bytes) -> bool:
    return b'"finish_reason":"' in event or b'"finish_reason": "' in event


class StreamObserver:
    """Reads an SSE stream in passing: time of the first chunk, chunks, usage, finish reason.

    Bytes are forwarded as they came; only whole events are released (a partial one waits for
    its end), and the final usage-only event is dropped when the client did not ask for it.
    JSON is parsed only for the rare events that carry a usage or a finish reason.
    """

    def __init__(self, strip_usage: bool) -> None:
        self.strip_usage = strip_usage
        self.first_chunk_at: float | None = None
        self.content_chunks = 0
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.saw_error = False
        self._pending = b""

    def feed(self, data: bytes, now: float) -> bytes:
        buffer = self._pending + data if self._pending else data
        end = buffer.rfind(b"\n\n")
        if end < 0:
            self._pending = buffer
            return b""
        complete, self._pending = buffer[:end + 2], buffer[end + 2:]
        dropped = False
        kept = []
        for event in complete.split(b"\n\n")[:-1]:
            if self._observe(event, now):
                kept.append(event)
            else:
                dropped = True
        return b"".join(event + b"\n\n" for event in kept) if dropped else complete

    def leftover(self) -> bytes:
        leftover, self._pending = self._pending, b""
        return leftover

    def _observe(self, event: bytes, now: float) -> bool:
        """Records what the event says; False when it must not reach the client."""
        if not event.startswith(b"data: {"):
            return True
        if event.startswith(b'data: {"error"'):
            self.saw_error = True
            return True
        parsed = None
        if _has_usage(event):
            parsed = json.loads(event[6:])
            self.usage = parsed.get("usage") or self.usage
            if not parsed.get("choices"):
                return not self.strip_usage
        if self.first_chunk_at is None:
            self.first_chunk_at = now
        self.content_chunks += 1
        if _has_finish_reason(event):
            parsed = parsed or json.loads(event[6:])
            for choice in parsed.get("choices") or ():
                self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return True


def read_usage(body: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """Usage and first finish reason of a whole (non-streamed) OpenAI answer."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None, None
    if not isinstance(parsed, dict):
        return None, None
    finish = next((c.get("finish_reason") for c in parsed.get("choices") or () if isinstance(c, dict)), None)
    return parsed.get("usage"), finish

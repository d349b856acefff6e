"""uvicorn's HTTP/1.1 protocol (httptools) with a deadline for reading each request, and
OpenAI-style JSON for the errors it answers by itself; the gateway and the replica both run it.

uvicorn times out only the idle gap between two requests of a keep-alive connection. A client
that connected and sent nothing, trickled its headers a byte at a time, or announced a body it
never sent held the connection, its file descriptor and (for a body) the application's task
forever: slow-loris. Here a request must arrive whole, headers and body, within
`read_timeout_s` of the connection opening or of the request's first byte. When it does not, a
request begun gets a 408 and the connection is closed; a connection that sent nothing is just
closed, as uvicorn closes an idle keep-alive one.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

DEFAULT_READ_TIMEOUT_S = 30.0
ERROR_TYPES = {400: "BadRequestError", 408: "RequestTimeoutError"}
IDLE, HEAD, BODY = "idle", "head", "body"


class ReadDeadlineProtocol(HttpToolsProtocol):
    read_timeout_s = DEFAULT_READ_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._reading = IDLE
        self._deadline: asyncio.TimerHandle | None = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading = HEAD
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def on_headers_complete(self) -> None:
        self._reading = BODY
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading = IDLE
        self._cancel_deadline()

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, msg)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _read_timed_out(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        answered = self._reading == BODY and self.cycle.response_complete  # without waiting for the body
        if self._reading == IDLE or answered:
            self.transport.close()
            return
        self._refuse(408, f"The request did not arrive whole (headers and body) within {self.read_timeout_s:g} s.")

    def _refuse(self, status: int, message: str) -> None:
        """Answers `status` with an OpenAI-style error and closes the connection. An application
        waiting for the rest of the body is told the client went away, and whatever it answers
        then goes nowhere; one that has begun its answer already just sees the connection close."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            begun = cycle.response_started
            cycle.disconnected = True
            cycle.message_event.set()
            if begun:
                self.transport.close()
                return
        body = json.dumps({"error": {"message": message, "type": ERROR_TYPES[status], "param": None,
                                     "code": status}}).encode()
        head = [STATUS_LINE[status]]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                 b"connection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + body)
        self.transport.close()


def protocol_class(read_timeout_s: float) -> type[ReadDeadlineProtocol]:
    """The protocol for uvicorn.Config(http=...), with this deadline."""
    return type("ReadDeadlineProtocol", (ReadDeadlineProtocol,), {"read_timeout_s": read_timeout_s})

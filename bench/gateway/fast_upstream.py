"""A stand-in upstream for measuring a proxy alone: NOT a model server, NOT a replica.

It answers OpenAI-compatible `POST /v1/chat/completions` and `/v1/completions` (streamed or not)
and `GET /v1/models` with canned text shaped like the recorded vLLM 0.32 answers
(tests/fixtures/vllm-0.32-cpu/chat-stream.sse: a role chunk, content chunks, a finish chunk,
a usage-only chunk when `stream_options.include_usage` asks for it, `data: [DONE]`). It does
no inference, so almost all of a request's time through a proxy is the proxy's own.

Written on raw asyncio protocols with httptools' parser (both already in the project's venv)
so that its cost per request stays far below any proxy's and it does not become the bottleneck.

    python bench/gateway/fast_upstream.py --port 9101 --tokens 16 --token-delay-ms 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time
import uuid

import httptools

REASON = {200: b"OK", 400: b"Bad Request", 404: b"Not Found"}


class UpstreamSettings:
    def __init__(self, tokens: int, token_delay_s: float, first_token_delay_s: float) -> None:
        self.tokens = tokens
        self.token_delay_s = token_delay_s
        self.first_token_delay_s = first_token_delay_s


def _chunk_event(stem: dict, choice: dict) -> bytes:
    return b"data: " + json.dumps({**stem, "choices": [choice]}, separators=(",", ":")).encode() + b"\n\n"


def _prompt_tokens(payload: dict) -> int:
    """Whitespace words of the prompt: a stand-in count, consistent from one request to the next."""
    messages = payload.get("messages")
    if isinstance(messages, list):
        return sum(len(str(m.get("content", "")).split()) for m in messages if isinstance(m, dict)) + 1
    prompt = payload.get("prompt", "")
    return len(prompt.split()) if isinstance(prompt, str) else len(prompt)


class CannedAnswer:
    """The events of one answer, built once per request from its payload."""

    def __init__(self, payload: dict, settings: UpstreamSettings) -> None:
        self.chat = "messages" in payload
        requested = payload.get("max_tokens") or payload.get("max_completion_tokens") or settings.tokens
        self.tokens = max(1, min(int(requested), settings.tokens))
        self.prompt_tokens = _prompt_tokens(payload)
        options = payload.get("stream_options")
        self.include_usage = isinstance(options, dict) and options.get("include_usage") is True
        self.stem = {"id": f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex[:16]}",
                     "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": int(time.time()), "model": payload.get("model", "fast-upstream")}

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens + self.tokens,
                "completion_tokens": self.tokens}

    def token_event(self, index: int) -> bytes:
        last = index == self.tokens - 1
        finish = "length" if last else None
        if self.chat:
            choice = {"index": 0, "delta": {"content": f" tok{index}"}, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": f" tok{index}", "logprobs": None, "finish_reason": finish}
        return _chunk_event(self.stem, choice)

    def opening_events(self) -> bytes:
        if not self.chat:
            return b""
        return _chunk_event(self.stem, {"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None})

    def closing_events(self) -> bytes:
        tail = b""
        if self.include_usage:
            tail += b"data: " + json.dumps({**self.stem, "choices": [], "usage": self.usage()},
                                           separators=(",", ":")).encode() + b"\n\n"
        return tail + b"data: [DONE]\n\n"

    def whole(self) -> bytes:
        text = "".join(f" tok{i}" for i in range(self.tokens))
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": "length"}
            kind = "text_completion"
        return json.dumps({**self.stem, "object": kind, "choices": [choice], "usage": self.usage()}).encode()


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive client connection; requests are answered one after the other."""

    def __init__(self, settings: UpstreamSettings) -> None:
        self.settings = settings
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # Events are many small writes: without this, Nagle holds each one back until the
            # client ACKs the previous one (a delayed ACK), adding tens of ms to the first token.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        url, body = self.url, b"".join(self.body)
        self.url, self.body = b"", []
        method = self.parser.get_method()
        path = url.split(b"?", 1)[0].rstrip(b"/")
        if method == b"GET" and path.endswith(b"/models"):
            self._send_whole(200, json.dumps({"object": "list", "data": [
                {"id": "fast-upstream", "object": "model", "owned_by": "bench"}]}).encode())
        elif method == b"POST" and (path.endswith(b"/chat/completions") or path.endswith(b"/completions")):
            self._answer(body)
        else:
            self._send_whole(404, b'{"error":{"message":"not found","type":"NotFoundError","code":404}}')

    def _answer(self, body: bytes) -> None:
        try:
            payload = json.loads(body)
        except ValueError:
            self._send_whole(400, b'{"error":{"message":"malformed JSON","type":"BadRequestError","code":400}}')
            return
        answer = CannedAnswer(payload, self.settings)
        if payload.get("stream") is not True:
            self._send_whole(200, answer.whole())
            return
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                             b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")
        if self.settings.token_delay_s <= 0 and self.settings.first_token_delay_s <= 0:
            # Unpaced: every event is its own HTTP chunk, but all leave in one write, as a busy
            # server's would, so the upstream spends as little CPU as it can.
            events = [answer.opening_events(), *(answer.token_event(i) for i in range(answer.tokens)),
                      answer.closing_events()]
            self.transport.write(b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events if e) + b"0\r\n\r\n")
            return
        self._write_chunk(answer.opening_events())
        self.loop.call_later(self.settings.first_token_delay_s, self._stream_token, answer, 0)

    def _stream_token(self, answer: CannedAnswer, index: int) -> None:
        if self.transport is None or self.transport.is_closing():
            return  # the client went away: stop generating, as a replica aborts the request
        self._write_chunk(answer.token_event(index))
        if index + 1 < answer.tokens:
            self.loop.call_later(self.settings.token_delay_s, self._stream_token, answer, index + 1)
        else:
            self._finish_stream(answer)

    def _finish_stream(self, answer: CannedAnswer) -> None:
        self._write_chunk(answer.closing_events())
        self.transport.write(b"0\r\n\r\n")

    def _write_chunk(self, data: bytes) -> None:
        if data and self.transport is not None:
            self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _send_whole(self, status: int, body: bytes) -> None:
        if self.transport is None:
            return
        head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % (
            status, REASON.get(status, b"Error"), len(body))
        self.transport.write(head + body)


async def serve(host: str, port: int, settings: UpstreamSettings) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: UpstreamConnection(settings), host, port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9101)
    parser.add_argument("--tokens", type=int, default=16, help="completion tokens per answer (at most)")
    parser.add_argument("--token-delay-ms", type=float, default=0.0, help="pause between content chunks")
    parser.add_argument("--first-token-delay-ms", type=float, default=0.0, help="pause before the first token")
    args = parser.parse_args()
    settings = UpstreamSettings(args.tokens, args.token_delay_ms / 1000, args.first_token_delay_ms / 1000)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.host, args.port, settings))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

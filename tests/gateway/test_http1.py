"""The gateway's HTTP/1.1 client against small raw asyncio servers that misbehave on purpose."""

from __future__ import annotations

import asyncio

import pytest

from runtime.gateway.http1 import Http1Pool, UpstreamBroken, UpstreamConnectError, UpstreamTimeout
from tests.conftest import free_port

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"
CHUNKED = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"5\r\nhello\r\n")


async def _read_request(reader: asyncio.StreamReader) -> bool:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    await reader.readexactly(length)
    return True


def _serve(handler):
    """Runs `scenario(pool, port, stats)` against a raw server whose connections run `handler`."""

    def run(scenario) -> dict:
        stats = {"connections": 0, "closed_early": 0}

        async def on_connection(reader, writer):
            stats["connections"] += 1
            try:
                await handler(reader, writer, stats)
            except (asyncio.IncompleteReadError, ConnectionError):
                stats["closed_early"] += 1
            finally:
                writer.close()

        async def main():
            port = free_port()
            server = await asyncio.start_server(on_connection, "127.0.0.1", port)
            pool = Http1Pool(connect_timeout_s=1)
            try:
                await scenario(pool, f"http://127.0.0.1:{port}/v1/x", stats)
            finally:
                pool.close()
                server.close()

        asyncio.run(main())
        return stats

    return run


async def _answer_once_then_close_on_the_next(reader, writer, stats):
    await _read_request(reader)
    writer.write(ANSWER)
    await writer.drain()
    await _read_request(reader)  # the keep-alive request arrives ... and the replica hangs up


def test_a_keep_alive_connection_closed_by_the_replica_is_retried_on_a_fresh_one():
    async def scenario(pool, url, stats):
        for _ in range(3):
            response = await pool.post(url, b"{}", {}, head_timeout_s=2, read_timeout_s=2)
            assert (response.status, await response.read()) == (200, b"ok")
            response.close()

    stats = _serve(_answer_once_then_close_on_the_next)(scenario)
    assert stats["connections"] == 3  # each reused connection failed once and was replaced


async def _answer_forever(reader, writer, stats):
    while await _read_request(reader):
        writer.write(ANSWER)
        await writer.drain()


def test_connections_are_reused():
    async def scenario(pool, url, stats):
        for _ in range(5):
            response = await pool.post(url, b"{}", {"X-Request-Id": "r"}, head_timeout_s=2, read_timeout_s=2)
            assert await response.read() == b"ok"
            response.close()

    assert _serve(_answer_forever)(scenario)["connections"] == 1


async def _stream_then_stall(reader, writer, stats):
    await _read_request(reader)
    writer.write(CHUNKED)
    await writer.drain()
    try:
        await reader.read()  # until the client closes
    finally:
        stats["client_closed"] = True


def test_read_timeout_and_closing_an_unfinished_stream_hangs_up():
    async def scenario(pool, url, stats):
        response = await pool.post(url, b"{}", {}, head_timeout_s=2, read_timeout_s=0.3)
        assert await response.next_chunk() == b"hello"
        with pytest.raises(UpstreamTimeout):
            await response.next_chunk()
        response.close()
        for _ in range(20):
            if stats.get("client_closed"):
                return
            await asyncio.sleep(0.05)

    assert _serve(_stream_then_stall)(scenario)["client_closed"]


async def _die_mid_stream(reader, writer, stats):
    await _read_request(reader)
    writer.write(CHUNKED)
    await writer.drain()
    writer.transport.abort()


def test_a_stream_cut_mid_way_is_broken_not_complete():
    async def scenario(pool, url, stats):
        response = await pool.post(url, b"{}", {}, head_timeout_s=2, read_timeout_s=2)
        with pytest.raises(UpstreamBroken):
            while await response.next_chunk() is not None:
                pass
        response.close()

    _serve(_die_mid_stream)(scenario)


def test_nothing_listening_is_a_connect_error():
    async def main():
        pool = Http1Pool(connect_timeout_s=1)
        with pytest.raises(UpstreamConnectError):
            await pool.post(f"http://127.0.0.1:{free_port()}/v1/x", b"{}", {}, head_timeout_s=1, read_timeout_s=1)

    asyncio.run(main())

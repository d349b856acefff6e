"""The gateway forwards the Files and Batches API (/v1/files*, /v1/batches*) to the control plane.

A real gateway (real Redis) in front of `StandIn`, a small HTTP server that stands in for the
control plane's Django views and records what reached it: these tests check the forwarding
alone (bodies and answers streamed byte-identical, the headers passed on and no others, the key
checked first, the size limit, the control plane down or slow). The views themselves, behind a
real gateway, are exercised end to end by the batches tests.
"""

from __future__ import annotations

import asyncio
import email.parser
import email.policy
import http.client
import io
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from runtime.gateway.server import Gateway, GatewaySettings
from tests.conftest import free_port
from tests.gateway.conftest import REDIS_URL, ThreadedServer
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

MAX_FILE_BYTES = 1_000_000
TIMEOUT_S = 1.5
# A download of a few MB, in uneven chunks, every byte value present.
DOWNLOAD = bytes(range(256)) * (3 * 4096 + 17)
HTTP = httpx.Client(timeout=20)


@dataclass
class Received:
    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes


@dataclass
class StandIn:
    """Answers as the control plane's views would, and records each request it received whole."""

    received: list[Received] = field(default_factory=list)
    delay_s: float = 0.0
    download_closed_early: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        methods = ["GET", "POST", "DELETE", "PUT", "PATCH"]
        self.server = ThreadedServer(Starlette(routes=[Route("/{path:path}", self.serve, methods=methods)]))
        self.url = self.server.url

    async def serve(self, request: Request) -> Response:
        try:
            body = await request.body()
        except ClientDisconnect:
            return Response(status_code=400)  # an upload the gateway cut off: nobody reads this
        self.received.append(Received(request.method, request.url.path, request.url.query,
                                      [(k.decode(), v.decode()) for k, v in request.headers.raw], body))
        path = request.url.path
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if path == "/v1/files" and request.method == "POST":
            content = _file_part(request.headers["content-type"], body)
            return JSONResponse({"id": "file-abc", "object": "file", "bytes": len(content), "created_at": 1,
                                 "filename": "input.jsonl", "purpose": "batch", "status": "processed"},
                                headers={"x-request-id": "cp-upload"})
        if path == "/v1/files":
            return JSONResponse({"object": "list", "data": [], "has_more": False})
        if path == "/v1/files/file-abc/content":
            return StreamingResponse(self._download(), media_type="application/octet-stream",
                                     headers={"content-disposition": 'attachment; filename="output.jsonl"'})
        if path == "/v1/files/endless/content":
            return StreamingResponse(self._endless(), media_type="application/octet-stream")
        if path.startswith("/v1/batches/") and path.endswith("/cancel"):
            batch_id = path.split("/")[3]
            return JSONResponse({"id": batch_id, "object": "batch", "endpoint": "/v1/chat/completions",
                                 "input_file_id": "file-abc", "completion_window": "24h", "status": "cancelling",
                                 "created_at": 1})
        return JSONResponse({"error": {"message": "not here", "type": "NotFoundError", "param": None,
                                       "code": 404}}, status_code=404, headers={"retry-after": "7"})

    async def _download(self):
        for start in range(0, len(DOWNLOAD), 65_537):
            yield DOWNLOAD[start:start + 65_537]

    async def _endless(self):
        try:
            for _ in range(10_000):
                yield b"x" * 1024
                await asyncio.sleep(0.01)
        finally:
            self.download_closed_early.set()


def _file_part(content_type: str, body: bytes) -> bytes:
    """The `file` field of a multipart body."""
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body)
    for part in message.iter_parts():
        if part.get_param("name", header="content-disposition") == "file":
            return part.get_payload(decode=True)
    raise AssertionError("no file part")


@pytest.fixture
def stand_in():
    stand_in = StandIn()
    stand_in.server.start()
    yield stand_in
    stand_in.server.stop()


@pytest.fixture
def gateway_for(tmp_path: Path):
    """`gateway_for(url)`: a gateway forwarding files and batches to `url`; stopped after the test."""
    started: list[ThreadedServer] = []

    def start(control_plane_url: str) -> str:
        settings = GatewaySettings(redis_url=REDIS_URL, instance=f"cp-{len(started)}", spool_dir=tmp_path / "spool",
                                   control_plane_url=control_plane_url, max_file_bytes=MAX_FILE_BYTES,
                                   control_plane_timeout_s=TIMEOUT_S)
        server = ThreadedServer(Gateway(settings))
        server.server.config.proxy_headers = False  # as `inferops gateway` runs it
        started.append(server.start())
        return server.url

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def setup(control, stand_in, gateway_for):
    secret, _ = control.publish_key("acme", ["demo"])
    return stand_in, gateway_for(stand_in.url), secret


def _client(url: str, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=secret, max_retries=0, timeout=20)


def _counts(url: str) -> dict[tuple[str, str], float]:
    text = HTTP.get(f"{url}/metrics").text
    return {(s.labels["route"], s.labels["status"]): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "inferops_gateway_control_plane_requests_total"}


def test_an_sdk_upload_arrives_byte_identical_with_only_the_named_headers(setup):
    stand_in, url, secret = setup
    content = b"".join(b'{"custom_id": "r%06d", "method": "POST", "url": "/v1/chat/completions"}\n' % i
                       for i in range(20_000))[:MAX_FILE_BYTES]  # exactly the limit: still forwarded
    uploaded = _client(url, secret).files.create(file=("input.jsonl", io.BytesIO(content)), purpose="batch")
    assert (uploaded.id, uploaded.bytes, uploaded.purpose) == ("file-abc", MAX_FILE_BYTES, "batch")
    (received,) = stand_in.received
    assert (received.method, received.path, received.query) == ("POST", "/v1/files", "")
    assert _file_part(dict(received.headers)["content-type"], received.body) == content
    headers = dict(received.headers)
    assert len(headers) == len(received.headers)  # none twice
    assert set(headers) == {"host", "authorization", "content-type", "content-length", "accept", "x-request-id",
                            "x-forwarded-for"}  # no user-agent, no x-stainless-*, no accept-encoding
    assert headers["authorization"] == f"Bearer {secret}"
    assert headers["content-type"].startswith("multipart/form-data; boundary=")
    assert int(headers["content-length"]) == len(received.body)
    assert headers["accept"] == "application/json"
    assert headers["x-request-id"].startswith("gw-") and headers["x-forwarded-for"] == "127.0.0.1"

    # A raw multipart body arrives as it was sent, byte for byte; the client's request id and
    # X-Forwarded-For go on (the gateway appends its own client's address).
    body = (b"--b0undary\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            b"--b0undary\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x.jsonl\"\r\n"
            b"Content-Type: application/jsonl\r\n\r\n" + content[:5000] + b"\r\n--b0undary--\r\n")
    response = HTTP.post(f"{url}/v1/files", content=body, headers={
        "Authorization": f"Bearer {secret}", "Content-Type": "multipart/form-data; boundary=b0undary",
        "X-Request-Id": "client-42", "X-Forwarded-For": "203.0.113.9", "Cookie": "sessionid=nope"})
    assert response.status_code == 200 and response.json()["bytes"] == 5000
    assert response.headers["x-request-id"] == "cp-upload"  # the control plane's own, when it sends one
    received = stand_in.received[-1]
    assert received.body == body
    headers = dict(received.headers)
    assert headers["x-request-id"] == "client-42" and "cookie" not in headers
    assert headers["x-forwarded-for"] == "203.0.113.9, 127.0.0.1"


def test_a_download_streams_back_byte_identical_and_the_query_string_is_kept(setup):
    stand_in, url, secret = setup
    client = _client(url, secret)
    download = client.files.content("file-abc")
    assert download.content == DOWNLOAD
    assert download.response.headers["content-disposition"] == 'attachment; filename="output.jsonl"'
    assert download.response.headers["content-type"] == "application/octet-stream"
    # The gateway's request id, when the control plane sends none.
    assert download.response.headers["x-request-id"].startswith("gw-")

    page = client.files.list(extra_query={"limit": 2, "after": "x"})
    assert page.data == []
    assert (stand_in.received[-1].path, stand_in.received[-1].query) == ("/v1/files", "limit=2&after=x")
    response = HTTP.get(f"{url}/v1/batches?limit=2&after=x", headers={"Authorization": f"Bearer {secret}"})
    assert (stand_in.received[-1].path, stand_in.received[-1].query) == ("/v1/batches", "limit=2&after=x")
    # The control plane's own errors and their headers come back as they are.
    assert response.status_code == 404 and response.json()["error"]["message"] == "not here"
    assert response.headers["retry-after"] == "7"


def test_a_cancel_is_forwarded(setup):
    stand_in, url, secret = setup
    batch = _client(url, secret).batches.cancel("batch_123")
    assert (batch.id, batch.status) == ("batch_123", "cancelling")
    assert (stand_in.received[-1].method, stand_in.received[-1].path) == ("POST", "/v1/batches/batch_123/cancel")


def test_no_key_a_bad_key_or_an_expired_key_never_reaches_the_control_plane(control, setup):
    stand_in, url, _ = setup
    expired, _ = control.publish_key("acme", expires_at=time.time() - 1)
    cases = [({}, "Missing API key"), ({"Authorization": "Bearer iop_nope"}, "Invalid API key"),
             ({"Authorization": f"Bearer {expired}"}, "has expired")]
    for headers, message in cases:
        for method, path in (("GET", "/v1/files"), ("POST", "/v1/batches"), ("GET", "/v1/files/file-abc/content")):
            response = HTTP.request(method, url + path, headers=headers, content=b"{}" if method == "POST" else None)
            assert response.status_code == 401, (method, path)
            error = response.json()["error"]
            assert message in error["message"] and set(error) == {"message", "type", "param", "code"}
    with pytest.raises(openai.AuthenticationError):
        _client(url, "iop_nope").files.list()
    assert stand_in.received == []
    assert _counts(url)[("files", "401")] == 7 and _counts(url)[("batches", "401")] == 3


def test_an_upload_over_the_limit_is_refused_declared_or_not(setup):
    stand_in, url, secret = setup
    auth = {"Authorization": f"Bearer {secret}", "Content-Type": "multipart/form-data; boundary=b"}
    too_big = b"x" * (MAX_FILE_BYTES + 100 * 1024)
    response = HTTP.post(f"{url}/v1/files", content=too_big, headers=auth)  # Content-Length declared
    assert response.status_code == 413
    assert str(MAX_FILE_BYTES) in response.json()["error"]["message"]
    assert stand_in.received == []  # refused before a byte was read

    def chunked():  # no Content-Length: refused once the limit is passed
        for start in range(0, len(too_big), 50_000):
            yield too_big[start:start + 50_000]

    response = HTTP.post(f"{url}/v1/files", content=chunked(), headers=auth)
    assert response.status_code == 413 and response.json()["error"]["code"] == "file_too_large"
    assert stand_in.received == []  # the control plane got a cut-off upload, never a whole one
    # A chunked upload under the limit goes through whole.
    body = too_big[:200_000]
    response = HTTP.post(f"{url}/v1/batches", content=(body[i:i + 30_000] for i in range(0, len(body), 30_000)),
                         headers=auth)
    assert response.status_code == 404 and stand_in.received[-1].body == body
    assert dict(stand_in.received[-1].headers)["transfer-encoding"] == "chunked"
    assert _counts(url)[("files", "413")] == 2


def test_the_control_plane_down_is_a_503_that_says_interactive_requests_are_unaffected(control, gateway_for):
    secret, _ = control.publish_key("acme", ["demo"])
    url = gateway_for(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    for method, path in (("GET", "/v1/files"), ("POST", "/v1/files"), ("POST", "/v1/batches/b/cancel")):
        response = HTTP.request(method, url + path, headers={"Authorization": f"Bearer {secret}"},
                                content=b"x" * 1000 if method == "POST" else None)
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "control_plane_unreachable"
        assert "control plane" in error["message"] and "unreachable" in error["message"]
        assert "interactive requests" in error["message"] and "unaffected" in error["message"]
        assert response.headers["retry-after"] and response.headers["x-request-id"].startswith("gw-")
    with pytest.raises(openai.InternalServerError):
        _client(url, secret).files.list()
    assert _counts(url)[("files", "503")] == 3


def test_a_control_plane_slower_than_the_timeout_is_a_504(setup):
    stand_in, url, secret = setup
    stand_in.delay_s = TIMEOUT_S + 1.5
    started = time.monotonic()
    response = HTTP.get(f"{url}/v1/batches/batch_1", headers={"Authorization": f"Bearer {secret}"})
    assert response.status_code == 504
    assert time.monotonic() - started < TIMEOUT_S + 1.4
    error = response.json()["error"]
    assert error["code"] == "control_plane_timeout" and "interactive requests" in error["message"]
    assert _counts(url)[("batches", "504")] == 1


def test_a_client_that_leaves_mid_download_closes_the_upstream(setup):
    stand_in, url, secret = setup
    with HTTP.stream("GET", f"{url}/v1/files/endless/content", headers={"Authorization": f"Bearer {secret}"}) as r:
        assert r.status_code == 200
        next(r.iter_raw())
    assert stand_in.download_closed_early.wait(10)


def test_unknown_paths_and_dot_segments_are_not_forwarded(setup):
    stand_in, url, secret = setup
    auth = {"Authorization": f"Bearer {secret}"}
    for path in ("/v1/filesystem", "/v1/batch", "/v1/uploads"):
        response = HTTP.get(url + path, headers=auth)
        assert response.status_code == 404 and response.json()["error"]["code"] == 404
    host, port = url.removeprefix("http://").split(":")
    for path in ("/v1/files/../admin/", "/v1/batches/./x/../../../api/v1/tenants/"):
        connection = http.client.HTTPConnection(host, int(port), timeout=5)
        connection.request("GET", path, headers=auth)  # sent as is: http.client resolves no dot segment
        assert connection.getresponse().status == 404
        connection.close()
    assert stand_in.received == []


def test_forwarded_calls_write_no_usage_event(control, replicas, setup):
    stand_in, url, secret = setup
    (replica,) = replicas(1)
    control.publish_route("demo", [(1, 100, [(replica.id, replica.url)])])
    client = _client(url, secret)
    client.files.list()
    client.files.content("file-abc").read()
    client.batches.cancel("batch_9")
    HTTP.get(f"{url}/v1/files", headers={"Authorization": "Bearer iop_nope"})
    wait_until(lambda: "demo" in HTTP.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {secret}"}).text,
               "the gateway to learn the route")
    client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    events = control.wait_events(1)
    assert [e["endpoint"] for e in events] == ["chat"]  # the inference request's alone
    counts = _counts(url)
    assert counts[("files", "200")] == 2 and counts[("batches", "200")] == 1 and counts[("files", "401")] == 1


@pytest.mark.skipif(os.environ.get("INFEROPS_CONTROL_PLANE_URL") is not None, reason="the variable is set here")
def test_the_control_plane_url_comes_from_the_flag_the_environment_or_the_default(monkeypatch):
    import argparse

    from runtime.gateway.server import add_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert settings_from_args(parser.parse_args([])).control_plane_url == "http://127.0.0.1:8000"
    assert settings_from_args(parser.parse_args([])).max_file_bytes == 200 * 1000 * 1000
    monkeypatch.setenv("INFEROPS_CONTROL_PLANE_URL", "http://web:8000/")
    assert settings_from_args(parser.parse_args([])).control_plane_url == "http://web:8000"
    args = parser.parse_args(["--control-plane-url", "https://cp.internal", "--max-file-bytes", "1000"])
    assert (settings_from_args(args).control_plane_url, settings_from_args(args).max_file_bytes) == (
        "https://cp.internal", 1000)
    with pytest.raises(SystemExit):
        parser.parse_args(["--control-plane-url", "web:8000"])
    monkeypatch.setenv("INFEROPS_CONTROL_PLANE_URL", "web:8000")
    with pytest.raises(SystemExit, match="INFEROPS_CONTROL_PLANE_URL"):
        settings_from_args(parser.parse_args([]))

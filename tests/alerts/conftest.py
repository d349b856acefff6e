"""A real HTTP webhook receiver in a thread: it records each POST and answers from a script."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


class RecordingReceiver:
    def __init__(self):
        self.requests: list[dict] = []
        self.script: list[tuple[int, float]] = []  # (status, delay_s) per request; then 200
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with receiver.lock:
                    receiver.requests.append({"path": self.path, "body": body, "headers": dict(self.headers)})
                    status, delay = receiver.script.pop(0) if receiver.script else (200, 0.0)
                time.sleep(delay)
                payload = b'{"ok": true}' if status < 400 else b'{"error": "scripted"}'
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (a timeout test)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def webhook_receiver():
    receiver = RecordingReceiver()
    yield receiver
    receiver.close()

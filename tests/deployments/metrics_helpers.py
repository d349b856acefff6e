"""Rows the replica-metrics tests share: a deployment with replicas, and hand-built metric rows."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from deployments.choices import ReplicaState
from registry import services


def deployment_with_replicas(artifact_dir, *, replicas: int = 2, name: str = "chat",
                             versions: int = 1):
    """A registered model with `versions` versions, a deployment of the first, and `replicas`
    ready replicas spread round-robin over the versions. Returns (deployment, versions, replicas).
    """
    from deployments.models import Deployment, Replica

    model = services.model_create(name=f"{name}-model", task="generate", actor=None)
    registered = [services.version_register(model=model, artifact_uri=str(artifact_dir), actor=None)
                  for _ in range(versions)]
    deployment = Deployment.objects.create(name=name, model=model, version=registered[0])
    rows = [
        Replica.objects.create(deployment=deployment, version=registered[i % versions],
                               node="test", url=f"http://127.0.0.1:9/{i}",
                               state=ReplicaState.READY)
        for i in range(replicas)
    ]
    return deployment, registered, rows


def metrics_row(model, replica, start, **fields):
    """Create a minute or hour row for `replica` at `start` with the given columns."""
    return model.objects.create(replica=replica, deployment_id=replica.deployment_id,
                                version_id=replica.version_id, start=start, **fields)


class MetricsPage:
    """A /metrics endpoint on a loopback port (a replica's, or a dcgm-exporter's) serving `render()`,
    by default the text the test sets, and counting the requests it answered."""

    def __init__(self, text: str = "") -> None:
        self.text, self.requests = text, 0
        page = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's naming)
                page.requests += 1
                found = self.path == "/metrics"
                body = page.render() if found else b"not found"
                self.send_response(200 if found else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def render(self) -> bytes:
        return self.text.encode()

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

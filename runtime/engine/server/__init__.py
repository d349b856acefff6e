"""`inferops serve`: an OpenAI-compatible replica around the built-in engine.

The process binds at once and answers /health 503 while the model loads in a background
thread, so an orchestrator can watch it come up. SIGTERM drains: /health and new requests get
503, in-flight requests finish (bounded by --drain-timeout), then the process exits 0.

Fault injection (extra TTFT, extra time per output token, a fraction of requests answered
500) is off by default and exists for tests and game days; the delays are applied per request
in the async layer, so they never slow the engine loop or other requests.

Modules, one concern each:
- `routes`: the HTTP endpoints and their checks (`ReplicaServer`).
- `generation`: one request's run through the engine, streamed or collected (`GenerationRun`).
- `draining`: admission while running and SIGTERM's drain (`Lifecycle`, `DrainingServer`).
- `cli`: the command line and the process (`add_arguments`, `main`, `build_backend`).
- `settings` and `responses`: what those share (settings; error bodies and SSE frames).
"""

from runtime.engine.server.cli import (
    add_arguments,
    build_backend,
    is_encoder_checkpoint,
    main,
    settings_from_args,
)
from runtime.engine.server.draining import AdmissionMiddleware, DrainingServer, Lifecycle
from runtime.engine.server.generation import GenerationRun
from runtime.engine.server.routes import ReplicaServer
from runtime.engine.server.settings import DEFAULT_MAX_BODY_BYTES, FaultSettings, ServerSettings

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "AdmissionMiddleware",
    "DrainingServer",
    "FaultSettings",
    "GenerationRun",
    "Lifecycle",
    "ReplicaServer",
    "ServerSettings",
    "add_arguments",
    "build_backend",
    "is_encoder_checkpoint",
    "main",
    "settings_from_args",
]

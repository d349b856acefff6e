"""How errors and stream events go on the wire, for the routes and the middleware alike."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse

from runtime.engine.async_engine import LOADING, STOPPED, EngineUnavailableError
from runtime.engine.openai_protocol import OpenAIError

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = "data: [DONE]\n\n"


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def unavailable_error(exc: EngineUnavailableError) -> OpenAIError:
    """Loading and shutting down are temporary (503, retry elsewhere); a dead or failed
    model is a server error (500)."""
    return OpenAIError(503 if exc.state in (LOADING, STOPPED) else 500, str(exc))


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"

"""OpenAI's Files and Batches API on the control plane, reached through the gateway (which
forwards /v1/files* and /v1/batches*), so the official SDK's `client.files` and `client.batches`
work unchanged. Callers authenticate with a tenant's API key (`Authorization: Bearer`), as on every
/v1 route; a key sees its tenant's files and batches. Errors are OpenAI's JSON shape.
"""

from __future__ import annotations

import functools
import json

from django.conf import settings
from django.db.models import Q
from django.http import FileResponse, HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from batches import services
from batches.choices import FilePurpose
from batches.models import Batch, BatchFile
from batches.services import BatchError
from runtime.gateway.contract import hash_api_key
from tenants.models import ApiKey

MAX_LIST = 100
MAX_FILE_LIST = 10_000


def error(status: int, message: str, error_type: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> JsonResponse:
    return JsonResponse({"error": {"message": message, "type": error_type, "param": param, "code": code}},
                        status=status)


def api_key(request: HttpRequest) -> ApiKey | JsonResponse:
    header = request.headers.get("Authorization", "")
    if not header[:7].lower() == "bearer ":
        return error(401, "Missing API key: send `Authorization: Bearer <key>`.", "authentication_error")
    key = (ApiKey.objects.active().select_related("tenant")
           .filter(key_hash=hash_api_key(header[7:].strip())).first())
    if key is None:
        return error(401, "Invalid API key (unknown, revoked or expired).", "authentication_error",
                     code="invalid_api_key")
    return key


def openai_view(methods: tuple[str, ...], max_body_bytes=None):
    """A /v1 view: the methods it takes, an API key resolved (or 401), BatchError as OpenAI errors."""
    def wrap(view):
        @csrf_exempt
        @functools.wraps(view)
        def wrapped(request, *args, **kwargs):
            if request.method not in methods:
                return error(405, f"{request.method} is not allowed here; use {' or '.join(methods)}.")
            key = api_key(request)
            if isinstance(key, JsonResponse):
                return key
            try:
                return view(request, key, *args, **kwargs)
            except BatchError as exc:
                return error(exc.status, str(exc), exc.error_type, exc.param, exc.code)
        if max_body_bytes is not None:
            wrapped.max_body_bytes = max_body_bytes  # read by inferops.middleware.BodySizeLimitMiddleware
        return wrapped
    return wrap


def _json_body(request: HttpRequest) -> dict:
    try:
        body = json.loads(request.body or b"{}")
    except ValueError as exc:
        raise BatchError(f"Malformed JSON body: {exc}.") from None
    if not isinstance(body, dict):
        raise BatchError("The request body must be a JSON object.")
    return body


def _limit(request: HttpRequest, default: int, most: int) -> int:
    raw = request.GET.get("limit")
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise BatchError(f"`limit` must be an integer from 1 to {most}.", param="limit")
    return int(raw)


def _page(queryset, request: HttpRequest, serialize, default: int, most: int, ascending: bool = False) -> JsonResponse:
    """A cursor page as OpenAI lists: newest first (oldest first when `ascending`), `after` an id, `has_more`."""
    limit = _limit(request, default, most)
    after = request.GET.get("after")
    if after:
        anchor = queryset.filter(pk=after).first()
        if anchor is None:
            raise BatchError(f"`after`: no {queryset.model._meta.verbose_name} {after!r} of yours exists.",
                             param="after")
        # Past the anchor in the page's order: (created_at, id) beyond it.
        beyond = "gt" if ascending else "lt"
        queryset = queryset.filter(Q(**{f"created_at__{beyond}": anchor.created_at})
                                   | Q(created_at=anchor.created_at, **{f"pk__{beyond}": anchor.pk}))
    order = ("created_at", "pk") if ascending else ("-created_at", "-pk")
    rows = list(queryset.order_by(*order)[:limit + 1])
    data = [serialize(row) for row in rows[:limit]]
    return JsonResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit})


# -- files ----------------------------------------------------------------------------------------------


def file_object(row: BatchFile) -> dict:
    return {"id": row.id, "object": "file", "bytes": row.bytes, "created_at": int(row.created_at.timestamp()),
            "filename": row.filename, "purpose": row.purpose, "status": "processed", "expires_at": None,
            "status_details": None}


@openai_view(("GET", "POST"), max_body_bytes=lambda: settings.INFEROPS_BATCH_MAX_FILE_BYTES + 64 * 1024)
def files(request: HttpRequest, key: ApiKey) -> JsonResponse:
    if request.method == "GET":
        queryset = BatchFile.objects.filter(tenant_id=key.tenant_id)
        purpose = request.GET.get("purpose")
        if purpose:
            if purpose not in FilePurpose.values:
                raise BatchError(f"`purpose` must be one of {', '.join(FilePurpose.values)}.", param="purpose")
            queryset = queryset.filter(purpose=purpose)
        order = request.GET.get("order", "desc")
        if order not in ("asc", "desc"):
            raise BatchError("`order` must be asc or desc.", param="order")
        return _page(queryset, request, file_object, MAX_FILE_LIST, MAX_FILE_LIST, ascending=order == "asc")
    if not request.content_type.startswith("multipart/form-data"):
        raise BatchError("Upload the file as multipart/form-data with the fields `file` and `purpose`.")
    upload = request.FILES.get("file")
    if upload is None:
        raise BatchError("The multipart field `file` is required.", param="file")
    row = services.file_create(key=key, upload=upload, filename=upload.name or "input.jsonl",
                               purpose=request.POST.get("purpose", ""))
    return JsonResponse(file_object(row))


@openai_view(("GET", "DELETE"))
def file_detail(request: HttpRequest, key: ApiKey, file_id: str) -> JsonResponse:
    row = services.owned(BatchFile, key, file_id, "file_id")
    if request.method == "DELETE":
        services.file_delete(file=row)
        return JsonResponse({"id": file_id, "object": "file", "deleted": True})
    return JsonResponse(file_object(row))


@openai_view(("GET",))
def file_content(request: HttpRequest, key: ApiKey, file_id: str) -> FileResponse:
    row = services.owned(BatchFile, key, file_id, "file_id")
    try:
        handle = services.storage().open(row.storage_name, "rb")
    except FileNotFoundError:
        raise BatchError(f"File {file_id}'s content is missing from the batch file storage.", status=404,
                         param="file_id", error_type="not_found_error") from None
    except services.STORAGE_ERRORS as exc:
        raise services.storage_unavailable(exc) from exc
    return FileResponse(handle, content_type="application/jsonl", as_attachment=True, filename=row.filename)


# -- batches -------------------------------------------------------------------------------------------


def _stamp(value) -> int | None:
    return int(value.timestamp()) if value else None


def batch_object(batch: Batch) -> dict:
    return {
        "id": batch.id, "object": "batch", "endpoint": batch.endpoint, "model": batch.model or None,
        "errors": batch.errors, "input_file_id": batch.input_file_ref, "completion_window": batch.completion_window,
        "status": batch.status, "output_file_id": batch.output_file_id, "error_file_id": batch.error_file_id,
        "created_at": _stamp(batch.created_at), "in_progress_at": _stamp(batch.in_progress_at),
        "expires_at": _stamp(batch.expires_at), "finalizing_at": _stamp(batch.finalizing_at),
        "completed_at": _stamp(batch.completed_at), "failed_at": _stamp(batch.failed_at),
        "expired_at": _stamp(batch.expired_at), "cancelling_at": _stamp(batch.cancelling_at),
        "cancelled_at": _stamp(batch.cancelled_at),
        "request_counts": {"total": batch.total, "completed": batch.completed, "failed": batch.failed},
        "usage": {"input_tokens": batch.prompt_tokens, "output_tokens": batch.completion_tokens,
                  "total_tokens": batch.prompt_tokens + batch.completion_tokens},
        "metadata": batch.metadata,
    }


@openai_view(("GET", "POST"))
def batches(request: HttpRequest, key: ApiKey) -> JsonResponse:
    if request.method == "GET":
        return _page(Batch.objects.filter(tenant_id=key.tenant_id), request, batch_object, 20, MAX_LIST)
    body = _json_body(request)
    for name in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(body.get(name), str):
            raise BatchError(f"`{name}` is required (a string).", param=name)
    batch = services.batch_create(key=key, input_file_id=body["input_file_id"], endpoint=body["endpoint"],
                                  completion_window=body["completion_window"], metadata=body.get("metadata"))
    return JsonResponse(batch_object(batch))


@openai_view(("GET",))
def batch_detail(request: HttpRequest, key: ApiKey, batch_id: str) -> JsonResponse:
    return JsonResponse(batch_object(services.owned(Batch, key, batch_id, "batch_id")))


@openai_view(("POST",))
def batch_cancel(request: HttpRequest, key: ApiKey, batch_id: str) -> JsonResponse:
    return JsonResponse(batch_object(services.batch_cancel(batch=services.owned(Batch, key, batch_id, "batch_id"))))

"""The console's batch pages: every tenant's batches with their progress, one batch in full (and its
cancel), and its files' downloads. The tenant page's panel (batches.panels) shows the same rows."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.db import transaction
from django.http import FileResponse, Http404
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.cache import never_cache

from batches import services
from batches.choices import BatchStatus
from batches.models import Batch, BatchFile
from batches.services import BatchError
from costing.services import batch_price, list_price_at
from inferops.audit import audit_record, snapshot
from inferops.roles import OPERATOR, has_role, require_operator
from inferops.timeparse import format_duration
from tenants.models import Tenant

BATCHES_PER_PAGE = 50
CANCELLABLE = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)
MTOK = Decimal(1_000_000)


@dataclass
class BatchRow:
    """One batch as the console shows it: progress, ETA and cost so far at its batch price."""

    batch: Batch
    now: datetime
    # $ per million (prompt, completion) tokens, the list price less its batch discount, at the batch's
    # creation; None where the deployment has no list price (or the batch has no model yet).
    price: tuple[Decimal, Decimal] | None

    @property
    def percent(self) -> int:
        batch = self.batch
        return min(100, 100 * batch.finished // batch.total) if batch.total else 0

    @property
    def eta_seconds(self) -> float | None:
        """The time left at the rate lines finished since the batch went in progress; None when unknown."""
        batch = self.batch
        if batch.status != BatchStatus.IN_PROGRESS or batch.in_progress_at is None or not batch.finished:
            return None
        elapsed = (self.now - batch.in_progress_at).total_seconds()
        if elapsed <= 0:
            return None
        remaining = max(0, batch.total - batch.finished)
        return remaining / (batch.finished / elapsed)

    @property
    def eta(self) -> str:
        seconds = self.eta_seconds
        if seconds is None:
            return "—"
        # Seconds matter for a short wait only; five minutes away and more reads to the minute.
        return format_duration(round(seconds) if seconds < 300 else round(seconds / 60) * 60)

    @property
    def cost(self) -> Decimal | None:
        if self.price is None:
            return None
        prompt, completion = self.price
        spent = (self.batch.prompt_tokens * prompt + self.batch.completion_tokens * completion) / MTOK
        return spent.quantize(Decimal("0.0001"))

    @property
    def cancellable(self) -> bool:
        return self.batch.status in CANCELLABLE


def price_of(batch: Batch) -> tuple[Decimal, Decimal] | None:
    if not batch.model:
        return None
    return batch_price(batch.model, batch.tenant.name, batch.created_at)


def batch_rows(batches, now: datetime | None = None) -> list[BatchRow]:
    """Rows for `batches` (with their tenants selected); one price lookup per deployment, tenant and time."""
    now = now or timezone.now()
    return [BatchRow(batch, now, price_of(batch)) for batch in batches]


def batch_queryset():
    return Batch.objects.select_related("tenant", "input_file", "output_file", "error_file")


@never_cache  # it refreshes itself while batches run (partials/live.html)
@login_required
def batch_list(request):
    """Every tenant's batches, newest first, filtered by tenant and status."""
    filters = {key: request.GET.get(key, "").strip() for key in ("tenant", "status")}
    batches = batch_queryset().order_by("-created_at", "-id")
    if filters["tenant"]:
        batches = batches.filter(tenant__name=filters["tenant"])
    if filters["status"] in BatchStatus.values:
        batches = batches.filter(status=filters["status"])
    else:
        filters["status"] = ""
    page = Paginator(batches, BATCHES_PER_PAGE).get_page(request.GET.get("page"))
    return render(request, "batches/list.html", {
        "page": page, "rows": batch_rows(page.object_list), "filters": filters, "filtered": any(filters.values()),
        "tenants": Tenant.objects.order_by("name").values_list("name", flat=True),
        "statuses": BatchStatus.choices,
    })


@never_cache
@login_required
def batch_detail(request, batch_id: str):
    """One batch in full; a POST cancels it (an operator's)."""
    batch = get_object_or_404(batch_queryset(), pk=batch_id)
    if request.method == "POST":
        return cancel(request, batch)
    row = BatchRow(batch, timezone.now(), price_of(batch))
    list_price = list_price_at(batch.model, batch.tenant.name, batch.created_at) if batch.model else None
    return render(request, "batches/detail.html", {
        "row": row, "batch": batch, "list_price": list_price,
        "active": batch.status not in (BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED,
                                       BatchStatus.CANCELLED),
        "can_cancel": row.cancellable and has_role(request.user, OPERATOR),
        "waiting": batch.last_error.startswith("Waiting"),
    })


def cancel(request, batch: Batch):
    require_operator(request, "Cancelling batches")
    try:
        with transaction.atomic():
            before = snapshot(batch)
            batch = services.batch_cancel(batch=batch)
            audit_record(actor=request.user, action="batch.cancel", obj=batch, before=before, after=snapshot(batch))
    except BatchError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"Batch {batch.id}: cancel asked; the lines already finished are kept in its "
                                  "output.")
    return redirect("batch-detail", batch_id=batch.id)


@login_required
def file_download(request, file_id: str):
    """A batch file's bytes (input, output or errors) as an attachment."""
    file = get_object_or_404(BatchFile, pk=file_id)
    try:
        handle = services.storage().open(file.storage_name, "rb")
    except FileNotFoundError:
        raise Http404(f"The bytes of file {file.id} are no longer in the batch files' storage.") from None
    return FileResponse(handle, as_attachment=True, filename=file.filename, content_type="application/jsonl")

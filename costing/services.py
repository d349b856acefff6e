"""Costing operations: the price book, list prices, budgets and their alerts, month close and the
adjustments that late data book into the open month. Each write is audited in its transaction."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import Case, When
from django.utils import timezone

from costing.choices import FIXED_RESOURCES, Tier
from costing.ledger import LOCK_NAMESPACE, SyncReport, ledger_sync, ledger_through, resources_held
from costing.models import Adjustment, Budget, ClosedMonth, ListPrice, Price
from costing.report import (
    Cell,
    adjustments_booked,
    build_report,
    compute_cells,
    month_range,
    month_start,
    next_month,
    report_data,
)
from inferops.api import Conflict
from inferops.audit import actor_or_none, audit_record, snapshot
from inferops.celery import enqueue
from inferops.locks import advisory_xact_lock, try_advisory_lock

log = logging.getLogger(__name__)

RESOURCE_RE = re.compile(r"^(cpu|memory|gpu:[A-Za-z0-9][A-Za-z0-9._-]{0,98}|node:[A-Za-z0-9][A-Za-z0-9._:-]{0,98})$")
BUDGET_ALERT = "CostBudgetThreshold"
CLOSE_LOCK_KEY = 2
PRICE_LOCK_KEY = 3
DEFAULT_BATCH_DISCOUNT = Decimal(50)  # percent, as OpenAI's Batch API


def closed_through() -> datetime | None:
    """The end of the last closed month: nothing before it may change."""
    last = ClosedMonth.objects.order_by("-month").values_list("month", flat=True).first()
    return next_month(month_start(last)) if last else None


# ---------------------------------------------------------------------------- prices


def validate_resource(resource: str) -> str:
    if not isinstance(resource, str) or not RESOURCE_RE.match(resource):
        raise ValidationError({"resource": [
            f"Unknown resource {resource!r}: use {', '.join(FIXED_RESOURCES)}, gpu:<gpu_type> (e.g. gpu:H100) "
            "or node:<node name>."]})
    return resource


def _overlaps(a_from, a_to, b_from, b_to) -> bool:
    return (b_to is None or a_from < b_to) and (a_to is None or b_from < a_to)


def price_create(*, resource: str, usd_per_hour: Decimal, effective_from: datetime, actor,
                 tier: str = Tier.ON_DEMAND, effective_to: datetime | None = None, note: str = "") -> Price:
    """Add a price. An open-ended price of the same resource and tier that started earlier ends
    where this one starts (a price change); any other overlap is refused."""
    validate_resource(resource)
    if tier not in Tier.values:
        raise ValidationError({"tier": [f"Unknown tier {tier!r}: use one of {', '.join(Tier.values)}."]})
    if usd_per_hour is None or usd_per_hour < 0:
        raise ValidationError({"usd_per_hour": ["A price cannot be negative."]})
    if effective_to is not None and effective_to <= effective_from:
        raise ValidationError({"effective_to": ["effective_to must come after effective_from."]})
    with transaction.atomic():
        advisory_xact_lock(LOCK_NAMESPACE, PRICE_LOCK_KEY)
        closed = closed_through()
        if closed and effective_from < closed:
            raise ValidationError({"effective_from": [
                f"{effective_from:%Y-%m-%d %H:%M} lies in a closed month (closed through {closed:%Y-%m-%d}): "
                "a price change never rewrites a closed month."]})
        same = list(Price.objects.select_for_update().filter(resource=resource, tier=tier))
        successor_of = None
        for price in same:
            if price.effective_to is None and price.effective_from < effective_from and \
                    not any(p.effective_from > price.effective_from for p in same):
                successor_of = price
                continue
            if _overlaps(effective_from, effective_to, price.effective_from, price.effective_to):
                until = f"{price.effective_to:%Y-%m-%d %H:%M}" if price.effective_to else "open-ended"
                raise ValidationError({"effective_from": [
                    f"Overlaps the {tier} price of {resource} effective from "
                    f"{price.effective_from:%Y-%m-%d %H:%M} ({until})."]})
        if successor_of is not None:
            before = snapshot(successor_of)
            successor_of.effective_to = effective_from
            successor_of.save(update_fields=["effective_to"])
            audit_record(actor=actor, action="price.end", obj=successor_of, before=before, after=snapshot(successor_of))
        price = Price.objects.create(resource=resource, tier=tier, usd_per_hour=usd_per_hour,
                                     effective_from=effective_from, effective_to=effective_to, note=note,
                                     created_by=actor_or_none(actor))
        audit_record(actor=actor, action="price.create", obj=price, after=snapshot(price))
        transaction.on_commit(request_ledger_rebuild_from(effective_from))
    return price


def price_warnings(price: Price, *, held: set[str] | None = None) -> list[str]:
    """What looks wrong with a price without being refused: a start back-dated into a month that
    had ended when it was added (its report changes after people read it), and a resource no
    replica holds (a typo, or a GPU type no deployment asks for: it charges nothing).
    `held`: resources_held(), when checking many prices."""
    warnings = []
    added_in = month_start(price.created_at.date())
    if price.effective_from < added_in:
        month = f"{price.effective_from:%Y-%m}"
        warnings.append(
            f"Back-dated into {month}, a month that had ended when this price was added: the {month} cost "
            "report changes (it was not closed yet), and copies already read or exported show other amounts.")
    held = resources_held() if held is None else held
    if price.resource not in held:
        kind = price.resource.split(":", 1)[0]
        same_kind = sorted(name.split(":", 1)[1] for name in held if name.startswith(f"{kind}:"))
        hint = f" ({'GPU types' if kind == 'gpu' else 'nodes'} in use: {', '.join(same_kind)})" if same_kind else ""
        warnings.append(
            f"No replica holds {price.resource}: no deployment's resources ask for it and no replica has run "
            f"with it, so this price charges nothing{hint}.")
    return warnings


def price_delete(*, price: Price, actor, now: datetime | None = None) -> None:
    """Only a price that has not started yet: one already charged is ended by a new price."""
    now = now or timezone.now()
    if price.effective_from <= now:
        raise Conflict("This price has been charged already; add a new price to change it from now on.")
    with transaction.atomic():
        before = snapshot(price)
        audit_record(actor=actor, action="price.delete", obj=price, before=before)
        price.delete()


def request_ledger_rebuild_from(start: datetime):
    """A price that starts in the past changes cost rows already written: rewrite them."""

    def rebuild():
        if start < timezone.now():
            enqueue("costing.rebuild_costs", start.isoformat())  # by name: costing.tasks imports this module

    return rebuild


def list_price_create(*, deployment: str, usd_per_mtok_prompt: Decimal, usd_per_mtok_completion: Decimal,
                      effective_from: datetime, actor, tenant: str = "",
                      batch_discount_percent: Decimal = DEFAULT_BATCH_DISCOUNT) -> ListPrice:
    errors = {}
    for name, value in (("usd_per_mtok_prompt", usd_per_mtok_prompt),
                        ("usd_per_mtok_completion", usd_per_mtok_completion)):
        if value is None or value < 0:
            errors[name] = ["A list price cannot be negative."]
    if batch_discount_percent is None or not 0 <= batch_discount_percent <= 100:
        errors["batch_discount_percent"] = ["A batch discount is a percentage from 0 to 100."]
    if errors:
        raise ValidationError(errors)
    try:
        with transaction.atomic():
            price = ListPrice.objects.create(
                deployment=deployment, tenant=tenant, usd_per_mtok_prompt=usd_per_mtok_prompt,
                usd_per_mtok_completion=usd_per_mtok_completion, batch_discount_percent=batch_discount_percent,
                effective_from=effective_from, created_by=actor_or_none(actor))
            audit_record(actor=actor, action="list-price.create", obj=price, after=snapshot(price))
    except IntegrityError:
        raise Conflict("A list price for this deployment and tenant already starts then.") from None
    return price


def list_price_at(deployment: str, tenant: str, at: datetime) -> ListPrice | None:
    """The list price a tenant pays on a deployment at `at`: its own, else the deployment's, whichever
    started last before then (the report's revenue SQL chooses the same way)."""
    return (ListPrice.objects.filter(deployment=deployment, tenant__in=(tenant, ""), effective_from__lte=at)
            .order_by(Case(When(tenant=tenant, then=0), default=1), "-effective_from").first())


def batch_price(deployment: str, tenant: str, at: datetime) -> tuple[Decimal, Decimal] | None:
    """$ per million (prompt, completion) tokens a line of an offline batch pays at `at`: the list
    price less its batch discount; None where the deployment has no list price."""
    price = list_price_at(deployment, tenant, at)
    return None if price is None else price.batch_prices()


# ---------------------------------------------------------------------------- budgets


def validate_thresholds(thresholds) -> list[int]:
    if not isinstance(thresholds, list | tuple) or not thresholds or len(thresholds) > 10:
        raise ValidationError({"thresholds": ["Give 1 to 10 percentages, e.g. [50, 80, 100]."]})
    if any(isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= 1000 for t in thresholds):
        raise ValidationError({"thresholds": ["Each threshold is a whole percentage from 1 to 1000."]})
    return sorted(set(thresholds))


def budget_create(*, tenant, monthly_usd: Decimal, actor, thresholds=(50, 80, 100), deployment: str = "") -> Budget:
    if monthly_usd is None or monthly_usd <= 0:
        raise ValidationError({"monthly_usd": ["A monthly budget must be more than zero."]})
    budget = Budget(tenant=tenant, deployment=deployment, monthly_usd=monthly_usd,
                    thresholds=validate_thresholds(list(thresholds)), created_by=actor_or_none(actor))
    try:
        with transaction.atomic():
            budget.save()
            audit_record(actor=actor, action="budget.create", obj=budget, after=snapshot(budget))
    except IntegrityError:
        scope = f"{tenant.name} on {deployment}" if deployment else tenant.name
        raise Conflict(f"{scope} has a budget already; change it instead.") from None
    transaction.on_commit(_evaluate_budgets_later)
    return budget


def budget_update(*, budget: Budget, actor, monthly_usd: Decimal | None = None, thresholds=None) -> Budget:
    with transaction.atomic():
        locked = Budget.objects.select_for_update().select_related("tenant").get(pk=budget.pk)
        before = snapshot(locked)
        if monthly_usd is not None:
            if monthly_usd <= 0:
                raise ValidationError({"monthly_usd": ["A monthly budget must be more than zero."]})
            locked.monthly_usd = monthly_usd
        if thresholds is not None:
            locked.thresholds = validate_thresholds(list(thresholds))
        locked.save()
        audit_record(actor=actor, action="budget.update", obj=locked, before=before, after=snapshot(locked))
    transaction.on_commit(_evaluate_budgets_later)
    return locked


def budget_delete(*, budget: Budget, actor) -> None:
    with transaction.atomic():
        audit_record(actor=actor, action="budget.delete", obj=budget, before=snapshot(budget))
        budget.delete()
    transaction.on_commit(_evaluate_budgets_later)


def _evaluate_budgets_later() -> None:
    enqueue("costing.evaluate_budgets")


@dataclass
class BudgetChanges:
    firing: int = 0
    resolved: int = 0


def budget_alert_labels(budget: Budget, threshold: int, basis: str, month: date) -> dict[str, str]:
    labels = {"alertname": BUDGET_ALERT, "severity": "ticket", "tenant": budget.tenant.name,
              "threshold": str(threshold), "basis": basis, "month": month.strftime("%Y-%m")}
    if budget.deployment:
        labels["deployment"] = budget.deployment
    return labels


def budgets_evaluate(*, now: datetime) -> BudgetChanges:
    """Open (or keep) one ticket per budget threshold crossed by actual or forecast spend this
    month; resolve the rest (a new month, a raised budget, a deleted one)."""
    from alerts.choices import OPEN_STATUSES, Severity
    from alerts.models import Alert, fingerprint_of
    from alerts.services import alert_raise, alert_resolve

    start, end = month_range(now.date())
    through = min(ledger_through() or now, now)
    cells = [c for c in compute_cells(start, through) + adjustments_booked(start, end) if c.tenant]
    spend: dict[tuple[str, str], Decimal] = {}
    for cell in cells:
        for key in ((cell.tenant, ""), (cell.tenant, cell.deployment)):
            spend[key] = spend.get(key, Decimal(0)) + cell.usd
    elapsed = (through - start).total_seconds()
    from django.conf import settings

    forecast_ok = elapsed >= settings.INFEROPS_COST_FORECAST_MIN_HOURS * 3600
    factor = Decimal((end - start).total_seconds()) / Decimal(elapsed) if elapsed > 0 else Decimal(0)
    changes = BudgetChanges()
    wanted = set()
    for budget in Budget.objects.select_related("tenant"):
        actual = spend.get((budget.tenant.name, budget.deployment), Decimal(0))
        forecast = actual * factor
        for threshold in budget.thresholds:
            limit = budget.monthly_usd * threshold / 100
            basis = "actual" if actual >= limit else ("forecast" if forecast_ok and forecast >= limit else None)
            if basis is None:
                continue
            labels = budget_alert_labels(budget, threshold, basis, start.date())
            scope = f"{budget.tenant.name} on {budget.deployment}" if budget.deployment else budget.tenant.name
            shown = actual if basis == "actual" else forecast
            annotations = {
                "summary": f"{scope}: {basis} spend ${shown.quantize(Decimal('0.01'))} is {threshold}% or more "
                           f"of the ${budget.monthly_usd} monthly budget",
                "description": (f"Spent ${actual.quantize(Decimal('0.01'))} in {start:%Y-%m} so far; at this rate "
                                f"${forecast.quantize(Decimal('0.01'))} by the month's end. Budget "
                                f"${budget.monthly_usd}, threshold {threshold}%."),
                "spend_usd": str(actual.quantize(Decimal("0.0001"))),
                "forecast_usd": str(forecast.quantize(Decimal("0.0001"))),
                "budget_usd": str(budget.monthly_usd),
            }
            alert_raise(labels=labels, annotations=annotations, severity=Severity.TICKET, now=now)
            wanted.add(fingerprint_of(labels))
            changes.firing += 1
    for alert in Alert.objects.filter(status__in=OPEN_STATUSES, labels__alertname=BUDGET_ALERT):
        if alert.fingerprint not in wanted:
            alert_resolve(alert=alert, now=now)
            changes.resolved += 1
    return changes


# ---------------------------------------------------------------------------- month close


def month_close(*, month: date, now: datetime) -> ClosedMonth:
    """Freeze a finished month's report (idempotent: a closed month is returned as it is)."""
    start, end = month_range(month)
    if end > now:
        raise ValidationError({"month": [f"{month:%Y-%m} has not ended yet."]})
    with try_advisory_lock(LOCK_NAMESPACE, CLOSE_LOCK_KEY) as acquired:
        existing = ClosedMonth.objects.filter(month=start.date()).first()
        if existing is not None or not acquired:
            if existing is None:
                raise Conflict("Another worker is closing a month right now.")
            return existing
        ledger_sync(now)  # the ledger covers the whole month before it is frozen
        through = ledger_through()
        if through is None or through < end:
            raise Conflict("The ledger has not caught up with the month's end yet; the close is retried.")
        cells, daily = report_data(start, end)
        report = build_report(start, end, cells, daily=daily,
                              adjustments=adjustments_booked(start, end), ledger_through=end)
        report["closed"] = True
        report["closed_at"] = now.isoformat()
        with transaction.atomic():
            closed = ClosedMonth.objects.create(month=start.date(), closed_at=now, report=report,
                                                cells=[cell.as_json() for cell in cells])
            audit_record(actor=None, action="cost-month.close", obj=closed,
                         after={"month": start.date().isoformat(), "total_usd": report["total_usd"]})
    log.info("closed cost month %s: $%s", start.strftime("%Y-%m"), report["total_usd"])
    return closed


def months_to_close(now: datetime) -> list[date]:
    """Finished months with ledger rows and no close yet, oldest first."""
    from costing.models import CostHour, UsageHour

    current = month_start(now.date())
    first_hours = [t for t in (CostHour.objects.order_by("hour").values_list("hour", flat=True).first(),
                               UsageHour.objects.order_by("hour").values_list("hour", flat=True).first()) if t]
    if not first_hours:
        return []
    cursor = month_start(min(first_hours).date())
    closed = set(ClosedMonth.objects.values_list("month", flat=True))
    months = []
    while cursor < current:
        if cursor.date() not in closed:
            months.append(cursor.date())
        cursor = next_month(cursor)
    return months


def ledger_sync_and_book(*, now: datetime) -> dict:
    """The minute's ledger sync, then the adjustments it found, in one hold of the ledger lock:
    a second sync at once skips, so it can neither book what this one books nor change the ledger
    under the booking. The beat job."""
    with try_advisory_lock(LOCK_NAMESPACE) as acquired:
        if not acquired:
            return SyncReport(skipped=True).as_dict()
        report = ledger_sync(now)  # takes the lock again: a session's advisory locks nest
        result = report.as_dict()
        if report.earliest_change is not None:
            result["adjustments"] = adjustments_book(since=report.earliest_change, now=now)
    return result


def adjustments_book(*, since: datetime, now: datetime) -> int:
    """Compare each closed month ending after `since` with its frozen figures (plus adjustments
    already booked for it) and book the difference in the open month. Running it twice books
    nothing the second time, at once included: it books under the ledger lock."""
    booked = 0
    open_month = month_start(now.date()).date()
    with transaction.atomic():
        # Read, compare and write as one holder of the ledger: two bookers that both read the
        # adjustments before either wrote would book the same correction twice.
        advisory_xact_lock(LOCK_NAMESPACE)
        for closed in ClosedMonth.objects.filter(month__gte=month_start(since.date()).date()):
            booked += _adjustments_book_month(closed, open_month)
    return booked


def _adjustments_book_month(closed: ClosedMonth, open_month: date) -> int:
    """Book, in `open_month`, what one closed month's figures moved by since they were frozen."""
    start, end = month_range(closed.month)
    known: dict[tuple, Cell] = {}
    for cell in [Cell.from_json(c) for c in closed.cells]:
        known[cell.key()] = cell
    for adj in Adjustment.objects.filter(source_month=closed.month):
        cell = known.setdefault((adj.tenant, adj.deployment, adj.version), Cell(
            tenant=adj.tenant or None, deployment=adj.deployment, version=adj.version, model=adj.model))
        cell.usd += adj.usd
        cell.prompt_tokens += adj.prompt_tokens
        cell.completion_tokens += adj.completion_tokens
        cell.compliant_tokens += adj.compliant_tokens
        cell.batch_prompt_tokens += adj.batch_prompt_tokens
        cell.batch_completion_tokens += adj.batch_completion_tokens
        cell.batch_usd += adj.batch_usd
    now_cells = {cell.key(): cell for cell in compute_cells(start, end)}
    rows = []
    for key in set(known) | set(now_cells):
        new = now_cells.get(key)
        old = known.get(key)
        template = new or old
        delta = Adjustment(
            booked_month=open_month, source_month=closed.month, tenant=template.tenant or "",
            deployment=template.deployment, version=template.version, model=template.model,
            usd=(new.usd if new else Decimal(0)) - (old.usd if old else Decimal(0)),
            prompt_tokens=(new.prompt_tokens if new else 0) - (old.prompt_tokens if old else 0),
            completion_tokens=(new.completion_tokens if new else 0) - (old.completion_tokens if old else 0),
            compliant_tokens=(new.compliant_tokens if new else 0) - (old.compliant_tokens if old else 0),
            batch_prompt_tokens=(new.batch_prompt_tokens if new else 0) - (old.batch_prompt_tokens if old else 0),
            batch_completion_tokens=((new.batch_completion_tokens if new else 0)
                                     - (old.batch_completion_tokens if old else 0)),
            batch_usd=(new.batch_usd if new else Decimal(0)) - (old.batch_usd if old else Decimal(0)),
        )
        if (delta.usd or delta.prompt_tokens or delta.completion_tokens or delta.compliant_tokens
                or delta.batch_prompt_tokens or delta.batch_completion_tokens or delta.batch_usd):
            rows.append(delta)
    if rows:
        Adjustment.objects.bulk_create(rows)
        audit_record(actor=None, action="cost-month.adjust", obj=closed,
                     after={"booked_month": open_month.isoformat(), "rows": len(rows)})
    return len(rows)

"""Monthly (or any hourly) cost reports, from the ledger: allocation, unit economics, exports.

Allocation: each deployment version's cost in each hour is split between the tenants by their
share of weighted tokens in that hour (`prompt × INFEROPS_COST_PROMPT_WEIGHT + completion ×
INFEROPS_COST_COMPLETION_WEIGHT`). An hour with no tokens is idle: its cost is its own line.

Lines of offline batches are usage like any other: their tokens take their share of the cost the
same way (`batch_usd` is that share), and revenue charges them at the batch price, the list
price less its `batch_discount_percent`.

GPU-hours are the ledger's (minutes x GPUs held); their busy share comes from the GPU telemetry
(costing/gpu_usage.py), over the GPU-minutes it covered; the rest is "not measured", never idle.

Rounding happens once, on the finest cells (tenant × deployment × version, and idle ×
deployment × version), by the largest-remainder method, so every grouping built from the
rounded cells (by tenant, by deployment, the CSV, the total) adds up to the cent and beyond.
"""

from __future__ import annotations

import copy
import csv
import io
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_FLOOR, ROUND_HALF_EVEN, Decimal

from django.conf import settings
from django.db import connection, transaction

from costing.choices import RESOURCE_UNITS
from costing.gpu_usage import gpu_minutes
from costing.models import Adjustment, ClosedMonth, ListPrice, Price
from inferops import numbers

PLACES = Decimal("0.0001")  # amounts in reports: hundredths of a cent
CENTS = Decimal("0.01")  # amounts as people read them (the console, the PDF)
RATE_PLACES = Decimal("0.0001")  # $ per million tokens
MILLION = Decimal(1_000_000)
CURRENCY = "USD"
REPORT_WORK_MEM = "64MB"
# A price entered more than this after it took effect rewrote figures someone may have read already.
BACKDATE_GRACE = timedelta(hours=1)


def weights() -> tuple[Decimal, Decimal]:
    return (Decimal(str(settings.INFEROPS_COST_PROMPT_WEIGHT)), Decimal(str(settings.INFEROPS_COST_COMPLETION_WEIGHT)))


def month_start(day: date) -> datetime:
    return datetime(day.year, day.month, 1, tzinfo=UTC)


def next_month(start: datetime) -> datetime:
    return datetime(start.year + (start.month == 12), start.month % 12 + 1, 1, tzinfo=UTC)


SHARE_PLACES = Decimal("0.0001")  # a share (0..1), as the GPU busy share


def hours(minutes: float) -> str:
    return str((Decimal(str(minutes)) / 60).quantize(Decimal("0.01"), rounding=ROUND_HALF_EVEN))


def money(value: Decimal | None) -> str | None:
    return None if value is None else str(value.quantize(PLACES, rounding=ROUND_HALF_EVEN))


def per_mtok(usd: Decimal, tokens: Decimal | int) -> str | None:
    if not tokens:
        return None
    return str((usd * MILLION / Decimal(tokens)).quantize(RATE_PLACES, rounding=ROUND_HALF_EVEN))


# ---------------------------------------------------------------------------- cells


@dataclass
class Cell:
    """One tenant's (or the idle line's, tenant None) figures on one deployment version."""

    tenant: str | None
    deployment: str
    version: int
    model: str
    usd: Decimal = Decimal(0)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    compliant_tokens: int = 0
    replica_minutes: int = 0
    revenue: Decimal | None = None
    adjustment_from: str | None = None  # "YYYY-MM" of the closed month it corrects
    # Offline batches' part of the tokens, of the cost and of the revenue (at the batch price).
    batch_prompt_tokens: int = 0
    batch_completion_tokens: int = 0
    batch_usd: Decimal = Decimal(0)
    batch_revenue: Decimal | None = None
    # A version's GPU-minutes (on its idle line, as its replica minutes): held (the ledger's), measured
    # by GPU telemetry, busy (utilisation x measured), and held but not measured.
    gpu_minutes: int = 0
    gpu_measured_minutes: float = 0.0
    gpu_busy_minutes: float = 0.0
    gpu_unmeasured_minutes: float = 0.0

    def key(self) -> tuple:
        return (self.tenant or "", self.deployment, self.version)

    def as_json(self) -> dict:
        return {"tenant": self.tenant, "deployment": self.deployment, "version": self.version, "model": self.model,
                "usd": str(self.usd), "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "compliant_tokens": self.compliant_tokens,
                "replica_minutes": self.replica_minutes,
                "revenue": None if self.revenue is None else str(self.revenue),
                "adjustment_from": self.adjustment_from, "batch_prompt_tokens": self.batch_prompt_tokens,
                "batch_completion_tokens": self.batch_completion_tokens, "batch_usd": str(self.batch_usd),
                "batch_revenue": None if self.batch_revenue is None else str(self.batch_revenue),
                "gpu_minutes": self.gpu_minutes, "gpu_measured_minutes": self.gpu_measured_minutes,
                "gpu_busy_minutes": self.gpu_busy_minutes, "gpu_unmeasured_minutes": self.gpu_unmeasured_minutes}

    @classmethod
    def from_json(cls, data: dict) -> Cell:
        return cls(tenant=data["tenant"], deployment=data["deployment"], version=data["version"], model=data["model"],
                   usd=Decimal(data["usd"]), prompt_tokens=data["prompt_tokens"],
                   completion_tokens=data["completion_tokens"], compliant_tokens=data["compliant_tokens"],
                   replica_minutes=data["replica_minutes"],
                   revenue=None if data.get("revenue") is None else Decimal(data["revenue"]),
                   # Months closed before batches were billed stored no batch figures: they had none.
                   batch_prompt_tokens=data.get("batch_prompt_tokens", 0),
                   batch_completion_tokens=data.get("batch_completion_tokens", 0),
                   batch_usd=Decimal(data.get("batch_usd") or 0),
                   batch_revenue=None if data.get("batch_revenue") is None else Decimal(data["batch_revenue"]),
                   # Months closed before GPU telemetry stored no GPU figures.
                   gpu_minutes=data.get("gpu_minutes", 0),
                   gpu_measured_minutes=data.get("gpu_measured_minutes", 0.0),
                   gpu_busy_minutes=data.get("gpu_busy_minutes", 0.0),
                   gpu_unmeasured_minutes=data.get("gpu_unmeasured_minutes", 0.0))


# Per (deployment, version, hour), a slot: its cost, replica minutes and weighted tokens. A slot
# without tokens is idle. Reports aggregate the slots in Postgres: a month is ~10^4-10^5 of them.
_SLOTS = """
    CREATE TEMPORARY TABLE report_slots ON COMMIT DROP AS
    WITH cost AS (
        SELECT deployment, version, hour, max(model) AS model, sum(usd) AS usd, sum(minutes) AS minutes
        FROM costing_costhour WHERE hour >= %(start)s AND hour < %(end)s
        GROUP BY 1, 2, 3
    ), busy AS (
        SELECT deployment, version, hour, sum(prompt_tokens) AS prompt, sum(completion_tokens) AS completion
        FROM costing_usagehour WHERE hour >= %(start)s AND hour < %(end)s
        GROUP BY 1, 2, 3
    )
    SELECT deployment, version, hour, model, coalesce(usd, 0) AS usd, coalesce(minutes, 0) AS minutes,
           coalesce(prompt, 0) + coalesce(completion, 0) AS tokens,
           %(wp)s * coalesce(prompt, 0) + %(wc)s * coalesce(completion, 0) AS weight
    FROM cost FULL JOIN busy USING (deployment, version, hour)
"""
# Per deployment version: its model, replica minutes and idle cost.
_VERSION_SLOTS = """
    SELECT deployment, version, coalesce(max(model), ''), sum(minutes), coalesce(sum(usd) FILTER (WHERE weight <= 0), 0)
    FROM report_slots GROUP BY 1, 2
"""
# Per UTC day and deployment: cost, idle cost, tokens.
_DAILY_SLOTS = """
    SELECT (hour AT TIME ZONE 'UTC')::date, deployment, sum(usd), coalesce(sum(usd) FILTER (WHERE weight <= 0), 0),
           sum(tokens)
    FROM report_slots GROUP BY 1, 2 ORDER BY 1, 2
"""
# Each tenant's share: the slot's cost per weighted token times the tenant's weighted tokens in it.
# The rate keeps 30 decimal places, so no cell moves by 10^-20 dollars before rounding.
_TENANT_CELLS = """
    SELECT u.tenant, u.deployment, u.version,
           coalesce(sum(r.rate * (%(wp)s * u.prompt_tokens + %(wc)s * u.completion_tokens)), 0),
           sum(u.prompt_tokens), sum(u.completion_tokens),
           sum(u.compliant_prompt_tokens + u.compliant_completion_tokens),
           coalesce(sum(r.rate * (%(wp)s * u.batch_prompt_tokens + %(wc)s * u.batch_completion_tokens)), 0),
           sum(u.batch_prompt_tokens), sum(u.batch_completion_tokens)
    FROM costing_usagehour u
    LEFT JOIN (SELECT deployment, version, hour, usd::numeric(60, 30) / weight AS rate
               FROM report_slots WHERE weight > 0) r USING (deployment, version, hour)
    WHERE u.hour >= %(start)s AND u.hour < %(end)s
    GROUP BY 1, 2, 3
"""
# Revenue at list prices: each usage hour at the tenant's own list price of the deployment, else
# the deployment's, whichever started last before the hour; batch tokens at that price less its
# batch discount. Columns: interactive revenue, batch revenue.
_REVENUE = """
    SELECT u.tenant, u.deployment, u.version,
           sum(((u.prompt_tokens - u.batch_prompt_tokens) * p.usd_per_mtok_prompt
                + (u.completion_tokens - u.batch_completion_tokens) * p.usd_per_mtok_completion) / 1000000),
           sum((u.batch_prompt_tokens * p.usd_per_mtok_prompt + u.batch_completion_tokens * p.usd_per_mtok_completion)
               * (100 - p.batch_discount_percent) / 100000000)
    FROM costing_usagehour u
    CROSS JOIN LATERAL (
        SELECT usd_per_mtok_prompt, usd_per_mtok_completion, batch_discount_percent FROM costing_listprice l
        WHERE l.deployment = u.deployment AND (l.tenant = u.tenant OR l.tenant = '') AND l.effective_from <= u.hour
        ORDER BY (l.tenant = u.tenant) DESC, l.effective_from DESC LIMIT 1
    ) p
    WHERE u.hour >= %(start)s AND u.hour < %(end)s
    GROUP BY 1, 2, 3
"""


def _roomy(cursor) -> None:
    """A month is ~10^5-10^6 usage rows: with Postgres' default 4 MB per sort or hash, they spill
    to disk and the report takes twice as long. Only for this transaction."""
    cursor.execute(f"SET LOCAL work_mem = '{REPORT_WORK_MEM}'")


def report_data(start: datetime, end: datetime) -> tuple[list[Cell], list[dict]]:
    """Exact (unrounded) cells of [start, end), hours, and its daily series, from one pass over the
    period's slots."""
    wp, wc = weights()
    models = _model_names()
    params = {"start": start, "end": end, "wp": wp, "wc": wc}
    with transaction.atomic(), connection.cursor() as cursor:
        _roomy(cursor)
        # A report inside a longer transaction (a month close) may come twice before the commit.
        cursor.execute("DROP TABLE IF EXISTS pg_temp.report_slots")
        cursor.execute(_SLOTS, params)
        cursor.execute(_VERSION_SLOTS)
        idle = {(deployment, version): Cell(tenant=None, deployment=deployment, version=version,
                                            model=model or models.get(deployment, ""), usd=Decimal(idle_usd),
                                            replica_minutes=int(minutes))
                for deployment, version, model, minutes, idle_usd in cursor.fetchall()}
        cursor.execute(_DAILY_SLOTS)
        daily = _daily_series(cursor.fetchall())
        cursor.execute(_TENANT_CELLS, params)
        rows = cursor.fetchall()
        revenue = {}
        if ListPrice.objects.exists():
            cursor.execute(_REVENUE, params)
            revenue = {(t, d, v): (usd, batch_usd) for t, d, v, usd, batch_usd in cursor.fetchall()}
        cursor.execute("DROP TABLE report_slots")
    for (deployment, version), gpus in gpu_minutes(start, end).items():
        cell = idle.setdefault((deployment, version), Cell(tenant=None, deployment=deployment, version=version,
                                                          model=models.get(deployment, "")))
        cell.gpu_minutes, cell.gpu_measured_minutes = gpus.held, gpus.measured
        cell.gpu_busy_minutes, cell.gpu_unmeasured_minutes = gpus.busy, gpus.not_measured
    cells = []
    for (tenant, deployment, version, usd, prompt, completion, compliant, batch_usd, batch_prompt,
         batch_completion) in rows:
        version_cell = idle.get((deployment, version))
        cell = Cell(tenant=tenant, deployment=deployment, version=version,
                    model=(version_cell and version_cell.model) or models.get(deployment, ""),
                    usd=Decimal(usd), prompt_tokens=int(prompt), completion_tokens=int(completion),
                    compliant_tokens=int(compliant), batch_usd=Decimal(batch_usd),
                    batch_prompt_tokens=int(batch_prompt), batch_completion_tokens=int(batch_completion))
        if revenue:
            interactive, batch = revenue.get((tenant, deployment, version), (0, 0))
            cell.batch_revenue = Decimal(batch)
            cell.revenue = Decimal(interactive) + cell.batch_revenue
        cells.append(cell)
    cells += [cell for cell in idle.values() if cell.usd or cell.replica_minutes or cell.gpu_minutes]
    return [c for c in cells if c.usd or c.prompt_tokens or c.completion_tokens or c.replica_minutes
            or c.gpu_minutes], daily


def compute_cells(start: datetime, end: datetime) -> list[Cell]:
    return report_data(start, end)[0]


def daily_series(start: datetime, end: datetime) -> list[dict]:
    return report_data(start, end)[1]


def _model_names() -> dict[str, str]:
    from deployments.models import Deployment

    return dict(Deployment.objects.values_list("name", "model__name"))


def apportion(exact: list[Decimal], places: Decimal = PLACES, total: Decimal | None = None) -> list[Decimal]:
    """Round each amount down to `places`, then give the units still missing from the rounded
    total (or `total`, already rounded and within a unit per part of theirs) to the largest
    remainders: the parts always add up to it."""
    if not exact:
        return []
    if total is None:
        total = sum(exact, Decimal(0)).quantize(places, rounding=ROUND_HALF_EVEN)
    floors = [value.quantize(places, rounding=ROUND_FLOOR) for value in exact]
    missing = int(((total - sum(floors, Decimal(0))) / places).to_integral_value())
    order = sorted(range(len(exact)), key=lambda i: (exact[i] - floors[i], -i), reverse=True)
    for i in order[:max(missing, 0)]:
        floors[i] += places
    return floors


# ---------------------------------------------------------------------------- the report


@dataclass
class Totals:
    usd: Decimal = Decimal(0)
    idle: Decimal = Decimal(0)
    prompt: int = 0
    completion: int = 0
    compliant: int = 0
    minutes: int = 0
    revenue: Decimal | None = None
    batch_tokens: int = 0
    batch_usd: Decimal = Decimal(0)
    batch_revenue: Decimal | None = None
    gpu_minutes: int = 0
    gpu_measured: float = 0.0
    gpu_busy: float = 0.0
    gpu_unmeasured: float = 0.0
    children: dict = field(default_factory=dict)

    def add(self, cell: Cell) -> None:
        self.usd += cell.usd
        if cell.tenant is None:
            self.idle += cell.usd
        self.prompt += cell.prompt_tokens
        self.completion += cell.completion_tokens
        self.compliant += cell.compliant_tokens
        self.minutes += cell.replica_minutes
        if cell.revenue is not None:
            self.revenue = (self.revenue or Decimal(0)) + cell.revenue
        self.batch_tokens += cell.batch_prompt_tokens + cell.batch_completion_tokens
        self.batch_usd += cell.batch_usd
        if cell.batch_revenue is not None:
            self.batch_revenue = (self.batch_revenue or Decimal(0)) + cell.batch_revenue
        self.gpu_minutes += cell.gpu_minutes
        self.gpu_measured += cell.gpu_measured_minutes
        self.gpu_busy += cell.gpu_busy_minutes
        self.gpu_unmeasured += cell.gpu_unmeasured_minutes

    def gpu_figures(self) -> dict:
        """GPU-hours held, measured by GPU telemetry, busy and not measured, and the busy share of the
        measured ones (null: not measured at all)."""
        share = None
        if self.gpu_measured > 0:
            share = str(Decimal(self.gpu_busy / self.gpu_measured).quantize(SHARE_PLACES, rounding=ROUND_HALF_EVEN))
        return {"gpu_hours": hours(self.gpu_minutes), "gpu_hours_measured": hours(self.gpu_measured),
                "gpu_hours_busy": hours(self.gpu_busy), "gpu_hours_not_measured": hours(self.gpu_unmeasured),
                "gpu_busy_share": share}

    def figures(self, *, gpus: bool = True) -> dict:
        wp, wc = weights()
        weighted = wp * self.prompt + wc * self.completion
        data = {
            "usd": money(self.usd), "idle_usd": money(self.idle), "busy_usd": money(self.usd - self.idle),
            "prompt_tokens": self.prompt, "completion_tokens": self.completion,
            "total_tokens": self.prompt + self.completion, "slo_compliant_tokens": self.compliant,
            "replica_hours": str((Decimal(self.minutes) / 60).quantize(Decimal("0.01"))),
            "usd_per_mtok": per_mtok(self.usd, self.prompt + self.completion),
            "usd_per_mtok_prompt": per_mtok(self.usd * wp, weighted) if self.prompt else None,
            "usd_per_mtok_completion": per_mtok(self.usd * wc, weighted) if self.completion else None,
            "usd_per_mtok_slo_compliant": per_mtok(self.usd, self.compliant),
            "revenue_usd": money(self.revenue),
            "margin_usd": money(self.revenue - self.usd) if self.revenue is not None else None,
            # Offline batches' part of the figures above (tokens, allocated cost, revenue at the batch price).
            "batch_tokens": self.batch_tokens, "batch_usd": money(self.batch_usd),
            "batch_revenue_usd": money(self.batch_revenue),
            # A tenant holds no GPUs: its lines leave the GPU figures out.
            **(self.gpu_figures() if gpus else {}),
        }
        return data


def _group(cells: list[Cell], key) -> dict:
    groups: dict = defaultdict(Totals)
    for cell in cells:
        groups[key(cell)].add(cell)
    return groups


def build_report(start: datetime, end: datetime, cells: list[Cell], *, daily: list[dict],
                 adjustments: list[Cell] = (), closed: ClosedMonth | None = None,
                 ledger_through: datetime | None = None) -> dict:
    """The report of rounded cells (and adjustments booked in the period)."""
    everything = [*cells, *adjustments]
    rounded = apportion([cell.usd for cell in everything])
    revenue = apportion([cell.revenue or Decimal(0) for cell in everything])
    batch_usd = apportion([cell.batch_usd for cell in everything])
    batch_revenue = apportion([cell.batch_revenue or Decimal(0) for cell in everything])
    rounded_cells = []
    for cell, usd, rev, b_usd, b_rev in zip(everything, rounded, revenue, batch_usd, batch_revenue, strict=True):
        rounded_cells.append(Cell(**{**cell.__dict__, "usd": usd, "revenue": None if cell.revenue is None else rev,
                                     "batch_usd": b_usd,
                                     "batch_revenue": None if cell.batch_revenue is None else b_rev}))
    total = Totals()
    for cell in rounded_cells:
        total.add(cell)
    tenants = _group([c for c in rounded_cells if c.tenant is not None], lambda c: c.tenant)
    by_tenant = []
    for name, totals in sorted(tenants.items(), key=lambda kv: (-kv[1].usd, kv[0])):
        deployments = _group([c for c in rounded_cells if c.tenant == name], lambda c: c.deployment)
        by_tenant.append({"tenant": name, **totals.figures(gpus=False), "deployments": [
            {"deployment": d, **t.figures(gpus=False)}
            for d, t in sorted(deployments.items(), key=lambda kv: (-kv[1].usd, kv[0]))
        ]})
    by_deployment = [
        {"deployment": name, "model": next(c.model for c in rounded_cells if c.deployment == name), **t.figures()}
        for name, t in sorted(_group(rounded_cells, lambda c: c.deployment).items(), key=lambda kv: (-kv[1].usd, kv[0]))
    ]
    by_version = [
        {"deployment": d, "version": v, **t.figures()}
        for (d, v), t in sorted(_group(rounded_cells, lambda c: (c.deployment, c.version)).items(),
                                key=lambda kv: (kv[0][0], kv[0][1]))
    ]
    by_model = [
        {"model": name, **t.figures()}
        for name, t in sorted(_group(rounded_cells, lambda c: c.model).items(), key=lambda kv: (-kv[1].usd, kv[0]))
    ]
    adjusted = [c for c in rounded_cells if c.adjustment_from]
    notes = []
    if adjusted:
        months = sorted({c.adjustment_from for c in adjusted})
        notes.append(f"Includes adjustments for closed month(s) {', '.join(months)}: usage or replica time that "
                     "arrived after the month was closed is booked here; the closed reports stay as they were.")
    notes += backdated_price_notes(start, end)
    figures = total.figures()
    wp, wc = weights()
    return {
        "start": start.isoformat(), "end": end.isoformat(), "currency": CURRENCY,
        "closed": closed is not None, "closed_at": closed.closed_at.isoformat() if closed else None,
        "ledger_through": ledger_through.isoformat() if ledger_through else None,
        "total_usd": figures["usd"], "idle_usd": figures["idle_usd"], "busy_usd": figures["busy_usd"],
        **{k: v for k, v in figures.items() if k not in ("usd", "idle_usd", "busy_usd")},
        "token_weights": {"prompt": str(wp), "completion": str(wc)},
        "by_tenant": by_tenant, "by_deployment": by_deployment, "by_model": by_model, "by_version": by_version,
        "daily": daily,
        "adjustments": [{"source_month": c.adjustment_from, "tenant": c.tenant, "deployment": c.deployment,
                         "version": c.version, "usd": money(c.usd), "prompt_tokens": c.prompt_tokens,
                         "completion_tokens": c.completion_tokens} for c in adjusted],
        "notes": notes,
        "rows": [{**c.as_json(), "usd": money(c.usd), "revenue": money(c.revenue), "batch_usd": money(c.batch_usd),
                  "batch_revenue": money(c.batch_revenue)} for c in rounded_cells],
    }


# ---------------------------------------------------------------------------- for readers


def allocation_method(report: dict) -> str:
    """How the report allocates shared and idle cost, as report_data and the ledger do it."""
    weights_used = report["token_weights"]
    return (
        "Each hour, a deployment version's cost (the GPU, CPU and memory its replicas held, at the prices "
        "below; a node's flat price split equally between the replicas on the node) is allocated to the tenants "
        "in proportion to their weighted tokens in that hour: prompt tokens x "
        f"{weights_used['prompt']} + completion tokens x {weights_used['completion']}. An hour of a version "
        "without tokens is idle: its cost goes to no tenant and is shown as its own line, idle (no traffic). "
        "Amounts are rounded once, by the largest-remainder method, so the rows add up to the totals.")


def gpu_busy_text(figures: dict) -> str:
    """How busy the GPU-hours of a report (or of one of its rows) were, as people read it: "61.2 %",
    "not measured" where no GPU telemetry covered them, and how many were not measured when some were
    not; "" where no GPU was held (or the month was closed before GPU telemetry)."""
    if not figures.get("gpu_hours") or Decimal(figures["gpu_hours"]) == 0:
        return ""
    share = figures.get("gpu_busy_share")
    if share is None:
        return NOT_MEASURED
    text = f"{Decimal(share) * 100:.1f} %"
    if Decimal(figures["gpu_hours_not_measured"]) > 0:
        text += f" ({numbers.grouped(figures['gpu_hours_not_measured'])} GPU-hours {NOT_MEASURED})"
    return text


def rate_text(value: Decimal) -> str:
    """A unit price with its own precision (a $0.000833 minute must not read $0.00), at least cents."""
    value = Decimal(value).normalize()
    return str(value.quantize(CENTS) if value.as_tuple().exponent > -2 else value)


def _prices_during(model, start: datetime, end: datetime):
    rows = model.objects.filter(effective_from__lt=end)
    return rows.filter(effective_to__isnull=True) | rows.filter(effective_to__gt=start) if model is Price else rows


def _unit(resource: str) -> str:
    return RESOURCE_UNITS.get(resource.split(":", 1)[0], "hour")


def prices_in_effect(start: datetime, end: datetime) -> list[dict]:
    """The price book's rows that priced [start, end), and the list prices charged in it."""
    rows = [{"what": f"{p.resource} ({p.tier})", "unit": _unit(p.resource), "usd": rate_text(p.usd_per_hour),
             "effective_from": p.effective_from, "effective_to": p.effective_to}
            for p in _prices_during(Price, start, end).order_by("resource", "tier", "effective_from")]
    list_prices = list(_prices_during(ListPrice, start, end).order_by("deployment", "tenant", "effective_from"))
    for i, lp in enumerate(list_prices):
        following = list_prices[i + 1] if i + 1 < len(list_prices) else None
        until = following.effective_from if following and (following.deployment, following.tenant) == (
            lp.deployment, lp.tenant) else None
        if until is not None and until <= start:
            continue  # superseded before the period began
        scope = f"list price {lp.deployment}, {lp.tenant or 'every tenant'}"
        batch_prompt, batch_completion = lp.batch_prices()
        for kind, amount in (("prompt", lp.usd_per_mtok_prompt), ("completion", lp.usd_per_mtok_completion)):
            rows.append({"what": f"{scope}, {kind}", "unit": f"1M {kind} tokens", "usd": rate_text(amount),
                         "effective_from": lp.effective_from, "effective_to": until})
        for kind, amount in (("prompt", batch_prompt), ("completion", batch_completion)):
            rows.append({"what": f"{scope}, batch {kind} ({lp.batch_discount_percent.normalize():f} % off)",
                         "unit": f"1M {kind} tokens", "usd": rate_text(amount),
                         "effective_from": lp.effective_from, "effective_to": until})
    return rows


def backdated_price_notes(start: datetime, end: datetime) -> list[str]:
    """A note per price that took effect in (or before) [start, end) but was entered later: the
    period's figures changed after the fact, and copies read before then differ."""
    notes = []
    for price in _prices_during(Price, start, end).order_by("effective_from", "resource"):
        since = max(price.effective_from, start)
        if price.created_at <= since + BACKDATE_GRACE:
            continue
        until = min(price.created_at, end)
        notes.append(
            f"Back-dated price: {price.resource} ({price.tier}) at ${rate_text(price.usd_per_hour)} per "
            f"{_unit(price.resource)} from {price.effective_from:%Y-%m-%d %H:%M} UTC was added on "
            f"{price.created_at:%Y-%m-%d %H:%M} UTC; the figures from {since:%Y-%m-%d %H:%M} to "
            f"{until:%Y-%m-%d %H:%M} UTC were recomputed with it, so copies of this report taken before then "
            "show other amounts.")
    return notes


def _cents(value: str | None) -> Decimal | None:
    return None if value is None else Decimal(value).quantize(CENTS, rounding=ROUND_HALF_EVEN)


def _table_in_cents(rows: list[dict], totals: dict[str, Decimal | None]) -> None:
    """Each money column of a table in cents, apportioned so the column adds up to its total."""
    for key, total in totals.items():
        present = [row for row in rows if row.get(key) is not None]
        if total is None or not present:
            continue
        for row, value in zip(present, apportion([Decimal(row[key]) for row in present], CENTS, total), strict=True):
            row[key] = str(value)
    for row in rows:
        if "idle_usd" in row:
            row["busy_usd"] = str(Decimal(row["usd"]) - Decimal(row["idle_usd"]))
        if row.get("revenue_usd") is not None:
            row["margin_usd"] = str(Decimal(row["revenue_usd"]) - Decimal(row["usd"]))


def report_in_cents(report: dict) -> dict:
    """The report as people read it: money in cents, each table adding up to the totals to the
    cent (the report itself keeps hundredths of a cent, for exports and the API)."""
    shown = copy.deepcopy(report)
    total, idle, revenue = _cents(report["total_usd"]), _cents(report["idle_usd"]), _cents(report["revenue_usd"])
    shown.update(total_usd=str(total), idle_usd=str(idle), busy_usd=str(total - idle))
    if revenue is not None:
        shown.update(revenue_usd=str(revenue), margin_usd=str(revenue - total))
    # .get: a month closed before batches were billed has no batch figures (its tables show none).
    batch, batch_revenue = _cents(report.get("batch_usd")), _cents(report.get("batch_revenue_usd"))
    for key, value in (("batch_usd", batch), ("batch_revenue_usd", batch_revenue)):
        if value is not None:
            shown[key] = str(value)
    whole = {"usd": total, "idle_usd": idle, "revenue_usd": revenue, "batch_usd": batch,
             "batch_revenue_usd": batch_revenue}
    for table in ("by_deployment", "by_model", "by_version"):
        _table_in_cents(shown[table], whole)
    none = Decimal("0.00")  # a tenant's lines have no idle cost
    _table_in_cents(shown["by_tenant"], {"usd": total - idle, "idle_usd": none, "revenue_usd": revenue,
                                         "batch_usd": batch, "batch_revenue_usd": batch_revenue})
    for tenant in shown["by_tenant"]:
        _table_in_cents(tenant["deployments"], {"usd": Decimal(tenant["usd"]), "idle_usd": none,
                                                "revenue_usd": _cents(tenant.get("revenue_usd")),
                                                "batch_usd": _cents(tenant.get("batch_usd")),
                                                "batch_revenue_usd": _cents(tenant.get("batch_revenue_usd"))})
    for row in shown["adjustments"]:
        row["usd"] = str(_cents(row["usd"]))
    return shown


def _daily_series(rows) -> list[dict]:
    """Per UTC day: cost, idle and busy cost, $/MTok and cost by deployment, from _DAILY_SLOTS rows."""
    days: dict[date, dict] = {}
    for day, deployment, usd, idle_usd, tokens in rows:
        entry = days.setdefault(day, {"date": day.isoformat(), "usd": Decimal(0), "idle_usd": Decimal(0),
                                      "tokens": 0, "by_deployment": {}})
        entry["usd"] += usd
        entry["idle_usd"] += idle_usd
        entry["tokens"] += int(tokens)
        entry["by_deployment"][deployment] = money(usd)
    return [{**entry, "usd": money(entry["usd"]), "idle_usd": money(entry["idle_usd"]),
             "busy_usd": money(entry["usd"] - entry["idle_usd"]),
             "usd_per_mtok": per_mtok(entry["usd"], entry["tokens"])} for entry in days.values()]


def adjustments_booked(start: datetime, end: datetime) -> list[Cell]:
    rows = Adjustment.objects.filter(booked_month__gte=start.date(), booked_month__lt=end.date())
    return [Cell(tenant=a.tenant or None, deployment=a.deployment, version=a.version, model=a.model, usd=a.usd,
                 prompt_tokens=a.prompt_tokens, completion_tokens=a.completion_tokens,
                 compliant_tokens=a.compliant_tokens, adjustment_from=a.source_month.strftime("%Y-%m"),
                 batch_prompt_tokens=a.batch_prompt_tokens, batch_completion_tokens=a.batch_completion_tokens,
                 batch_usd=a.batch_usd)
            for a in rows]


def report_for(start: datetime, end: datetime, *, now: datetime) -> dict:
    """The report of [start, end): the frozen one for a closed month, else computed now."""
    from costing.ledger import ledger_through

    if start.day == 1 and start == month_start(start.date()) and end == next_month(start):
        closed = ClosedMonth.objects.filter(month=start.date()).first()
        if closed is not None:
            return closed.report
    through = ledger_through()
    # Adjustments belong to the month they are booked in, however far its ledger has come.
    adjustments = adjustments_booked(start, end)
    end = min(end, through) if through and end > through else end
    cells, daily = report_data(start, end)
    return build_report(start, end, cells, daily=daily, adjustments=adjustments, ledger_through=through)


# ---------------------------------------------------------------------------- CSV

CSV_COLUMNS = ["start", "end", "tenant", "deployment", "version", "model", "usd", "prompt_tokens",
               "completion_tokens", "slo_compliant_tokens", "replica_hours", "usd_per_mtok",
               "usd_per_mtok_slo_compliant", "revenue_usd", "margin_usd", "adjustment_for", "batch_tokens",
               "batch_usd", "batch_revenue_usd", "gpu_hours", "gpu_hours_busy", "gpu_busy_share",
               "gpu_hours_not_measured"]
NOT_MEASURED = "not measured"


def _gpu_columns(figures: dict) -> list:
    """GPU-hours, busy GPU-hours, busy share ("not measured" for GPU-hours no telemetry covered) and
    GPU-hours not measured; empty where no GPU was held."""
    if not figures.get("gpu_hours") or Decimal(figures["gpu_hours"]) == 0:
        return ["", "", "", ""]
    share = figures.get("gpu_busy_share")
    return [figures["gpu_hours"], figures["gpu_hours_busy"], NOT_MEASURED if share is None else share,
            figures["gpu_hours_not_measured"]]


def report_csv(report: dict) -> str:
    """One row per tenant × deployment × version (the idle line has tenant "(idle)"). The batch columns
    come after the older ones, so readers of those by position still read them; a month closed before
    batches were billed shows 0 there. The GPU columns come last; a version's GPU-hours are on its idle
    line, as its replica hours are."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in report["rows"]:
        usd = Decimal(row["usd"])
        tokens = row["prompt_tokens"] + row["completion_tokens"]
        revenue = row.get("revenue")
        writer.writerow([
            report["start"], report["end"], row["tenant"] or "(idle)", row["deployment"], row["version"],
            row["model"], row["usd"], row["prompt_tokens"], row["completion_tokens"], row["compliant_tokens"],
            str((Decimal(row["replica_minutes"]) / 60).quantize(Decimal("0.01"))), per_mtok(usd, tokens) or "",
            per_mtok(usd, row["compliant_tokens"]) or "", revenue or "",
            money(Decimal(revenue) - usd) if revenue is not None else "", row.get("adjustment_from") or "",
            row.get("batch_prompt_tokens", 0) + row.get("batch_completion_tokens", 0),
            money(Decimal(row.get("batch_usd") or 0)), row.get("batch_revenue") or "",
            *_gpu_columns(_row_gpu_figures(row)),
        ])
    writer.writerow(["", "", "TOTAL", "", "", "", report["total_usd"], report["prompt_tokens"],
                     report["completion_tokens"], report["slo_compliant_tokens"], report["replica_hours"],
                     report["usd_per_mtok"] or "", report["usd_per_mtok_slo_compliant"] or "",
                     report["revenue_usd"] or "", report["margin_usd"] or "", "", report.get("batch_tokens", 0),
                     money(Decimal(report.get("batch_usd") or 0)), report.get("batch_revenue_usd") or "",
                     *_gpu_columns(report)])
    return out.getvalue()


def _row_gpu_figures(row: dict) -> dict:
    totals = Totals(gpu_minutes=row.get("gpu_minutes", 0), gpu_measured=row.get("gpu_measured_minutes", 0.0),
                    gpu_busy=row.get("gpu_busy_minutes", 0.0), gpu_unmeasured=row.get("gpu_unmeasured_minutes", 0.0))
    return totals.gpu_figures()


def month_range(month: date) -> tuple[datetime, datetime]:
    start = month_start(month)
    return start, next_month(start)


def previous_month(now: datetime) -> date:
    first = month_start(now.date())
    return (first - timedelta(days=1)).date().replace(day=1)

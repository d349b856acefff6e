"""Two versions of one model side by side: quality, speed and cost, what a team needs to decide.

- Scores: per eval set version, each version's latest succeeded run on it (scores are only
  comparable on the same cases). Scores are not windowed: a version is often scored once, when
  it is registered.
- Speed: TTFT and TPOT p95 over the window from the usage pipeline's per-minute histograms
  (tenants.UsageMinute, every deployment of the model serving that version), exact to one
  histogram bucket (12 % wide), as the per-minute ledger keeps them. Successful requests only.
- Cost: $/MTok and $/MTok SLO-compliant over the window's whole hours from the ledger's hourly
  cost and usage rows (CostHour, UsageHour), as the cost report's per-version figures: the
  replicas' cost (idle hours included) over the tokens served.

A figure without data (no run, no request, no cost row) is None, never 0; `better` names the
better side ("a" or "b") only when both sides have a figure and they differ.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from decimal import Decimal

from django.db import connection
from django.db.models import Sum

from costing.ledger import floor_hour, ledger_through
from costing.models import CostHour, UsageHour
from costing.report import per_mtok
from deployments.models import Deployment
from evals.choices import RunStatus
from evals.models import EvalRun, EvalSetVersion
from evals.runs.services import latest_run
from registry.models import ModelVersion, RegisteredModel
from tenants.ingest import histogram_quantile
from tenants.models import UsageMinute

DEFAULT_DAYS = 7
MAX_DAYS = 90
HIGHER, LOWER = "higher", "lower"

# One version's latency histogram over the window, summed per bucket label in Postgres (a week is
# ~10^4 minute rows per tenant and key).
_BUCKETS = """
    SELECT b.label, sum(b.n::bigint)::bigint
    FROM tenants_usageminute m, jsonb_each_text(m.{column}) AS b(label, n)
    WHERE m.deployment = ANY(%s) AND m.version = %s AND m.minute >= %s AND m.minute < %s
    GROUP BY 1
"""


def better_of(a, b, *, wins: str) -> str | None:
    if a is None or b is None or a == b:
        return None
    a_wins = (a > b) if wins == HIGHER else (a < b)
    return "a" if a_wins else "b"


def figure(a, b, *, wins: str, as_number=float) -> dict:
    """Both sides' figure and which is better; money comes as decimal strings, compared as Decimals."""
    numbers = [None if value is None else as_number(value) for value in (a, b)]
    return {"a": a, "b": b, "better": better_of(*numbers, wins=wins), "better_is": wins}


# ---------------------------------------------------------------------------- scores


def run_summary(run: EvalRun | None) -> dict | None:
    if run is None:
        return None
    return {"run": run.pk, "score": run.score, "scores": run.scores, "finished_at": run.finished_at}


def score_rows(a: ModelVersion, b: ModelVersion) -> list[dict]:
    """One row per eval set version either version has a succeeded run on, by set name then newest version."""
    set_versions = (EvalSetVersion.objects.filter(runs__model_version__in=[a, b], runs__status=RunStatus.SUCCEEDED)
                    .select_related("eval_set").distinct().order_by("eval_set__name", "-number"))
    rows = []
    for set_version in set_versions:
        run_a, run_b = (latest_run(model_version=version, set_version=set_version) for version in (a, b))
        rows.append({"eval_set": set_version.eval_set.name, "set_version": set_version.number,
                     "cases": set_version.case_count, "a": run_summary(run_a), "b": run_summary(run_b),
                     "better": better_of(run_a and run_a.score, run_b and run_b.score, wins=HIGHER)})
    return rows


# ---------------------------------------------------------------------------- speed


def latency_p95(deployments: list[str], version: int, start: datetime, end: datetime, column: str) -> float | None:
    with connection.cursor() as cursor:
        cursor.execute(_BUCKETS.format(column=column), [deployments, version, start, end])
        buckets = dict(cursor.fetchall())
    p95 = histogram_quantile(buckets, 0.95)
    # Beyond the last bucket (1,000 s) there is no bound to give: no figure rather than infinity.
    return None if p95 is None or math.isinf(p95) else p95


def speed(deployments: list[str], version: int, start: datetime, end: datetime) -> dict:
    requests = UsageMinute.objects.filter(deployment__in=deployments, version=version, minute__gte=start,
                                          minute__lt=end).aggregate(n=Sum("requests"))["n"]
    return {"requests": requests,
            "ttft_p95_ms": latency_p95(deployments, version, start, end, "ttft_buckets"),
            "tpot_p95_ms": latency_p95(deployments, version, start, end, "tpot_buckets")}


# ---------------------------------------------------------------------------- cost


def cost(deployments: list[str], version: int, start: datetime, end: datetime) -> dict:
    """The version's ledger figures over [start, end) (whole hours)."""
    usd = CostHour.objects.filter(deployment__in=deployments, version=version, hour__gte=start,
                                  hour__lt=end).aggregate(usd=Sum("usd"))["usd"]
    tokens = UsageHour.objects.filter(deployment__in=deployments, version=version, hour__gte=start,
                                      hour__lt=end).aggregate(
        prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"),
        compliant_prompt=Sum("compliant_prompt_tokens"), compliant_completion=Sum("compliant_completion_tokens"))
    total = (tokens["prompt"] or 0) + (tokens["completion"] or 0)
    compliant = (tokens["compliant_prompt"] or 0) + (tokens["compliant_completion"] or 0)
    return {
        "usd": None if usd is None else str(usd.quantize(Decimal("0.0001"))),
        "tokens": total if tokens["prompt"] is not None else None,
        "usd_per_mtok": per_mtok(usd, total) if usd is not None else None,
        "usd_per_mtok_slo_compliant": per_mtok(usd, compliant) if usd is not None else None,
    }


# ---------------------------------------------------------------------------- the comparison


def model_deployments(model: RegisteredModel) -> list[str]:
    """Every deployment that served the model, deleted ones too: their usage and cost stay on the books."""
    return list(Deployment.objects.filter(model=model).order_by("name").values_list("name", flat=True))


def side(version: ModelVersion, deployments: list[str], start: datetime, end: datetime, hours_from: datetime) -> dict:
    return {"version": version.number, "created_at": version.created_at, "description": version.description,
            "serving": sorted(version.deployments.filter(deleted_at__isnull=True).values_list("name", flat=True)),
            "speed": speed(deployments, version.number, start, end),
            "cost": cost(deployments, version.number, hours_from, end)}


def versions_compare(*, model: RegisteredModel, a: ModelVersion, b: ModelVersion, days: int, now: datetime) -> dict:
    """The comparison document (the API's answer and the page's context)."""
    start = now - timedelta(days=days)
    hours_from = floor_hour(start)
    deployments = model_deployments(model)
    left, right = side(a, deployments, start, now, hours_from), side(b, deployments, start, now, hours_from)

    def pair(part: str, key: str, as_number=float) -> dict:
        return figure(left[part][key], right[part][key], wins=LOWER, as_number=as_number)

    return {
        "model": model.name, "days": days, "start": start, "end": now,
        "ledger_through": ledger_through(), "deployments": deployments,
        "a": left, "b": right,
        "scores": score_rows(a, b),
        "speed": {"ttft_p95_ms": pair("speed", "ttft_p95_ms"), "tpot_p95_ms": pair("speed", "tpot_p95_ms")},
        "cost": {"usd_per_mtok": pair("cost", "usd_per_mtok", Decimal),
                 "usd_per_mtok_slo_compliant": pair("cost", "usd_per_mtok_slo_compliant", Decimal)},
    }

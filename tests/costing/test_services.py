"""The price book over REST (bad input refused whole), budgets and their alerts, month close."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import transaction
from django.utils import timezone

from alerts.models import Alert
from costing import services
from costing.ledger import ledger_sync, resources_held
from costing.models import Adjustment, ClosedMonth, Price
from costing.report import report_for
from inferops.models import AuditEvent
from tenants.models import Tenant
from tests.costing.conftest import at, make_deployment, make_replica, price, usage
from tests.reliability.test_rest_fuzz import assert_answer_matches_schema

pytestmark = pytest.mark.django_db
PRICES = "/api/v1/costing/prices/"


def test_operator_adds_prices_and_a_new_price_ends_the_open_one(api):
    operator = api("operator")
    first = operator.post(PRICES, {"resource": "cpu", "usd_per_hour": "0.05", "tier": "on-demand",
                                   "effective_from": "2026-01-01T00:00:00Z"}, format="json")
    assert first.status_code == 201, first.json()
    assert first.json()["usd_per_hour"] == "0.050000"
    second = operator.post(PRICES, {"resource": "cpu", "usd_per_hour": "0.04",
                                    "effective_from": "2026-02-01T00:00:00Z"}, format="json")
    assert second.status_code == 201
    listed = api("viewer").get(PRICES, {"resource": "cpu"}).json()["results"]
    assert [(p["usd_per_hour"], p["effective_to"]) for p in listed] == [
        ("0.050000", "2026-02-01T00:00:00Z"), ("0.040000", None)]
    assert AuditEvent.objects.filter(action="price.create").count() == 2
    assert AuditEvent.objects.filter(action="price.end").count() == 1


def test_a_viewer_cannot_change_prices(api):
    response = api("viewer").post(PRICES, {"resource": "cpu", "usd_per_hour": "0.05",
                                           "effective_from": "2026-01-01T00:00:00Z"}, format="json")
    assert response.status_code == 403
    assert not Price.objects.exists()


@pytest.mark.parametrize(("body", "field"), [
    ({"usd_per_hour": "-0.01"}, "usd_per_hour"),
    ({"usd_per_hour": "cheap"}, "usd_per_hour"),
    ({"usd_per_hour": 0.05}, "usd_per_hour"),  # a JSON float: money travels as decimal strings
    ({"resource": "disk"}, "resource"),
    ({"resource": "gpu:"}, "resource"),
    ({"tier": "free"}, "tier"),
    ({"effective_from": "soon"}, "effective_from"),
    ({"effective_to": "2025-12-01T00:00:00Z"}, "effective_to"),
    ({"cost": "1"}, "cost"),
])
def test_bad_prices_are_400_naming_the_field_and_store_nothing(api, body, field):
    payload = {"resource": "gpu:H100", "usd_per_hour": "2.49", "effective_from": "2026-01-01T00:00:00Z", **body}
    response = api("operator").post(PRICES, payload, format="json")
    assert response.status_code == 400 and field in response.json(), response.json()
    assert not Price.objects.exists()


def test_overlapping_dates_for_the_same_resource_and_tier_are_refused(api):
    operator = api("operator")
    bounded = {"resource": "gpu:H100", "usd_per_hour": "2.00", "effective_from": "2026-01-01T00:00:00Z",
               "effective_to": "2026-02-01T00:00:00Z"}
    assert operator.post(PRICES, bounded, format="json").status_code == 201
    inside = {**bounded, "effective_from": "2026-01-15T00:00:00Z", "effective_to": None}
    response = operator.post(PRICES, inside, format="json")
    assert response.status_code == 400 and "effective_from" in response.json()
    # Another tier may overlap: it is a different price list.
    assert operator.post(PRICES, {**inside, "tier": "spot"}, format="json").status_code == 201
    assert Price.objects.count() == 2


def test_a_back_dated_price_and_a_price_nothing_holds_are_added_with_warnings(api):
    chat = make_deployment("chat", resources={"cpu": "2", "gpu_count": 1, "gpu_type": "H100"})
    make_replica(chat, started_at=at(0), node="node-a")
    operator = api("operator")
    this_month = timezone.now().replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    last_month = this_month - timedelta(days=10)
    quiet = {"resource": "gpu:H100", "usd_per_hour": "2.49", "effective_from": this_month.isoformat()}
    response = operator.post(PRICES, quiet, format="json")
    assert response.status_code == 201 and response.json()["warnings"] == []
    response = operator.post(PRICES, {"resource": "gpu:A100", "usd_per_hour": "1.80",
                                      "effective_from": last_month.isoformat()}, format="json")
    assert response.status_code == 201, response.json()
    back_dated, unused = response.json()["warnings"]
    assert back_dated.startswith(f"Back-dated into {last_month:%Y-%m}, a month that had ended")
    assert unused.startswith("No replica holds gpu:A100") and unused.endswith("(GPU types in use: H100).")
    assert Price.objects.filter(resource="gpu:A100").exists()  # warned, not refused
    typo = operator.post(PRICES, {"resource": "node:node-aa", "usd_per_hour": "3",
                                  "effective_from": this_month.isoformat()}, format="json").json()
    assert typo["warnings"] == ["No replica holds node:node-aa: no deployment's resources ask for it and no "
                                "replica has run with it, so this price charges nothing (nodes in use: node-a)."]
    for held in ("node:node-a", "cpu"):
        body = {"resource": held, "usd_per_hour": "1", "effective_from": this_month.isoformat()}
        assert operator.post(PRICES, body, format="json").json()["warnings"] == [], held
    memory = operator.post(PRICES, {"resource": "memory", "usd_per_hour": "0.01",
                                    "effective_from": this_month.isoformat()}, format="json").json()
    assert memory["warnings"][0].startswith("No replica holds memory")  # chat asks for no memory


def test_a_gpu_type_only_a_past_replica_run_held_is_in_use():
    ended = make_deployment("old", resources={"gpu_count": 1, "gpu_type": "L4"})
    make_replica(ended, started_at=at(0))
    ledger_sync(at(1))
    ended.resources = {"cpu": "1"}
    ended.save()
    assert "gpu:L4" in resources_held()
    warnings = services.price_warnings(price("gpu:L4", "0.80", at(0)), held=resources_held())
    assert not [w for w in warnings if "No replica holds" in w], warnings


def test_a_price_cannot_start_inside_a_closed_month(api):
    services.month_close(month=datetime(2026, 2, 1).date(), now=at(0))
    response = api("operator").post(PRICES, {"resource": "cpu", "usd_per_hour": "0.05",
                                             "effective_from": "2026-02-15T00:00:00Z"}, format="json")
    assert response.status_code == 400 and "closed month" in response.json()["effective_from"][0]


def test_a_price_not_started_yet_may_be_removed_a_charged_one_not(api):
    later = price("cpu", "0.05", datetime(2099, 1, 1, tzinfo=UTC))
    charged = price("memory", "0.01", at(-24))
    operator = api("operator")
    assert operator.delete(f"{PRICES}{charged.pk}/").status_code == 409
    assert operator.delete(f"{PRICES}{later.pk}/").status_code == 204
    assert list(Price.objects.values_list("resource", flat=True)) == ["memory"]


# ---------------------------------------------------------------------------- budgets


@pytest.fixture
def spending():
    """acme spends $0.60 an hour on `chat` from March 10, 10:00."""
    Tenant.objects.create(name="acme")
    deployment = make_deployment("chat", resources={"cpu": "1"})
    price("cpu", "0.60", at(-24))
    make_replica(deployment, started_at=at(0))
    for hour in range(5):
        usage("chat", "acme", at(hour, 1), prompt=10, completion=10)
    return deployment


def budget_alerts(status: str = "firing") -> dict:
    return {(a.labels["threshold"], a.labels["basis"]): a for a in Alert.objects.filter(
        labels__alertname=services.BUDGET_ALERT, status=status)}


def test_crossing_a_threshold_opens_a_ticket_and_raising_the_budget_resolves_it(api, spending, settings):
    settings.INFEROPS_COST_FORECAST_MIN_HOURS = 10_000  # actual spend only in this test
    created = api("operator").post("/api/v1/costing/budgets/", {"tenant": "acme", "monthly_usd": "4.00",
                                                               "thresholds": [50, 80, 100]}, format="json")
    assert created.status_code == 201, created.json()
    ledger_sync(at(4))  # $2.40 spent: 60% of $4
    services.budgets_evaluate(now=at(4))
    firing = budget_alerts()
    assert set(firing) == {("50", "actual")}
    alert = firing[("50", "actual")]
    assert alert.severity == "ticket" and alert.labels["tenant"] == "acme" and alert.labels["month"] == "2026-03"
    assert alert.annotations["spend_usd"] == "2.4000" and alert.annotations["budget_usd"] == "4.00"
    services.budgets_evaluate(now=at(4))  # again: the same alert, not a second one
    assert Alert.objects.filter(labels__alertname=services.BUDGET_ALERT).count() == 1
    budget_id = created.json()["id"]
    assert api("operator").patch(f"/api/v1/costing/budgets/{budget_id}/", {"monthly_usd": "10.00"},
                                 format="json").status_code == 200
    services.budgets_evaluate(now=at(4))
    assert budget_alerts() == {}
    assert set(budget_alerts("resolved")) == {("50", "actual")}


def test_forecast_spend_warns_before_the_money_is_gone_and_a_new_month_resolves(spending, settings):
    settings.INFEROPS_COST_FORECAST_MIN_HOURS = 1
    services.budget_create(tenant=Tenant.objects.get(name="acme"), monthly_usd=Decimal("300"), thresholds=[100],
                           actor=None)
    ledger_sync(at(4))
    # $2.40 in the 9 days 14 hours since March 1: about $7.75 by March 31, far below $300.
    services.budgets_evaluate(now=at(4))
    assert budget_alerts() == {}
    services.budget_update(budget=services.Budget.objects.get(), monthly_usd=Decimal("7.00"), actor=None)
    services.budgets_evaluate(now=at(4))
    assert set(budget_alerts()) == {("100", "forecast")}
    ledger_sync(datetime(2026, 4, 1, 0, 30, tzinfo=UTC))
    services.budgets_evaluate(now=datetime(2026, 4, 1, 0, 30, tzinfo=UTC))
    assert budget_alerts() == {}  # April: no spend counted yet, the March alert resolved


@pytest.mark.parametrize(("body", "field"), [
    ({"tenant": "nobody"}, "tenant"), ({"monthly_usd": "-5"}, "monthly_usd"), ({"monthly_usd": "0"}, "monthly_usd"),
    ({"thresholds": [0]}, "thresholds"), ({"thresholds": []}, "thresholds"),
])
def test_bad_budgets_are_400_naming_the_field(api, body, field):
    Tenant.objects.create(name="acme")
    payload = {"tenant": "acme", "monthly_usd": "100", "thresholds": [50, 100], **body}
    response = api("operator").post("/api/v1/costing/budgets/", payload, format="json")
    assert response.status_code == 400 and field in response.json(), response.json()
    assert not services.Budget.objects.exists()


# ---------------------------------------------------------------------------- month close


def test_month_close_freezes_the_report_and_late_usage_is_an_adjustment_in_the_open_month():
    Tenant.objects.create(name="acme")
    deployment = make_deployment("chat", resources={"cpu": "1"})
    price("cpu", "0.60", at(-24))
    make_replica(deployment, started_at=datetime(2026, 3, 31, 22, tzinfo=UTC))
    usage("chat", "acme", datetime(2026, 3, 31, 22, 5, tzinfo=UTC), prompt=10, completion=10)
    april = datetime(2026, 4, 1, 1, 0, tzinfo=UTC)
    ledger_sync(april)
    assert services.months_to_close(april) == [datetime(2026, 3, 1).date()]
    closed = services.month_close(month=datetime(2026, 3, 1).date(), now=april)
    march = closed.report
    assert march["closed"] and march["total_usd"] == "1.2000" and march["idle_usd"] == "0.6000"
    assert services.month_close(month=datetime(2026, 3, 1).date(), now=april).pk == closed.pk  # idempotent
    assert services.months_to_close(april) == []

    # A request of 23:10 on March 31 arrives late, in April: hour 23 had been idle.
    usage("chat", "beta", datetime(2026, 3, 31, 23, 10, tzinfo=UTC), prompt=5, completion=5)
    later = datetime(2026, 4, 1, 2, 0, tzinfo=UTC)
    sync = ledger_sync(later)
    assert services.adjustments_book(since=sync.earliest_change, now=later) == 2
    assert services.adjustments_book(since=sync.earliest_change, now=later) == 0  # booked once
    start, end = datetime(2026, 3, 1, tzinfo=UTC), datetime(2026, 4, 1, tzinfo=UTC)
    assert report_for(start, end, now=later) == march  # the closed month is never recomputed
    moved = {(a.tenant, a.usd) for a in Adjustment.objects.all()}
    assert moved == {("beta", Decimal("0.6")), ("", Decimal("-0.6"))}
    april_report = report_for(end, datetime(2026, 5, 1, tzinfo=UTC), now=later)
    assert "2026-03" in april_report["notes"][0]
    tenants = {row["tenant"]: row for row in april_report["by_tenant"]}
    assert tenants["beta"]["usd"] == "0.6000" and tenants["beta"]["prompt_tokens"] == 5
    assert {(a["tenant"], a["usd"]) for a in april_report["adjustments"]} == {("beta", "0.6000"), (None, "-0.6000")}
    # April's own cost (two hours of the replica) plus the adjustments, which move money only.
    assert april_report["total_usd"] == "1.2000"
    assert ClosedMonth.objects.count() == 1


def test_the_beat_tasks_run_and_a_second_close_finds_nothing_to_do():
    from costing import tasks

    deployment = make_deployment("chat", resources={"cpu": "1"})
    price("cpu", "0.60", at(-24))
    make_replica(deployment, started_at=at(0), state="stopped", stopped_at=at(1))
    usage("chat", "acme", at(0, 5), prompt=10, completion=10)
    result = tasks.sync_ledger.run()
    assert result["skipped"] is False and result["adjustments"] == 0
    from django.utils import timezone

    from costing.report import previous_month

    closed = tasks.close_months.run()  # every finished month from the ledger's first row on
    assert closed[0] == "2026-03" and closed[-1] == previous_month(timezone.now()).strftime("%Y-%m")
    assert tasks.close_months.run() == []
    assert ClosedMonth.objects.get(month=datetime(2026, 3, 1).date()).report["total_usd"] == "0.6000"
    assert tasks.evaluate_budgets.run() == {"firing": 0, "resolved": 0}


def test_removing_a_charged_price_in_the_console_says_why_not_a_server_error(client, make_user):
    """Issue 40 (the permissions matrix): the service's refusal reached the console as a 500."""
    charged = price("memory", "0.01", at(-24))
    client.force_login(make_user("operator"))
    response = client.post(f"/costs/prices/{charged.pk}/delete/", follow=True)
    assert response.status_code == 200
    assert "This price has been charged already" in response.content.decode()
    assert Price.objects.filter(pk=charged.pk).exists()


def test_a_page_limit_or_offset_past_bigint_is_a_400_not_a_500(api):
    # Found by the REST fuzzer (issue 40): the pagination's LIMIT reached Postgres as a bigint it cannot hold.
    price("cpu", "0.05", timezone.now())  # an empty table answers before any LIMIT is sent
    viewer = api("viewer")

    def get(query: str):
        with transaction.atomic():  # as a request outside the test's transaction: Postgres refused the query
            return viewer.get(f"/api/v1/costing/prices/?{query}")

    response = get("limit=998314218990377631744&offset=false")
    assert response.status_code == 400
    assert response.json() == {"limit": ["Ensure this value is less than or equal to 9223372036854775807."]}
    assert_answer_matches_schema(response, "GET", "/api/v1/costing/prices/")
    assert get(f"offset={10**20}").json()["results"] == []  # past the count: answered before any query
    assert get("limit=5").status_code == 200


def test_a_nul_in_a_filter_is_a_400_naming_it_not_a_500(api):
    # Found by the REST fuzzer (issue 40): psycopg refuses a NUL in a query's text, and the filters passed it on.
    price("cpu", "0.05", timezone.now())
    response = api("viewer").get("/api/v1/costing/prices/", {"tier": "on\x00demand", "resource": "cpu"})
    assert (response.status_code, response.json()) == (400, {"tier": ["Null characters are not allowed."]})
    assert_answer_matches_schema(response, "GET", "/api/v1/costing/prices/")

"""Two versions side by side (GET /api/v1/models/{name}/compare/ and /models/<name>/compare/):
scores per eval set version from real run rows, TTFT/TPOT p95 from usage stored through the real
ingest, $/MTok from the real ledger; bad parameters answered 400 on the parameter; missing data
shown as missing, never as 0."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from costing.ledger import floor_hour, ledger_sync
from evals.choices import RunStatus
from slo.services import slo_create
from tenants.ingest import latency_bucket
from tests.costing.conftest import make_deployment, make_replica, price, usage
from tests.costing.eval_rows import finished_run, set_version
from tests.deployments.conftest import make_version

pytestmark = pytest.mark.django_db
URL = "/api/v1/models/tiny/compare/"


@pytest.fixture
def world():
    """Model tiny, versions 1-3 on deployment chat: 1 and 2 scored, served and costed; 3 has nothing.

    v1: 10 requests, TTFT 100 ms, TPOT 10 ms, 18,000 tokens, one replica-hour of 1 core at $0.36.
    v2: 20 requests, half with TTFT 300 ms (over the 150 ms SLO), TPOT 8 ms, 36,000 tokens, the same hour's cost.
    """
    now = timezone.now()
    hour = floor_hour(now)
    deployment = make_deployment("chat", model="tiny", versions=2, resources={"cpu": "1"})
    make_version(deployment.model, 3)
    slo_create(actor=None, name="chat-ttft", deployment=deployment, sli_kind="latency", ttft_ms=150,
               objective=0.99, window="1d")
    price("cpu", "0.36", now - timedelta(days=30))
    for version, start in ((1, hour - timedelta(hours=4)), (2, hour - timedelta(hours=2))):
        make_replica(deployment, version=version, started_at=start, state="stopped",
                     stopped_at=start + timedelta(hours=1))
    when = hour - timedelta(hours=3, minutes=30)
    usage("chat", "acme", when, prompt=1000, completion=800, requests=10, version=1, ttft_ms=100, tpot_ms=10)
    when = hour - timedelta(hours=1, minutes=30)
    usage("chat", "acme", when, prompt=1000, completion=800, requests=10, version=2, ttft_ms=100, tpot_ms=8)
    usage("chat", "acme", when, prompt=1000, completion=800, requests=10, version=2, ttft_ms=300, tpot_ms=8)
    ledger_sync(now)

    v1, v2 = (deployment.model.versions.get(number=n) for n in (1, 2))
    qa1, qa2, maths = set_version("qa"), set_version("qa"), set_version("maths", cases=5)
    runs = {
        "v1-qa2-old": finished_run(v1, qa2, 0.5, finished_at=now - timedelta(days=3)),
        "v1-qa2": finished_run(v1, qa2, 0.75, finished_at=now - timedelta(days=2)),
        "v1-qa2-failed": finished_run(v1, qa2, 0.25, status=RunStatus.FAILED, finished_at=now - timedelta(days=1)),
        "v2-qa2": finished_run(v2, qa2, 1.0),
        "v1-qa1": finished_run(v1, qa1, 0.5),
        "v2-maths": finished_run(v2, maths, 0.8),
    }
    return {"deployment": deployment, "runs": runs}


def test_the_latest_version_against_its_predecessor_by_default(api, world):
    body = api("viewer").get("/api/v1/models/tiny/compare/?a=1").json()
    assert (body["a"]["version"], body["b"]["version"]) == (1, 3)
    default = api("viewer").get(URL).json()
    assert (default["a"]["version"], default["b"]["version"], default["days"]) == (2, 3, 7)


def test_scores_speed_and_cost_side_by_side(api, world):
    response = api("viewer").get(f"{URL}?a=1&b=2")
    assert response.status_code == 200, response.json()
    body = response.json()
    runs = world["runs"]
    # Per set version: the latest succeeded run of each (not the older one, not the later failure).
    assert [(row["eval_set"], row["set_version"], row["a"] and row["a"]["run"], row["b"] and row["b"]["run"],
             row["better"]) for row in body["scores"]] == [
        ("maths", 1, None, runs["v2-maths"].pk, None),
        ("qa", 2, runs["v1-qa2"].pk, runs["v2-qa2"].pk, "b"),
        ("qa", 1, runs["v1-qa1"].pk, None, None),
    ]
    assert body["scores"][1]["a"]["score"] == 0.75 and body["scores"][1]["b"]["score"] == 1.0
    # Latency p95 as the per-minute histograms hold it: the upper bound of its bucket.
    assert body["speed"]["ttft_p95_ms"] == {"a": float(latency_bucket(100)), "b": float(latency_bucket(300)),
                                            "better": "a", "better_is": "lower"}
    assert body["speed"]["tpot_p95_ms"]["better"] == "b"
    assert (body["a"]["speed"]["requests"], body["b"]["speed"]["requests"]) == (10, 20)
    # $0.36 over 18,000 tokens, and over 36,000 of which 18,000 met the TTFT SLO.
    assert body["cost"]["usd_per_mtok"] == {"a": "20.0000", "b": "10.0000", "better": "b", "better_is": "lower"}
    assert body["cost"]["usd_per_mtok_slo_compliant"] == {"a": "20.0000", "b": "20.0000", "better": None,
                                                          "better_is": "lower"}
    assert body["a"]["cost"]["usd"] == "0.3600" and body["deployments"] == ["chat"]


def test_a_version_without_runs_or_usage_has_no_data_not_zero(api, world):
    body = api("viewer").get(f"{URL}?a=2&b=3").json()
    assert body["b"]["speed"] == {"requests": None, "ttft_p95_ms": None, "tpot_p95_ms": None}
    assert body["b"]["cost"] == {"usd": None, "tokens": None, "usd_per_mtok": None, "usd_per_mtok_slo_compliant": None}
    assert body["speed"]["ttft_p95_ms"]["better"] is None and body["cost"]["usd_per_mtok"]["better"] is None
    assert all(row["b"] is None and row["better"] is None for row in body["scores"])


def test_the_window_bounds_speed_and_cost_not_scores(api, world):
    body = api("viewer").get(f"{URL}?a=1&b=2&days=1").json()
    assert body["days"] == 1
    assert body["a"]["speed"]["requests"] == 10  # hours ago: inside a one-day window
    two_days_ago = timezone.now() - timedelta(days=2)
    usage("chat", "acme", two_days_ago, prompt=5, completion=5, requests=3, version=3)
    body = api("viewer").get(f"{URL}?a=2&b=3&days=1").json()
    assert body["b"]["speed"]["requests"] is None
    assert api("viewer").get(f"{URL}?a=2&b=3&days=3").json()["b"]["speed"]["requests"] == 3


@pytest.mark.parametrize(("query", "field", "message"), [
    ("a=x&b=2", "a", "'x' is not a version number."),
    ("a=0&b=2", "a", "'0' is not a version number."),
    ("a=9&b=2", "a", "tiny has no version 9 (versions: 1, 2, 3)."),
    ("a=1&b=7", "b", "tiny has no version 7 (versions: 1, 2, 3)."),
    ("a=2&b=2", "b", "a and b are both version 2: give two different versions."),
    ("a=3", "b", "a and b are both version 3: give two different versions."),
    ("b=1", "a", "tiny has no version before 1: give a and b."),
    ("days=0", "days", "Give a whole number of days from 1 to 90."),
    ("days=91", "days", "Give a whole number of days from 1 to 90."),
    ("days=week", "days", "Give a whole number of days from 1 to 90."),
])
def test_bad_parameters_are_400s_naming_them(api, world, query, field, message):
    response = api("viewer").get(f"{URL}?{query}")
    assert response.status_code == 400
    assert response.json() == {field: [message]}


def test_unknown_models_and_single_versions(api, db):
    assert api("viewer").get("/api/v1/models/nope/compare/").status_code == 404
    make_deployment("solo", model="solo")
    response = api("viewer").get("/api/v1/models/solo/compare/")
    assert response.status_code == 400
    assert response.json() == {"a": ["solo has no version before 1: give a and b."]}
    assert api(None).get(URL).status_code == 401


def test_the_page_marks_the_better_side_and_says_no_data(client, make_user, world):
    client.force_login(make_user("viewer"))
    response = client.get("/models/tiny/compare/?a=1&b=2")
    assert response.status_code == 200
    html = response.content.decode()
    assert 'data-figure="ttft_p95_ms" data-better="a"' in html
    assert 'data-figure="usd_per_mtok" data-better="b"' in html
    assert 'data-figure="score-qa-v2" data-better="b"' in html
    assert "$20.0000" in html and "$10.0000" in html and "75.0 %" in html and "100.0 %" in html
    assert f'href="/evals/runs/{world["runs"]["v2-qa2"].pk}/"' in html
    assert 'id="chart-scores"' in html and '"sets": ["maths v1", "qa v2", "qa v1"]' in html
    empty = client.get("/models/tiny/compare/?a=2&b=3").content.decode()
    assert empty.count("no data") >= 5  # TTFT, TPOT, two $/MTok, and the scores v3 lacks

    bad = client.get("/models/tiny/compare/?a=1&b=9")
    assert bad.status_code == 400 and "tiny has no version 9" in bad.content.decode()
    assert client.get("/models/nope/compare/").status_code == 404

"""Quality SLOs: every bad field refused by name, the schedule (due, not due, one in flight, twice in a
row, a tick while another holds the lock), the page when the latest run falls below the floor and its
resolution, and the OpenSLO and Prometheus exports.

The runs here are real EvalRun rows finished by the test (with their case rows), and run_finished is
sent as the runner sends it; tests/slo/test_quality_slo_e2e.py scores a real replica."""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest
import yaml
from django.db import connection
from django.utils import timezone

from alerts.choices import AlertStatus
from alerts.models import Alert
from deployments.models import Deployment
from evals.choices import RunStatus, Trigger
from evals.models import EvalCaseResult, EvalRun
from evals.signals import run_finished
from slo import quality
from slo.budget import floor_minute
from slo.evaluation import evaluate_slos
from slo.models import Slo, SloEvalRun, SloMinute
from slo.openslo import export_slos, import_text
from slo.prometheus_rules import RulesUnavailable, slo_rules

# The browser fixtures live beside the other browser suites.
from tests.browser.conftest import browser, log_in, page, page_errors  # noqa: F401
from tests.evals.runs_world import eval_set_with

pytestmark = pytest.mark.django_db

CASES = [{"id": f"c{i}", "prompt": f"say {i}", "expected": str(i)} for i in range(5)]
BODY = {"name": "chat-quality", "deployment": "chat", "sli": {"kind": "quality", "eval_set": "smoke", "every": "15m"},
        "objective": 0.8, "window": "7d"}


@pytest.fixture
def smoke(deployment):
    return eval_set_with(CASES).eval_set


def post(client, **changes):
    return client.post("/api/v1/slos/", {**BODY, **changes}, format="json")


def quality_slo(eval_set, name: str = "chat-quality", every_s: int = 900, objective: float = 0.8) -> Slo:
    return Slo.objects.create(name=name, deployment=Deployment.objects.get(name="chat"), sli_kind="quality",
                              eval_set=eval_set, eval_every_s=every_s, objective=objective, window="7d")


def test_create_show_and_update_a_quality_slo(api, smoke):
    client = api("operator")
    response = post(client)
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["sli"] == {"kind": "quality", "ttft_ms": None, "tpot_ms": None, "e2e_ms": None, "eval_set": "smoke",
                           "every": "15m", "every_s": 900}
    assert body["scope"] == "deployment" and body["objective"] == 0.8
    assert body["quality"] == {"floor": 0.8, "latest_run": None}
    changed = client.patch(f"/api/v1/slos/{body['id']}/", {"sli": {"kind": "quality", "eval_set": "smoke",
                                                                    "every": 21600}}, format="json")
    assert changed.status_code == 200, changed.content
    assert changed.json()["sli"]["every"] == "6h"
    assert client.get(f"/api/v1/slos/{body['id']}/eval-runs/").json() == {
        "slo": "chat-quality", "floor": 0.8, "eval_set": "smoke", "every_s": 21600, "runs": []}


@pytest.mark.parametrize(("changes", "field"), [
    ({"sli": {"kind": "quality", "every": "15m"}}, "sli.eval_set"),
    ({"sli": {"kind": "quality", "eval_set": "smoke"}}, "sli.every"),
    ({"sli": {"kind": "quality", "eval_set": "smoke", "every": "4m"}}, "sli.every"),
    ({"sli": {"kind": "quality", "eval_set": "smoke", "every": 299}}, "sli.every"),
    ({"sli": {"kind": "quality", "eval_set": "smoke", "every": "31d"}}, "sli.every"),
    ({"sli": {"kind": "quality", "eval_set": "smoke", "every": "15m", "ttft_ms": 500}}, "sli.ttft_ms"),
    ({"sli": {"kind": "quality", "eval_set": "smoke", "every": "15m", "good": "requests", "total": "requests"}},
     "sli.good"),
    ({"scope": "model", "deployment": None, "model": "tiny"}, "scope"),
    ({"scope": "tenant", "tenant": "acme"}, "scope"),
    ({"budgeting": "timeslices", "timeslice_target": 0.9}, "budgeting"),
    ({"objective": 1.0}, "objective"),
    ({"sli": {"kind": "latency", "ttft_ms": 500, "eval_set": "smoke"}}, "sli.eval_set"),
    ({"sli": {"kind": "availability", "every": "15m"}}, "sli.every"),
])
def test_every_bad_field_is_named(api, smoke, changes, field):
    response = post(api("operator"), **changes)
    assert response.status_code == 400, response.content
    assert field in response.json(), response.json()
    assert not Slo.objects.exists()


@pytest.mark.parametrize(("sli", "field"), [
    ({"kind": "quality", "eval_set": "no-such-set", "every": "15m"}, "eval_set"),
    ({"kind": "quality", "eval_set": "smoke", "every": "soon"}, "every"),
    ({"kind": "quality", "eval_set": "smoke", "every": -300}, "every"),
    ({"kind": "quality", "eval_set": "smoke", "every": 300.5}, "every"),
])
def test_malformed_sli_fields_are_named_under_sli(api, smoke, sli, field):
    response = post(api("operator"), sli=sli)
    assert response.status_code == 400, response.content
    assert field in response.json()["sli"], response.json()
    assert not Slo.objects.exists()


def test_the_console_form_creates_a_quality_slo_and_names_a_bad_schedule(client, make_user, smoke):
    client.force_login(make_user("operator"))
    form = {"name": "chat-quality", "scope": "deployment", "deployment": "chat", "sli_kind": "quality",
            "eval_set": "smoke", "eval_every_s": "2m", "objective": "0.8", "window": "7d", "time_zone": "UTC",
            "budgeting": "occurrences", "min_requests": "20"}
    refused = client.post("/slos/new/", form)
    assert refused.status_code == 200 and "between eval runs" in refused.content.decode()
    assert not Slo.objects.exists()
    created = client.post("/slos/new/", {**form, "eval_every_s": "6h"})
    slo = Slo.objects.get()
    assert created.status_code == 302 and (slo.eval_set, slo.eval_every_s) == (smoke, 21600)
    html = client.get(f"/slos/{slo.pk}/").content.decode()
    assert "quality: eval set smoke every 6h" in html and 'id="chart-quality"' in html
    assert 'value="6h"' in client.get(f"/slos/{slo.pk}/edit/").content.decode()


# ---------------------------------------------------------------------------- the schedule


def finish(run: EvalRun, passed: int, *, at=None, started=None) -> EvalRun:
    """The run scored: `passed` of its cases pass, saved as the runner saves it."""
    at = at or timezone.now()
    EvalCaseResult.objects.bulk_create([
        EvalCaseResult(run=run, index=i, case_id=case["id"], scorer="exact", output="", score=float(i < passed),
                       passed=i < passed, reason="" if i < passed else "expected something else")
        for i, case in enumerate(run.set_version.items)])
    total = len(run.set_version.items)
    EvalRun.objects.filter(pk=run.pk).update(
        status=RunStatus.SUCCEEDED, done=total, score=passed / total, started_at=started or at - timedelta(minutes=1),
        finished_at=at, scores={"exact": {"cases": total, "passed": passed, "score": passed / total}})
    run.refresh_from_db()
    run_finished.send_robust(sender=EvalRun, run=run)
    return run


def test_the_schedule_starts_a_run_when_due_and_none_while_one_is_in_flight(smoke):
    slo = quality_slo(smoke)
    now = timezone.now()
    [run] = quality.start_due_runs(now=now)
    assert (run.trigger, run.target_kind, run.deployment_name, run.status) == (Trigger.SLO, "deployment", "chat",
                                                                              RunStatus.QUEUED)
    assert run.eval_set == smoke and run.priority == -1000
    assert quality.start_due_runs(now=now) == []  # twice in a row: the first one is queued
    EvalRun.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING, started_at=now)
    assert quality.start_due_runs(now=now + timedelta(hours=1)) == []  # in flight however long
    finish(run, 5, at=now + timedelta(minutes=2), started=now)
    assert quality.start_due_runs(now=now + timedelta(minutes=14)) == []  # started 14 min ago: not due
    [second] = quality.start_due_runs(now=now + timedelta(minutes=15))
    assert second.pk != run.pk
    # A run somebody started by hand on the same set does not count as the schedule's.
    EvalRun.objects.filter(pk=second.pk).update(status=RunStatus.FAILED, started_at=now + timedelta(minutes=15))
    EvalRun.objects.create(eval_set=smoke, set_version=run.set_version, target_kind="deployment",
                           deployment=slo.deployment, deployment_name="chat", priority=-1000)
    assert len(quality.start_due_runs(now=now + timedelta(minutes=30))) == 1


def test_two_slos_on_one_deployment_and_set_share_their_runs(smoke):
    first = quality_slo(smoke, every_s=3600)
    Slo.objects.create(name="chat-quality-strict", deployment=first.deployment, sli_kind="quality", eval_set=smoke,
                       eval_every_s=600, objective=0.95, window="7d")
    assert len(quality.start_due_runs()) == 1
    assert EvalRun.objects.count() == 1


def test_a_tick_while_another_holds_the_lock_starts_nothing(smoke):
    quality_slo(smoke)
    params = connection.get_connection_params()
    wanted = ("dbname", "user", "password", "host", "port")
    with psycopg.connect(**{k: params[k] for k in wanted if k in params}, autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s, %s)", [0x510E, quality.SCHEDULE_LOCK_KEY])
        assert quality.start_due_runs() == []
        other.execute("SELECT pg_advisory_unlock(%s, %s)", [0x510E, quality.SCHEDULE_LOCK_KEY])
    assert len(quality.start_due_runs()) == 1


# ---------------------------------------------------------------------------- history and the page


def scheduled_run(slo: Slo) -> EvalRun:
    """The run the schedule starts for this SLO's set (due whatever ran before)."""
    started = quality.start_due_runs(now=timezone.now() + timedelta(days=1))
    [run] = [run for run in started if run.eval_set_id == slo.eval_set_id]
    return run


def test_a_quality_slo_pages_below_the_floor_and_resolves_when_a_later_run_is_back(smoke, client, make_user):
    slo = quality_slo(smoke, objective=0.8)
    evaluate_slos(slo_ids=[slo.pk])  # back-filled: no run yet

    now = timezone.now()
    good = finish(scheduled_run(slo), 5, at=now - timedelta(minutes=40))
    evaluate_slos(slo_ids=[slo.pk])
    assert not Alert.objects.exists()
    row = SloMinute.objects.get(slo=slo)
    assert (row.minute, row.good, row.total) == (floor_minute(good.finished_at), 5, 5)

    bad = finish(scheduled_run(slo), 3, at=now - timedelta(minutes=20))
    evaluate_slos(slo_ids=[slo.pk])
    alert = Alert.objects.get()
    assert (alert.status, alert.severity) == (AlertStatus.FIRING, "page")
    assert alert.labels == {"alertname": "SloQualityBelowFloor", "slo": "chat-quality", "severity": "page",
                            "sli": "quality", "window": "7d", "scope": "deployment", "deployment": "chat"}
    assert alert.annotations["score"] == "0.6000" and alert.annotations["floor"] == "0.8000"
    assert alert.annotations["failing_cases_url"].endswith(f"/evals/runs/{bad.pk}/")
    assert f"/evals/runs/{bad.pk}/" in alert.annotations["description"]
    assert "3 of 5 cases passed (60.0%)" in alert.annotations["description"]
    assert "below the floor 80.0%" in alert.annotations["summary"]
    slo.status.refresh_from_db()
    assert (slo.status.good, slo.status.total, slo.status.sli) == (8, 10, 0.8)
    # The page holds whatever the window's pass rate: a quality drop is a level, not a rate (and the
    # window's 10 cases are fewer than min_requests, which guards burn rates only).
    assert slo.status.state == "insufficient"

    evaluate_slos(slo_ids=[slo.pk])
    assert Alert.objects.get().status == AlertStatus.FIRING  # no new run: still the latest
    # The alert page shows the runs' scores against the floor, each linked to its failing cases.
    client.force_login(make_user("viewer"))
    html = client.get(f"/alerts/{alert.pk}/").content.decode()
    assert 'id="slo-quality-chart"' in html and f'href="/evals/runs/{bad.pk}/">run {bad.pk}</a>' in html
    assert "3 of 5" in html and "burn" not in html.split('id="slo"')[1].split("</h2>")[0]

    back = finish(scheduled_run(slo), 4, at=now)
    evaluate_slos(slo_ids=[slo.pk])
    alert.refresh_from_db()
    assert alert.status == AlertStatus.RESOLVED
    assert alert.annotations["eval_run"] == str(back.pk) and "at or above the floor" in alert.annotations["summary"]
    assert Alert.objects.count() == 1
    history = quality.run_history(slo)
    assert [(h["run"], h["score"], h["url"]) for h in history] == [
        (good.pk, 1.0, f"/evals/runs/{good.pk}/"), (bad.pk, 0.6, f"/evals/runs/{bad.pk}/"),
        (back.pk, 0.8, f"/evals/runs/{back.pk}/")]


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)
def test_the_slo_page_charts_each_runs_score_against_the_floor_and_links_it(live_server, page, page_errors,  # noqa: F811
                                                                             make_user, smoke):
    slo = quality_slo(smoke, objective=0.8)
    evaluate_slos()
    now = timezone.now()
    good = finish(scheduled_run(slo), 5, at=now - timedelta(minutes=30))
    bad = finish(scheduled_run(slo), 2, at=now - timedelta(minutes=10))
    evaluate_slos()
    user = make_user("viewer")
    user.set_password("pw-viewer-123456")
    user.save()
    log_in(page, live_server.url, user.username, "pw-viewer-123456")
    page.goto(f"{live_server.url}/slos/{slo.pk}/")
    page.wait_for_function("() => document.getElementById('chart-quality').dataset.points == 2", timeout=30000)
    chart = page.locator("#chart-quality")
    assert chart.get_attribute("data-links") == f"/evals/runs/{good.pk}/ /evals/runs/{bad.pk}/"
    assert page.evaluate("document.getElementById('chart-quality').layout.shapes[0].y0") == 0.8
    assert "floor 0.8" in chart.inner_text()
    assert "page when the latest eval run scores below 0.8" in page.locator("#rules").inner_text()
    # A point is its run: clicking one opens the run's page with its failing cases.
    page.evaluate("""() => { const el = document.getElementById('chart-quality');
                             el.emit('plotly_click', {points: [{customdata: el.data[0].customdata[1]}]}); }""")
    page.wait_for_url(f"{live_server.url}/evals/runs/{bad.pk}/")
    assert page_errors == []


def test_a_run_counts_once_and_only_for_its_slos(smoke):
    slo = quality_slo(smoke)
    other_set = eval_set_with(CASES, name="other").eval_set
    other = Slo.objects.create(name="chat-other", deployment=slo.deployment, sli_kind="quality", eval_set=other_set,
                               eval_every_s=900, objective=0.8, window="7d")
    evaluate_slos()
    run = finish(scheduled_run(slo), 2)
    run_finished.send_robust(sender=EvalRun, run=run)  # sent again: still counted once
    assert list(SloEvalRun.objects.values_list("slo_id", "good", "total")) == [(slo.pk, 2, 5)]
    assert not SloMinute.objects.filter(slo=other).exists()
    # A run someone started by hand is not the schedule's, and a failed run has no score to count.
    manual = EvalRun.objects.create(eval_set=smoke, set_version=run.set_version, target_kind="deployment",
                                    deployment=slo.deployment, deployment_name="chat", priority=-1000)
    finish(manual, 0)
    failed = scheduled_run(slo)
    EvalRun.objects.filter(pk=failed.pk).update(status=RunStatus.FAILED, finished_at=timezone.now())
    failed.refresh_from_db()
    run_finished.send_robust(sender=EvalRun, run=failed)
    assert SloEvalRun.objects.count() == 1
    evaluate_slos()
    assert SloMinute.objects.get(slo=slo).cum_total == 5


def test_a_redefined_quality_slo_counts_its_new_sets_runs_from_the_backfill(api, smoke):
    client = api("operator")
    slo_id = post(client).json()["id"]
    slo = Slo.objects.get(pk=slo_id)
    evaluate_slos()
    finish(scheduled_run(slo), 5)
    other_set = eval_set_with(CASES, name="other").eval_set
    other_run = EvalRun.objects.create(eval_set=other_set, set_version=other_set.latest_version(),
                                       target_kind="deployment", deployment=slo.deployment, deployment_name="chat",
                                       priority=-1000, trigger=Trigger.SLO)
    finish(other_run, 1)  # no SLO on that set yet: counted nowhere
    assert SloEvalRun.objects.count() == 1
    changed = client.patch(f"/api/v1/slos/{slo_id}/", {"sli": {"kind": "quality", "eval_set": "other",
                                                                "every": "15m"}}, format="json")
    assert changed.status_code == 200, changed.content
    assert not SloMinute.objects.filter(slo_id=slo_id).exists()
    evaluate_slos()
    assert list(SloEvalRun.objects.values_list("run_id", "good", "total")) == [(other_run.pk, 1, 5)]
    assert Slo.objects.get(pk=slo_id).status.sli == 0.2


def test_evaluation_reads_no_usage_events_for_a_quality_slo(smoke, add_events):
    slo = quality_slo(smoke)
    evaluate_slos()
    add_events(timezone.now(), good=3, bad=3)  # requests on its deployment are not eval cases
    evaluate_slos()
    assert not SloMinute.objects.filter(slo=slo).exists()


# ---------------------------------------------------------------------------- interchange


def test_openslo_export_says_what_it_can_and_import_maps_it_back(make_user, smoke):
    slo = quality_slo(smoke, every_s=21600)
    text = export_slos([slo])
    documents = list(yaml.safe_load_all(text))
    document = documents[1]
    annotations = document["metadata"]["annotations"]
    assert annotations["inferops.io/eval-set"] == "smoke" and annotations["inferops.io/eval-every"] == "6h"
    assert "latest eval run scores below the objective" in annotations["inferops.io/alerting"]
    ratio = document["spec"]["indicator"]["spec"]["ratioMetric"]
    assert ratio["good"]["metricSource"] == {"type": "inferops", "spec": {"sli": "quality", "cases": "passed"}}
    assert ratio["total"]["metricSource"] == {"type": "inferops", "spec": {"sli": "quality", "cases": "all"}}
    assert document["spec"]["objectives"] == [{"target": 0.8}] and "alertPolicies" not in document["spec"]

    slo.delete()
    [imported] = import_text(text, actor=make_user("operator"))
    assert (imported.sli_kind, imported.eval_set, imported.eval_every_s, imported.objective) == (
        "quality", smoke, 21600, 0.8)
    assert export_slos([imported]) == text  # round trip


def test_openslo_import_refuses_what_a_quality_slo_cannot_be(make_user, smoke):
    from slo.openslo import OpenSloRefused

    slo = quality_slo(smoke)
    document = list(yaml.safe_load_all(export_slos([slo])))
    slo.delete()
    spec = document[1]["spec"]
    spec["alertPolicies"] = [{"kind": "AlertPolicy", "spec": {"conditions": []}}]
    spec["indicator"]["spec"]["ratioMetric"]["good"]["metricSource"]["spec"]["cases"] = "failed"
    document[1]["metadata"]["annotations"]["inferops.io/eval-set"] = "no-such-set"
    document[1]["metadata"]["annotations"]["inferops.io/eval-every"] = "soon"
    operator = make_user("operator")
    with pytest.raises(OpenSloRefused) as refused:
        import_text(yaml.safe_dump_all(document), actor=operator)
    fields = {problem.path for problem in refused.value.problems}
    assert fields == {"spec.alertPolicies", "spec.indicator.spec.ratioMetric.good.metricSource.spec.cases",
                      "metadata.annotations.inferops.io/eval-every"}
    document[1]["metadata"]["annotations"]["inferops.io/eval-every"] = "15m"
    del spec["alertPolicies"]
    spec["indicator"]["spec"]["ratioMetric"]["good"]["metricSource"]["spec"]["cases"] = "passed"
    with pytest.raises(OpenSloRefused) as refused:
        import_text(yaml.safe_dump_all(document), actor=operator)
    assert [problem.path for problem in refused.value.problems] == ["metadata.annotations.inferops.io/eval-set"]
    assert not Slo.objects.exists()


def test_prometheus_rules_are_refused_for_a_quality_slo_as_for_other_kinds_they_cannot_express(api, smoke):
    slo = quality_slo(smoke)
    with pytest.raises(RulesUnavailable, match="eval runs"):
        slo_rules(slo)
    response = api("viewer").get(f"/api/v1/slos/{slo.pk}/prometheus-rules/")
    assert response.status_code == 422 and "pass rate of inferops' eval runs" in response.json()["detail"]

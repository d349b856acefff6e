"""Goodput curves and capacity runs through the REST API and the console: what they take and refuse, who
may, and a run's task against a replica stand-in (tests/runtime/test_loadgen_curve.py's slot responder):
straight to the replica, at the lowest priority, goodput counted against the deployment's SLO targets."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.authtoken.models import Token

from capacity import runs, tasks
from capacity.choices import CurveSource, RunStatus
from capacity.models import CapacityCurve, CapacityRun
from deployments.choices import Backend, ReplicaState
from deployments.models import Deployment, Replica
from inferops.models import AuditEvent
from slo.services import slo_create
from tests.browser.conftest import browser, log_in, page, page_errors  # noqa: F401
from tests.capacity.test_planner import RECORDED
from tests.runtime.test_loadgen_curve import slot_server  # noqa: F401
from tests.slo.conftest import make_deployment

CURVES = "/api/v1/capacity/curves/"
RUNS = "/api/v1/deployments/chat/capacity-runs/"


def curve_body(**fields) -> dict:
    return {"deployment": "chat", "input_len": 32, "output_len": 32, "slo_ms": {"ttft": 300, "tpot": 50},
            "points": RECORDED, **fields}


def ready_replica(deployment: Deployment, url: str = "http://127.0.0.1:9") -> Replica:
    return Replica.objects.create(deployment=deployment, version=deployment.version, node="test", url=url,
                                  state=ReplicaState.READY, engine_args=deployment.engine_args,
                                  ready_at=timezone.now())


# ---------------------------------------------------------------------------------------------------------------
# Curves


@pytest.mark.django_db
def test_a_bench_curve_is_stored_for_the_deployments_version_hardware_and_engine_args(api, deployment):
    Deployment.objects.filter(pk=deployment.pk).update(engine_args={"cpu_threads": 2, "max_num_seqs": 2})
    response = api("operator").post(CURVES, curve_body(), format="json")
    assert response.status_code == 201, response.json()
    got = response.json()
    assert (got["model"], got["version"], got["hardware"], got["deployment"], got["source"]) == (
        "tiny", 1, "cpu:2", "chat", "bench")
    assert got["engine_args"] == {"cpu_threads": 2, "max_num_seqs": 2} and got["created_by"] == "operator-api"
    assert got["slo_ms"] == {"ttft": 300.0, "tpot": 50.0}
    assert [point["rps"] for point in got["points"]] == [4, 8, 16, 24, 32, 48]
    assert AuditEvent.objects.filter(action="capacity.curve.create", actor_name="operator-api").count() == 1
    viewer = api("viewer")
    assert viewer.get(f"{CURVES}{got['id']}/").json() == got
    listed = viewer.get(f"{CURVES}?model=tiny&version=1&hardware=cpu:2&deployment=chat&source=bench").json()
    assert listed["count"] == 1 and listed["results"][0]["id"] == got["id"]
    assert viewer.get(f"{CURVES}?hardware=gpu:H100x1").json()["count"] == 0
    assert viewer.get(f"{CURVES}?version=1").status_code == 400
    assert viewer.get(f"{CURVES}?source=guess").json() == {"source": ["One of: bench, capacity-run."]}


@pytest.mark.django_db
def test_a_curve_by_model_version_and_hardware(api, deployment):
    response = api("operator").post(CURVES, curve_body(deployment=None, model="tiny", version=1, hardware="gpu:L4x1",
                                                       engine_args={"max_num_seqs": 8}) | {"deployment": "x"},
                                    format="json")
    assert response.status_code == 400  # deployment and model together
    body = curve_body(model="tiny", version=1, hardware="gpu:L4x1", engine_args={"max_num_seqs": 8})
    del body["deployment"]
    got = api("operator").post(CURVES, body, format="json").json()
    assert (got["hardware"], got["deployment"], got["engine_args"]) == ("gpu:L4x1", "", {"max_num_seqs": 8})


def point(**fields) -> dict:
    return {**RECORDED[0], **fields}


@pytest.mark.django_db
@pytest.mark.parametrize(("body", "field", "fragment"), [
    (curve_body(deployment="nope"), "deployment", "No deployment named 'nope'."),
    ({k: v for k, v in curve_body().items() if k != "deployment"}, "model", "Give deployment, or model"),
    (curve_body(points=[]), "points", "at least 1 elements"),
    (curve_body(points=[point(rps=rate) for rate in range(1, 60)]), "points", "no more than 50 elements"),
    (curve_body(points=[point(rps=4), point(rps=2)]), "points", "must rise"),
    (curve_body(points=[point(rps=4), point(rps=4)]), "points", "must rise"),
    (curve_body(points=[point(rps=0)]), "points", "more than 0"),
    (curve_body(points=[point(rps=-3)]), "points", "more than 0"),
    (curve_body(points=[point(throughput_rps=-1)]), "points", "greater than or equal to 0"),
    (curve_body(points=[point(ttft_p95_ms="NaN")]), "points", "A valid number is required"),
    (curve_body(points=[point(ttft_p95_ms="Infinity")]), "points", "A valid number is required"),
    (curve_body(points=[point(rps=True)]), "points", "A valid number is required"),
    (curve_body(points=[point(completed=1.5)]), "points", "valid integer"),
    (curve_body(points=[point(completed="many")]), "points", "valid integer"),
    (curve_body(points=[point(ttft_p95_ms=None)]), "points", "give their TTFT p95"),
    (curve_body(points=[point(goodput_rps=9)]), "points", "Cannot exceed throughput_rps"),
    (curve_body(points=[point(latency=3)]), "points", "Unknown field"),
    (curve_body(points="fast"), "points", "Expected a list"),
    (curve_body(points=[7]), "points", "Invalid data"),
    (curve_body(input_len=0), "input_len", "greater than or equal to 1"),
    (curve_body(output_len="long"), "output_len", "valid integer"),
    (curve_body(slo_ms={"latency": 5}), "slo_ms", "Unknown metric 'latency'"),
    (curve_body(slo_ms={"ttft": -5}), "slo_ms", "positive number"),
    (curve_body(slo_ms={"ttft": True}), "slo_ms", "positive number"),
    (curve_body(slo_ms=[300]), "slo_ms", "An object"),
    (curve_body(surprise=1), "surprise", "Unknown field"),
    ({**curve_body(deployment=None), "model": "tiny", "version": 1, "hardware": "a big box"}, "hardware",
     "gpu:<type>x<count>"),
])
def test_bad_curves_are_400_on_the_field_and_store_nothing(api, deployment, body, field, fragment):
    body = {key: value for key, value in body.items() if value is not None}
    response = api("operator").post(CURVES, body, format="json")
    assert response.status_code == 400, response.json()
    assert fragment in json.dumps(response.json()[field]), response.json()
    assert not CapacityCurve.objects.exists() and not AuditEvent.objects.filter(action__startswith="capacity").exists()


@pytest.mark.django_db
def test_curves_need_the_operator_role_to_store_and_a_viewer_to_read(api, deployment):
    assert api(None).get(CURVES).status_code == 401
    assert api("viewer").post(CURVES, curve_body(), format="json").status_code == 403
    assert api("viewer").get(CURVES).status_code == 200
    assert api("viewer").get(f"{CURVES}999/").status_code == 404
    assert api("operator").put(f"{CURVES}999/", {}, format="json").status_code == 405


# ---------------------------------------------------------------------------------------------------------------
# Capacity runs


@pytest.mark.django_db
def test_a_run_is_queued_with_defaults_and_a_second_is_refused_while_it_is_active(api, deployment, monkeypatch):
    queued = []
    monkeypatch.setattr(runs, "enqueue", lambda name, run_id: queued.append((name, run_id)))
    client = api("operator")
    refused = client.post(RUNS, {}, format="json")
    assert refused.status_code == 409 and "No ready replica of chat" in refused.json()["detail"]
    ready_replica(deployment)
    with pytest.MonkeyPatch.context():
        response = client.post(RUNS, {}, format="json")
    assert response.status_code == 202, response.json()
    got = response.json()
    assert got["links"] == {"self": f"{RUNS}{got['id']}/"}
    assert (got["deployment"], got["status"], got["rates"], got["step_s"]) == ("chat", "queued",
                                                                              [0.5, 1.0, 2.0, 4.0, 8.0], 20.0)
    # The version's context is 256 tokens: the defaults shrink to fit it.
    assert (got["input_len"], got["output_len"]) == (128, 64)
    assert got["curve"] is None and got["estimated_finish_at"] is None and got["created_by"] == "operator-api"
    assert AuditEvent.objects.filter(action="capacity.run.create").count() == 1
    again = client.post(RUNS, {"rates": [1, 2]}, format="json")
    assert again.status_code == 409 and f"Capacity run {got['id']} of chat is queued" in again.json()["detail"]
    listed = api("viewer").get(RUNS).json()
    assert listed["count"] == 1 and listed["results"][0]["id"] == got["id"]
    assert api("viewer").get(f"{RUNS}{got['id']}/").json()["status"] == "queued"


@pytest.mark.django_db
def test_a_run_whose_worker_died_does_not_block_the_next(api, deployment, monkeypatch):
    monkeypatch.setattr(runs, "enqueue", lambda name, run_id: None)
    ready_replica(deployment)
    long_ago = timezone.now() - timedelta(hours=2)
    stuck = CapacityRun.objects.create(deployment=deployment, status=RunStatus.RUNNING, rates=[1, 2], step_s=20,
                                       input_len=8, output_len=8, started_at=long_ago)
    never = CapacityRun.objects.create(deployment=make_deployment("other"), rates=[1], step_s=20, input_len=8,
                                       output_len=8)
    CapacityRun.objects.filter(pk=never.pk).update(created_at=long_ago)
    assert api("operator").post(RUNS, {"rates": [1, 2], "step_s": 5}, format="json").status_code == 202
    stuck.refresh_from_db()
    assert stuck.status == "failed" and "worker stopped" in stuck.error
    never.refresh_from_db()
    assert never.status == "queued"  # another deployment's: left to its own next request


@pytest.mark.django_db
@pytest.mark.parametrize(("body", "field", "fragment"), [
    ({"rates": list(range(1, 12))}, "rates", "no more than 10"),
    ({"rates": [float(rate) for rate in range(1, 10_000)]}, "rates", "no more than 10"),
    ({"rates": []}, "rates", "at least 1 elements"),
    ({"rates": [4, 2]}, "rates", "must rise"),
    ({"rates": [-1, 2]}, "rates", "more than 0"),
    ({"rates": [1, 1000]}, "rates", "less than or equal to 200"),
    ({"rates": ["fast"]}, "rates", "A valid number is required"),
    ({"rates": [True]}, "rates", "A valid number is required"),
    ({"rates": ["nan"]}, "rates", "A valid number is required"),
    ({"rates": "1,2,4"}, "rates", "Expected a list"),
    ({"step_s": 1}, "step_s", "greater than or equal to 5"),
    ({"step_s": 3600}, "step_s", "less than or equal to 120"),
    ({"step_s": "Infinity"}, "step_s", "A valid number is required"),
    ({"input_len": 200, "output_len": 100}, "input_len", "past the version's context of 256"),
    ({"output_len": 0}, "output_len", "greater than or equal to 1"),
    ({"output_len": 10**12}, "output_len", "less than or equal to"),
    ({"replica": 3}, "replica", "Unknown field"),
])
def test_bad_runs_are_400_on_the_field_and_queue_nothing(api, deployment, body, field, fragment):
    ready_replica(deployment)
    response = api("operator").post(RUNS, body, format="json")
    assert response.status_code == 400, response.json()
    assert fragment in json.dumps(response.json()[field]), response.json()
    assert not CapacityRun.objects.exists()


@pytest.mark.django_db
def test_runs_roles_and_unknown_deployments_and_runs(api, deployment):
    ready_replica(deployment)
    assert api(None).post(RUNS, {}, format="json").status_code == 401
    assert api("viewer").post(RUNS, {}, format="json").status_code == 403
    assert api("operator").post("/api/v1/deployments/nope/capacity-runs/", {}, format="json").status_code == 404
    other = CapacityRun.objects.create(deployment=make_deployment("other"), rates=[1], step_s=20, input_len=8,
                                       output_len=8)
    assert api("viewer").get(f"{RUNS}{other.pk}/").status_code == 404  # not chat's
    assert api("viewer").get("/api/v1/deployments/other/capacity-runs/").json()["count"] == 1
    assert api("operator").post(RUNS, b"{", content_type="application/json").status_code == 400
    assert api("operator").post(RUNS, b"[1, 2]", content_type="application/json").status_code == 400


@pytest.mark.django_db
def test_the_task_measures_one_replica_directly_at_the_lowest_priority_and_stores_the_curve(
        deployment, slot_server, make_user):  # noqa: F811
    responder, url = slot_server
    responder.payloads.clear()
    slo_create(actor=None, name="chat-latency", deployment=deployment, sli_kind="latency", ttft_ms=500, tpot_ms=100,
               objective=0.99)
    replica = ready_replica(deployment, url)
    actor = make_user("operator")
    run = CapacityRun.objects.create(deployment=deployment, rates=[5, 10], step_s=0.6, input_len=8, output_len=4,
                                     created_by=actor)
    assert tasks.execute_capacity_run(run.pk) == "succeeded"
    assert tasks.execute_capacity_run(run.pk) == "not queued"  # claimed once
    run.refresh_from_db()
    assert run.status == "succeeded" and run.error == "" and run.started_at <= run.finished_at
    curve = run.curve
    assert (curve.source, curve.deployment, curve.hardware, curve.version_id) == (
        CurveSource.CAPACITY_RUN, "chat", f"cpu:{runs_cpu(deployment)}", deployment.version_id)
    assert curve.slo_ms == {"ttft": 500.0, "tpot": 100.0} and curve.engine_args == replica.engine_args
    assert (curve.input_len, curve.output_len, curve.created_by) == (8, 4, actor)
    assert [p["rps"] for p in curve.points] == [5, 10] and [p["completed"] for p in curve.points] == [3, 6]
    assert all(p["goodput_rps"] is not None for p in curve.points)
    assert {p["model"] for p in responder.payloads} == {"chat"}
    assert {p["priority"] for p in responder.payloads} == {runs.LOWEST_PRIORITY}
    assert {p["max_tokens"] for p in responder.payloads} == {4}


def runs_cpu(deployment: Deployment) -> str:
    from capacity.curves import deployment_held

    return f"{deployment_held(deployment).cpus.normalize():f}"


@pytest.mark.django_db
def test_a_run_fails_saying_why_when_its_replica_answers_nothing_or_is_gone(deployment):
    replica = ready_replica(deployment)  # port 9: nothing listens
    run = CapacityRun.objects.create(deployment=deployment, rates=[5], step_s=0.4, input_len=8, output_len=4)
    assert runs.capacity_run_execute(run.pk) == "failed"
    run.refresh_from_db()
    assert run.status == "failed" and f"replica {replica.pk} (http://127.0.0.1:9) completed no request" in run.error
    assert not CapacityCurve.objects.exists()
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.STOPPED)
    gone = CapacityRun.objects.create(deployment=deployment, rates=[5], step_s=0.4, input_len=8, output_len=4)
    assert runs.capacity_run_execute(gone.pk) == "failed"
    gone.refresh_from_db()
    assert "no ready replica of chat" in gone.error


@pytest.mark.django_db
def test_vllm_replicas_get_no_priority_field(deployment):
    Deployment.objects.filter(pk=deployment.pk).update(backend=Backend.VLLM)
    deployment.refresh_from_db()
    run = CapacityRun(deployment=deployment, rates=[1], step_s=5, input_len=8, output_len=4, pk=3)
    config = runs.bench_config(run, ready_replica(deployment), {})
    assert config.priority is None and config.tokenizer_dir is None  # /nowhere has no tokenizer
    assert config.timeout_s == 10.0


# ---------------------------------------------------------------------------------------------------------------
# The console: the panel and its button


@pytest.mark.django_db
def test_the_panel_plans_current_and_typed_traffic_and_draws_the_curve(client, make_user, deployment, api):
    client.force_login(make_user("viewer"))
    html = client.get("/deployments/chat/").content.decode()
    assert 'id="capacity-plan-panel"' in html and 'id="capacity-no-curve"' in html
    assert 'id="capacity-run-form"' not in html  # viewers get no button
    slo_create(actor=None, name="chat-latency", deployment=deployment, sli_kind="latency", ttft_ms=300, tpot_ms=50,
               objective=0.99)
    api("operator").post(CURVES, curve_body(), format="json")
    html = client.get("/deployments/chat/?plan_rps=80&plan_headroom=0.2").content.decode()
    assert 'id="capacity-plan-table"' in html and 'data-row="current-traffic"' in html
    assert 'data-row="typed-rate"' in html and "<strong>4</strong>" in html  # 80 req/s on 32.47 × 0.8 = 25.98 a replica
    assert 'id="capacity-chart-data"' in html and "whenPlotly" in html
    bad = client.get("/deployments/chat/?plan_rps=lots").content.decode()
    assert "Requests per second: &#x27;lots&#x27; is not a number." in bad


@pytest.mark.django_db
def test_the_button_starts_a_run_for_operators_and_says_why_not(client, make_user, deployment, monkeypatch):
    monkeypatch.setattr(runs, "enqueue", lambda name, run_id: None)
    url = "/capacity/deployments/chat/capacity-runs/"
    client.force_login(make_user("viewer"))
    assert client.post(url, {}).status_code == 403
    client.force_login(make_user("operator"))
    assert client.get(url).status_code == 405
    refused = client.post(url, {}, follow=True)
    assert "No ready replica of chat" in refused.content.decode()
    ready_replica(deployment)
    bad = client.post(url, {"rates": "1, 2, x"}, follow=True).content.decode()
    assert "rates: &#x27;1, 2, x&#x27; is not numbers" in bad
    bad = client.post(url, {"rates": "4, 2"}, follow=True).content.decode()
    assert "rates: Rates must rise" in bad
    response = client.post(url, {"rates": "1, 2 4", "step_s": "10"})
    assert response.status_code == 302 and response["Location"] == "/deployments/chat/#capacity-plan"
    run = CapacityRun.objects.get()
    assert (run.rates, run.step_s, run.created_by.username) == ([1.0, 2.0, 4.0], 10.0, "operator-user")
    html = client.get("/deployments/chat/").content.decode()
    assert 'id="capacity-run-active"' in html and 'data-status="queued"' in html


@pytest.mark.django_db(transaction=True)
def test_inferops_bench_save_curve_stores_the_curve_through_the_api(live_server, slot_server, make_user,  # noqa: F811
                                                                    monkeypatch, capsys):
    from project.cli import main

    _, url = slot_server
    make_deployment()
    token = Token.objects.create(user=make_user("operator"))
    monkeypatch.setenv("INFEROPS_URL", live_server.url)
    monkeypatch.setenv("INFEROPS_TOKEN", token.key)
    argv = ["bench", "--base-url", url, "--model", "chat", "--input-len", "8", "--output-len", "4",
            "--rates", "5,10", "--step-seconds", "0.6", "--goodput", "ttft:500", "tpot:100", "--save-curve", "chat"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    curve = CapacityCurve.objects.get()
    assert f"curve {curve.pk} saved: tiny v1 on {curve.hardware} (2 steps)" in out
    assert curve.source == "bench" and curve.slo_ms == {"ttft": 500.0, "tpot": 100.0}
    assert [p["completed"] for p in curve.points] == [3, 6] and (curve.input_len, curve.output_len) == (8, 4)
    # Refused: a deployment that does not exist, said in words.
    assert main([*argv[:-1], "nope"]) == 2
    assert "refused (HTTP 400): deployment: No deployment named 'nope'." in capsys.readouterr().err


# Last in the module: Playwright's loop stays in this thread while its (module) browser is open, and a later
# asyncio.run() (the load generator's) would find it.
WATCH_VIOLATIONS = """
window.__csp = [];
document.addEventListener("securitypolicyviolation", e => window.__csp.push(e.violatedDirective));
"""


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)
def test_the_panel_draws_the_curve_and_plans_a_typed_rate_in_a_browser(live_server, page, page_errors,  # noqa: F811
                                                                       make_user, settings):
    from capacity.curves import curve_create, deployment_hardware

    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    chat = make_deployment()
    make_user("operator")
    slo_create(actor=None, name="chat-latency", deployment=chat, sli_kind="latency", ttft_ms=300, tpot_ms=50,
               objective=0.99)
    curve_create(version=chat.version, hardware=deployment_hardware(chat), engine_args={}, deployment="chat",
                 source=CurveSource.BENCH, input_len=32, output_len=32, slo_ms={"ttft": 300.0, "tpot": 50.0},
                 points=RECORDED, actor=None)
    page.add_init_script(WATCH_VIOLATIONS)
    log_in(page, live_server.url, "operator-user", "pw-12345678")
    page.goto(f"{live_server.url}/deployments/chat/")
    page.wait_for_selector("#capacity-chart .main-svg")  # plotly drew the curve
    assert page.locator("#capacity-chart .scatterlayer .trace").count() == 4
    page.fill("#plan-rps", "80")
    page.click("#capacity-plan-submit")
    page.wait_for_url("**/deployments/chat/?plan_rps=80*")
    assert page.locator('tr[data-row="typed-rate"] td.replicas').inner_text() == "4"
    assert page.evaluate("window.__csp") == [] and page_errors == []

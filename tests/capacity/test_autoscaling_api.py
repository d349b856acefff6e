"""PUT/GET /api/v1/deployments/{name}/autoscaling/ and its decisions; the console form; one tick of the
autoscaler against the database (the replicas' /metrics are not reached: none is ready here)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from capacity import scaling
from capacity.models import ScalingDecision, ScalingState
from deployments.models import Deployment, Replica
from deployments.replicas.metrics_query import deployment_events
from inferops.models import AuditEvent
from slo.services import slo_create

pytestmark = pytest.mark.django_db
URL = "/api/v1/deployments/chat/autoscaling/"


def body(**fields) -> dict:
    return {"enabled": True, "min_replicas": 0, "max_replicas": 3, "signals": {"waiting_per_replica": 2}, **fields}


def test_put_then_get_the_policy_with_defaults_filled_in(api, deployment):
    client = api("operator")
    before = client.get(URL).json()
    assert before["enabled"] is False and before["signals"] == {"waiting_per_replica": 2.0, "kv_usage": 0.85}
    response = client.put(URL, body(scale_up={"step": 2}, hold={"max_wait_s": 30}), format="json")
    assert response.status_code == 200, response.json()
    got = response.json()
    assert (got["enabled"], got["min_replicas"], got["max_replicas"]) == (True, 0, 3)
    assert got["scale_up"] == {"step": 2, "stabilization_s": 30}
    assert got["hold"] == {"max_wait_s": 30.0, "max_queue": 100}
    assert got["decisions"] == [] and got["parked"] is False
    assert api("viewer").get(URL).json() == got
    deployment.refresh_from_db()
    assert deployment.autoscale and deployment.min_replicas == 0 and deployment.autoscaling["scale_up"] == {"step": 2}
    assert AuditEvent.objects.filter(action="deployment.autoscaling").count() == 1


def test_the_routing_entry_says_the_gateway_may_hold_requests_only_for_a_deployment_that_can_park(api, deployment):
    from deployments.replicas.routing import scale_from_zero

    assert scale_from_zero(deployment) is None
    api("operator").put(URL, body(hold={"max_wait_s": 30, "max_queue": 5}), format="json")
    deployment.refresh_from_db()
    assert scale_from_zero(deployment) == {"max_wait_s": 30.0, "max_queue": 5}
    api("operator").put(URL, body(min_replicas=1), format="json")
    deployment.refresh_from_db()
    assert scale_from_zero(deployment) is None


def test_tighter_bounds_bring_the_replicas_inside_at_once_as_a_recorded_decision(api, deployment):
    Deployment.objects.filter(pk=deployment.pk).update(replicas=5, max_replicas=5)
    got = api("operator").put(URL, body(min_replicas=1, max_replicas=2), format="json").json()
    assert got["replicas"] == 2
    assert got["decisions"][0]["kind"] == "bound" and got["decisions"][0]["from_replicas"] == 5
    assert AuditEvent.objects.filter(action="deployment.autoscale").exists()


@pytest.mark.parametrize(("sent", "field", "fragment"), [
    (body(min_replicas=4), "min_replicas", "exceeds max_replicas"),
    (body(signals={}), "signals", "at least one signal"),
    (body(signals={"queue": 2}), "signals", "Unknown signal 'queue'"),
    (body(signals={"kv_usage": 1.5}), "signals", "kv_usage: the target is KV-cache usage"),
    (body(signals={"ttft_p95_headroom": 0.8}), "signals", "no latency or goodput SLO"),
    (body(signals={"burn_rate": 2}), "signals", "needs an SLO"),
    (body(scale_down={"stabilization_s": -1}), "scale_down", "greater than or equal to 0"),
    (body(scale_up={"step": "two"}), "scale_up", "valid integer"),
    (body(park_after_s=5), "park_after_s", "greater than or equal to 30"),
    (body(hold={"max_queue": 0}), "hold", "greater than or equal to 1"),
    (body(surprise=1), "surprise", "Unknown field"),
    ({"enabled": True}, "min_replicas", "required"),
])
def test_bad_policies_are_400_on_the_field_and_write_nothing(api, deployment, sent, field, fragment):
    response = api("operator").put(URL, sent, format="json")
    assert response.status_code == 400
    assert fragment in json.dumps(response.json()[field]), response.json()
    deployment.refresh_from_db()
    assert not deployment.autoscale and deployment.autoscaling == {}
    assert not AuditEvent.objects.filter(action="deployment.autoscaling").exists()


def test_slo_signals_are_accepted_once_an_slo_sets_the_threshold(api, deployment):
    slo_create(actor=None, name="chat-ttft", deployment=deployment, sli_kind="latency", ttft_ms=500,
               objective=0.99, window="1d")
    response = api("operator").put(URL, body(signals={"ttft_p95_headroom": 0.8, "burn_rate": 2}), format="json")
    assert response.status_code == 200, response.json()


@pytest.mark.parametrize("raw", [b"{", b"[]", b'"x"'])
def test_malformed_bodies_are_400(api, deployment, raw):
    assert api("operator").put(URL, raw, content_type="application/json").status_code == 400


def test_roles_and_unknown_deployments(api, deployment):
    assert api("viewer").put(URL, body(), format="json").status_code == 403
    assert api(None).get(URL).status_code == 401
    assert api("viewer").get("/api/v1/deployments/nope/autoscaling/").status_code == 404
    assert api("viewer").get(URL + "decisions/?limit=0").status_code == 400
    assert api("viewer").get(URL + "decisions/?limit=x").status_code == 400


def test_one_tick_parks_an_idle_deployment_and_a_held_request_wakes_it(api, deployment, monkeypatch):
    """One ready replica that serves nothing (its /metrics stood in for: no process runs here): with min 0
    the deployment parks once the series covers park_after_s, and a held request asks for a replica back."""
    api("operator").put(URL, body(park_after_s=30, cooldown_s=0), format="json")
    Deployment.objects.filter(pk=deployment.pk).update(replicas=1)
    replica = Replica.objects.create(deployment=deployment, version=deployment.version, node="n", state="ready",
                                     url="http://127.0.0.1:9")
    idle = {"gauges": {"waiting": 0.0, "running": 0.0, "kv_cache_usage": 0.0}, "requests": 5.0, "ttft": {}, "itl": {}}
    monkeypatch.setattr(scaling, "_scrape", lambda replicas: {replica.pk: idle} if replicas else {})
    monkeypatch.setattr(scaling, "request_reconcile", lambda deployment: None)
    start = 1_800_000_000.0
    for tick in range(6):  # 25 s of samples: not yet
        decision = scaling.autoscale(deployment.pk, now=start + tick * 5, held=set())
        assert not decision.changes
    decision = scaling.autoscale(deployment.pk, now=start + 30, held=set())
    assert decision.kind == "park"
    deployment.refresh_from_db()
    assert deployment.replicas == 0
    samples = ScalingState.objects.get(deployment=deployment).samples
    assert len(samples) == 7 and samples[-1]["rps"] == 0 and samples[-1]["ready"] == 1
    Replica.objects.filter(pk=replica.pk).update(state="stopped")
    woken = scaling.autoscale(deployment.pk, now=start + 31, held={"chat"})
    assert woken.kind == "wake"
    kinds = list(ScalingDecision.objects.filter(deployment=deployment).order_by("at")
                 .values_list("kind", "to_replicas"))
    assert kinds == [("park", 0), ("wake", 1)]
    events = AuditEvent.objects.filter(action="deployment.autoscale").order_by("id")
    assert [e.after["kind"] for e in events] == ["park", "wake"]
    # Each decision is a marker on the deployment's charts, with its reason.
    now = timezone.now()
    markers = [e for e in deployment_events(deployment, now - timedelta(hours=1), now + timedelta(minutes=1))
               if e["kind"] == "scale"]
    assert [m["text"].split(":")[1] for m in markers] == [" replicas 1 → 0 (park)", " replicas 0 → 1 (wake)"]
    assert "idle for 30 s" in markers[0]["text"] and "held by the gateway" in markers[1]["text"]


def test_the_console_form_saves_the_policy_and_shows_refusals_on_its_fields(client, make_user, deployment):
    client.force_login(make_user("operator"))
    page = client.get("/deployments/chat/")
    assert b'id="autoscaling-panel"' in page.content and b'id="autoscaling-form"' in page.content
    form = {"autoscaling-enabled": "on", "autoscaling-min_replicas": "0", "autoscaling-max_replicas": "2",
            "autoscaling-signal_kv_usage": "0.7", "autoscaling-park_after_s": "600"}
    response = client.post("/capacity/deployments/chat/autoscaling/", form)
    assert response.status_code == 302 and response["Location"].endswith("#autoscaling")
    deployment.refresh_from_db()
    assert (deployment.autoscale, deployment.min_replicas, deployment.max_replicas) == (True, 0, 2)
    assert deployment.autoscaling["signals"] == {"kv_usage": 0.7} and deployment.autoscaling["park_after_s"] == 600
    bad = client.post("/capacity/deployments/chat/autoscaling/", {**form, "autoscaling-min_replicas": "5"})
    assert bad.status_code == 400 and b"exceeds max_replicas" in bad.content
    viewer = make_user("viewer")
    client.force_login(viewer)
    assert b'id="autoscaling-form"' not in client.get("/deployments/chat/").content
    assert client.post("/capacity/deployments/chat/autoscaling/", form).status_code == 403



def test_a_decision_on_a_count_changed_meanwhile_writes_nothing(deployment, monkeypatch):
    """The tick and the wake task may both see a parked deployment: the second to write finds the count
    moved and records nothing, so one wake is one decision."""
    monkeypatch.setattr(scaling, "request_reconcile", lambda deployment: None)
    Deployment.objects.filter(pk=deployment.pk).update(replicas=0)
    seen_by_both = [Deployment.objects.get(pk=deployment.pk) for _ in range(2)]
    assert scaling.record_decision(seen_by_both[0], 1, "wake", "held", {}) is not None
    assert scaling.record_decision(seen_by_both[1], 1, "wake", "held", {}) is None
    assert ScalingDecision.objects.filter(deployment=deployment).count() == 1


@pytest.mark.parametrize(("autoscale", "status"), [(True, "parked"), (False, "ready")])
def test_a_deployment_at_zero_reads_parked_only_when_its_autoscaler_may_wake_it(deployment, autoscale, status):
    from deployments.replicas.reconcile import Reconciler

    Deployment.objects.filter(pk=deployment.pk).update(replicas=0, min_replicas=0, autoscale=autoscale)
    deployment.refresh_from_db()
    Reconciler(deployment).update_status()
    deployment.refresh_from_db()
    assert deployment.status == status


def test_samples_keep_histograms_only_as_far_back_as_the_latency_signals_look(api, deployment, monkeypatch):
    api("operator").put(URL, body(min_replicas=1, scale_up={"stabilization_s": 30},
                                  scale_down={"stabilization_s": 60}), format="json")
    replica = Replica.objects.create(deployment=deployment, version=deployment.version, node="n", state="ready",
                                     url="http://127.0.0.1:9")
    ticks = iter(range(1, 1000))

    def busy(replicas):
        n = next(ticks)  # one more request a tick, each with a 0.2 s TTFT
        gauges = {"waiting": 0.0, "running": 1.0, "kv_cache_usage": 0.1}
        return {replica.pk: {"gauges": gauges, "requests": float(n), "ttft": {"0.1": 0.0, "0.5": n, "+Inf": n},
                             "itl": {}}}

    monkeypatch.setattr(scaling, "_scrape", busy)
    start = 1_800_000_000.0
    for tick in range(41):  # 200 s
        scaling.autoscale(deployment.pk, now=start + tick * 5, held=set())
    samples = ScalingState.objects.get(deployment=deployment).samples
    kept = [s["at"] - start for s in samples if s["ttft_buckets"]]
    assert kept and min(kept) >= 200 - 60 - 60 and len(samples) == 41  # the series itself is whole
    assert samples[-1]["ttft_buckets"] == {"0.1": 0.0, "0.5": 1.0, "+Inf": 1.0} and samples[-1]["rps"] == 0.2

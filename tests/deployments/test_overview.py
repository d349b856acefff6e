"""Per-deployment health (deployments/overview.py) from real usage rows in Postgres: error rate,
TTFT p95 and how fresh each is, the no-traffic case, replicas, rollouts, degradation and SLO
states; one query per figure however many deployments there are; the list and home pages."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from deployments.choices import ReplicaState
from deployments.models import Deployment, Replica
from deployments.overview import deployment_health, freshness
from deployments.rollouts import services as rollouts
from slo.models import Slo, SloStatus
from tests.deployments.conftest import make_version
from tests.slo.conftest import event, insert_events, make_deployment

pytestmark = pytest.mark.django_db


def usage(deployment: str, at, *, failed: bool = False, **fields) -> dict:
    if failed:
        fields = {"status": 503, "error_kind": "upstream_error", "ttft_ms": None, **fields}
    return event(at, deployment=deployment, **fields)


def slo(name: str, deployment: Deployment, state: str | None, remaining: float = 1.0) -> Slo:
    row = Slo.objects.create(name=name, deployment=deployment, sli_kind="availability", objective=0.99)
    if state is not None:
        SloStatus.objects.create(slo=row, state=state, budget_remaining=remaining, evaluated_at=timezone.now(),
                                 burn_rates={"1h": 2.5, "6h": 1.25})
    return row


def test_error_rate_and_ttft_p95_come_from_the_last_five_minutes_with_their_time():
    make_deployment("chat")
    now = timezone.now().replace(microsecond=0)
    newest_good, newest_failure = now - timedelta(seconds=70), now - timedelta(seconds=40)
    rows = [usage("chat", newest_good - timedelta(seconds=i), ttft_ms=10.0 * (i + 1)) for i in range(18)]
    rows += [usage("chat", newest_failure, failed=True), usage("chat", now - timedelta(seconds=100), failed=True)]
    # Outside the window, or another deployment's: not counted.
    rows += [usage("chat", now - timedelta(minutes=6), failed=True), usage("other", now, failed=True)]
    insert_events(rows)

    [health] = deployment_health(now=now)

    assert health.requests == 20
    assert health.error_rate.value == pytest.approx(2 / 20)
    assert health.error_rate_text == "10.00 %"
    # percentile_cont over the 18 successful TTFTs 10..180 ms: 170 + 0.15 × 10.
    assert health.ttft_p95_ms.value == pytest.approx(171.5)
    # Each figure dates from the newest request it counts: the failures carry no TTFT.
    assert health.error_rate.as_of == newest_failure
    assert health.ttft_p95_ms.as_of == newest_good
    assert health.error_rate.freshness == f"as of {newest_failure:%H:%M:%S} UTC, 40 s ago"
    assert health.ttft_p95_ms.freshness == f"as of {newest_good:%H:%M:%S} UTC, 70 s ago"


def test_no_traffic_in_the_window_reads_as_such_not_as_zero():
    make_deployment("idle")
    now = timezone.now()
    insert_events([usage("idle", now - timedelta(minutes=7))])

    [health] = deployment_health(now=now)

    assert health.requests == 0
    assert health.error_rate.value is None and health.ttft_p95_ms.value is None
    assert health.error_rate_text == "—"
    assert health.error_rate.freshness == health.ttft_p95_ms.freshness == "no traffic in 5 min"


def test_freshness_switches_to_minutes():
    now = timezone.now().replace(microsecond=0)
    assert freshness(now - timedelta(minutes=3, seconds=5), now).endswith(", 3 min ago")


def test_replicas_rollout_degradation_and_the_worst_slo_state():
    chat = make_deployment("chat")
    make_version(chat.model, 2)
    Deployment.objects.filter(pk=chat.pk).update(replicas=3, degradation={"level": 1, "name": "shed-batch"})
    other_version = chat.model.versions.get(number=2)
    for state, version in [(ReplicaState.READY, chat.version), (ReplicaState.READY, chat.version),
                           (ReplicaState.STARTING, chat.version), (ReplicaState.READY, other_version)]:
        Replica.objects.create(deployment=chat, version=version, node="local", state=state)
    rollout = rollouts.rollout_create(deployment=chat, actor=None, version=2)
    slo("chat-latency", chat, "warning", 0.4)
    slo("chat-availability", chat, "exhausted", -0.2)
    slo("chat-new", chat, None)
    make_deployment("quiet")

    chat_health, quiet_health = deployment_health()

    assert (chat_health.ready, chat_health.desired) == (2, 3)  # ready replicas of the pinned version
    assert chat_health.rollout == rollout
    assert chat_health.degradation["name"] == "shed-batch"
    assert [s["name"] for s in chat_health.slos] == ["chat-availability", "chat-latency", "chat-new"]
    assert [s["state"] for s in chat_health.slos] == ["exhausted", "warning", "pending"]
    assert chat_health.slo_state == "exhausted"
    assert quiet_health.rollout is None and quiet_health.degradation is None
    assert quiet_health.slos == [] and quiet_health.slo_state is None


def _fleet(count: int) -> None:
    now = timezone.now()
    start = Deployment.objects.count()
    for index in range(start, start + count):
        deployment = make_deployment(f"d{index}")
        Replica.objects.create(deployment=deployment, version=deployment.version, node="local",
                               state=ReplicaState.READY)
        slo(f"d{index}-availability", deployment, "ok")
        insert_events([usage(deployment.name, now - timedelta(seconds=30)),
                       usage(deployment.name, now - timedelta(seconds=20), failed=True)])


def test_queries_do_not_grow_with_the_number_of_deployments(django_assert_max_num_queries):
    # Deployments (with ready replicas), usage, rollouts, SLO states: four, for one or for twelve.
    _fleet(1)
    with django_assert_max_num_queries(4):
        assert len(deployment_health()) == 1
    _fleet(11)
    with django_assert_max_num_queries(4):
        health = deployment_health()
    assert len(health) == 12
    assert all(row.error_rate.value == 0.5 and row.slo_state == "ok" for row in health)


def test_the_deployment_list_and_home_page_show_the_figures(client, make_user):
    chat = make_deployment("chat")
    slo("chat-availability", chat, "warning", 0.3)
    now = timezone.now()
    insert_events([usage("chat", now - timedelta(seconds=30), ttft_ms=250.0),
                   usage("chat", now - timedelta(seconds=20), failed=True)])
    make_deployment("quiet")
    client.force_login(make_user("viewer"))

    page = client.get("/deployments/").content.decode()
    assert "50.00 %" in page and "250 ms" in page and "s ago" in page
    assert "no traffic in 5 min" in page  # quiet
    assert "chat-availability: warning" in page

    home = client.get("/").content.decode()
    for section in ("firing-panel", "on-call-panel", "deployments-panel", "slo-panel", "cost-panel"):
        assert f'id="{section}"' in home
    assert "50.00 %" in home and "30.0%" in home and "2.50×" in home and "1.25×" in home


def test_too_little_traffic_to_judge_ranks_after_warning_and_before_ok():
    chat = make_deployment("chat")
    slo("chat-availability", chat, "ok")
    slo("chat-latency", chat, "insufficient")
    [health] = deployment_health()
    assert health.slo_state == "insufficient"
    slo("chat-goodput", chat, "warning", 0.5)
    [health] = deployment_health()
    assert health.slo_state == "warning"


@pytest.mark.parametrize(("requests", "text"), [(0, "0"), (1, "0.00333"), (30, "0.10"), (1500, "5.00")])
def test_request_rate_is_the_window_s_requests_per_second_never_a_zero_with_traffic(requests, text):
    make_deployment("chat")
    now = timezone.now()
    insert_events([usage("chat", now - timedelta(seconds=10)) for _ in range(requests)])
    [health] = deployment_health(now=now)
    assert health.requests_per_s_text == text


def test_an_exhausted_and_degraded_deployment_is_unhealthy_on_both_pages(client, make_user):
    chat = make_deployment("chat")
    Deployment.objects.filter(pk=chat.pk).update(status="ready", replicas=1, degradation={"level": 2, "name": ""})
    Replica.objects.create(deployment=chat, version=chat.version, node="local", state=ReplicaState.READY)
    slo("ttft", chat, "exhausted", -0.1)
    make_deployment("quiet")
    Replica.objects.create(deployment=Deployment.objects.get(name="quiet"), version=chat.version, node="local",
                           state=ReplicaState.READY)

    chat_health, quiet_health = deployment_health()
    assert (chat_health.verdict.level, chat_health.verdict.text) == (
        "unhealthy", "SLO ttft budget exhausted; degraded to level 2")
    assert quiet_health.verdict.level == "healthy"

    client.force_login(make_user("viewer"))
    for path in ("/", "/deployments/"):
        page = client.get(path).content.decode()
        assert 'data-health="unhealthy"' in page and 'title="SLO ttft budget exhausted; degraded to level 2"' in page
        assert 'data-health="healthy"' in page


def test_an_offline_batchs_lines_count_as_traffic_but_not_in_the_ttft_p95():
    make_deployment("chat")
    now = timezone.now().replace(microsecond=0)
    newest_interactive = now - timedelta(seconds=60)
    rows = [usage("chat", newest_interactive - timedelta(seconds=i), ttft_ms=10.0 * (i + 1)) for i in range(18)]
    # Batch lines wait behind interactive work by design: minutes to a first token, and newer.
    rows += [usage("chat", now - timedelta(seconds=i), ttft_ms=90_000.0, batch_id="batch_x", priority=-1000)
             for i in range(10)]
    insert_events(rows)

    [health] = deployment_health(now=now)

    assert health.requests == 28
    assert health.ttft_p95_ms.value == pytest.approx(171.5)
    assert health.ttft_p95_ms.as_of == newest_interactive

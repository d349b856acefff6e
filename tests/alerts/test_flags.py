"""An alert's flags (alerts/flags.py) as every list shows them: silenced by an active silence now,
snoozed until when, acknowledged by whom, its latest notification delivery failing, and its source;
read for a page of alerts in a fixed number of queries."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from alerts.flags import attach_flags, muted_count, with_flag_columns
from alerts.models import Alert, Delivery, Integration, Notification, Receiver, Silence
from slo.services import slo_create
from tests.slo.conftest import make_deployment

pytestmark = pytest.mark.django_db

HOUR = timedelta(hours=1)


def alert(name: str, status: str = "firing", **fields) -> Alert:
    labels = {"alertname": name, **fields.pop("labels", {})}
    return Alert.objects.create(fingerprint=name[:16], labels=labels, severity=fields.pop("severity", "page"),
                                status=status, starts_at=timezone.now() - HOUR, **fields)


def silence(value: str, *, starts: timedelta = -HOUR, ends: timedelta = HOUR, regex: bool = False) -> Silence:
    now = timezone.now()
    return Silence.objects.create(matchers=[{"name": "alertname", "value": value, "isRegex": regex, "isEqual": True}],
                                  starts_at=now + starts, ends_at=now + ends, created_by="ops", comment="upgrade")


def delivered(target: Alert, receiver: Receiver, *outcomes: str, round_: int = 0) -> None:
    notification = Notification.objects.create(alert=target, receiver=receiver, alert_status="firing", round=round_)
    for attempt, outcome in enumerate(outcomes, start=1):
        Delivery.objects.create(notification=notification, attempt=attempt, outcome=outcome,
                                error="" if outcome == "ok" else f"HTTP 404 on attempt {attempt}")


def flagged(*alerts: Alert) -> dict[str, object]:
    rows = attach_flags(with_flag_columns(Alert.objects.filter(pk__in=[a.pk for a in alerts])), timezone.now())
    return {row.labels["alertname"]: row.flags for row in rows}


def test_silences_and_snoozes_mute_open_alerts_only():
    long_silence, short_silence = silence("Node.*", ends=3 * HOUR, regex=True), silence("NodeDown")
    silence("NodeDown", starts=HOUR, ends=2 * HOUR)  # not started yet
    silence("DiskFull", starts=-2 * HOUR, ends=-HOUR)  # over
    now = timezone.now()
    flags = flagged(alert("NodeDown"), alert("DiskFull", snoozed_until=now + HOUR),
                    alert("CpuHot", snoozed_until=now - HOUR), alert("NodeGone", status="resolved"))
    # Of two matching silences the one ending last says how long the alert stays muted.
    assert flags["NodeDown"].silence == long_silence != short_silence and flags["NodeDown"].muted
    assert flags["DiskFull"].silence is None and flags["DiskFull"].snoozed_until > now and flags["DiskFull"].muted
    assert not flags["CpuHot"].muted  # the snooze is over
    assert flags["NodeGone"].silence is None and not flags["NodeGone"].muted  # resolved: nothing to mute


def test_acknowledged_by_whom_and_the_latest_delivery(make_user):
    user = make_user(None, "alice")
    hook = Receiver.objects.create(name="hook", url="http://127.0.0.1:9/hook")
    acked = alert("Acked", status="acknowledged", acknowledged_by=user, acknowledged_at=timezone.now())
    by_link = alert("ByLink", status="acknowledged", acknowledged_at=timezone.now())
    failing, recovered, retrying, quiet = alert("Failing"), alert("Recovered"), alert("Retrying"), alert("Quiet")
    delivered(failing, hook, "permanent-error")
    delivered(recovered, hook, "permanent-error")
    delivered(recovered, hook, "ok", round_=1)  # a later notification went through
    delivered(retrying, hook, "temporary-error")
    flags = flagged(acked, by_link, failing, recovered, retrying, quiet)
    assert (flags["Acked"].acknowledged, flags["Acked"].acknowledged_by) == (True, "alice")
    assert (flags["ByLink"].acknowledged, flags["ByLink"].acknowledged_by) == (True, "")
    assert not flags["Failing"].acknowledged
    assert flags["Failing"].delivery_failing and flags["Failing"].delivery_error == "HTTP 404 on attempt 1"
    assert flags["Retrying"].delivery_failing
    assert not flags["Recovered"].delivery_failing and not flags["Quiet"].delivery_failing


def test_the_source_of_each_kind_of_alert():
    prod = Integration.objects.create(name="prod-am", token_prefix="abc", token_hash="h" * 64)
    flags = flagged(
        alert("Posted", integration=prod, labels={"deployment": "not a slug", "rollout": "x"}),
        alert("RolloutAborted", labels={"deployment": "chat", "rollout": "7"}),
        alert("Degraded", labels={"deployment": "chat"}),
        alert("Orphan", labels={"deployment": "not a slug", "rollout": "x"}),  # its integration deleted
        alert("Bare"))
    posted = flags["Posted"].source
    assert (posted.text, posted.url, posted.admin_only) == ("prod-am", f"/alerts/integrations/#integration-{prod.pk}",
                                                            True)
    assert (flags["RolloutAborted"].source.text, flags["RolloutAborted"].source.url) == (
        "rollout 7 of chat", "/deployments/chat/rollouts/7/")
    assert flags["Degraded"].source.url == "/deployments/chat/"
    assert (flags["Orphan"].source.text, flags["Orphan"].source.url) == ("not a slug", "")
    assert flags["Bare"].source.text == "—"


def test_a_page_of_alerts_costs_the_same_queries_however_long():
    hook = Receiver.objects.create(name="hook", url="http://127.0.0.1:9/hook")
    silence("A.*", regex=True)

    def queries(count: int) -> int:
        Alert.objects.all().delete()
        for i in range(count):
            delivered(alert(f"A{i}"), hook, "permanent-error")
        with CaptureQueriesContext(connection) as captured:
            rows = attach_flags(with_flag_columns(Alert.objects.all()), timezone.now())
            assert all(row.flags.silence and row.flags.delivery_failing and row.flags.source.text for row in rows)
        return len(captured.captured_queries)

    assert queries(3) == queries(30) == 2  # the page with its latest deliveries, the active silences


def test_muted_count_reads_silences_and_snoozes():
    silence("NodeDown")
    alert("NodeDown")
    alert("DiskFull", snoozed_until=timezone.now() + HOUR)
    alert("CpuHot")
    assert muted_count(Alert.objects.all(), timezone.now()) == 2


def test_the_slo_pages_show_the_badges_too(client, make_user):
    slo = slo_create(actor=None, name="chat-ttft", deployment=make_deployment(), sli_kind="latency", ttft_ms=150,
                     objective=0.99, window="1d", min_requests=10)
    silence("SloErrorBudgetBurn")
    muted = alert("SloErrorBudgetBurn", slo=slo, labels={"slo": "chat-ttft"})
    client.force_login(make_user("viewer"))
    for url in ("/slos/", f"/slos/{slo.pk}/"):
        text = client.get(url).content.decode()
        assert 'class="pill badge badge-silenced"' in text and 'data-severity="page"' in text, url
    detail = client.get(f"/slos/{slo.pk}/").content.decode()
    assert f'<tr data-alert="{muted.pk}" class="alert-muted">' in detail and "state-muted" in detail


def test_the_on_call_panel_counts_muted_alerts_apart(rf, make_user):
    from alerts.panels import on_call_panel

    request = rf.get("/")
    request.user = make_user("viewer")
    silence("NodeDown")
    alert("NodeDown")
    assert "1 alert firing, all silenced or snoozed" in on_call_panel(request, None)
    alert("DiskFull")
    html = on_call_panel(request, None)
    assert ">1 alert firing</strong>" in html and "and 1 silenced or snoozed" in html

"""Two real processes run the minute's ledger sync at once: a correction to a closed month is
booked once, and the month's figures are those one sync gives.

The processes connect to the test database, so this test commits (transactional). Two syncs
started at the same instant rarely overlap where it matters (the second finds the ledger lock
taken and skips), so the test holds them where they would collide: it locks the adjustment table,
starts one sync, waits until it stands at the booking, starts the second, waits until that one
stands there too (or has finished), and only then lets both go at the same moment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connection, transaction
from django.utils import timezone

from costing import services
from costing.ledger import ledger_sync
from costing.models import Adjustment
from costing.report import month_range, previous_month, report_for
from tenants.models import Tenant
from tests.costing.conftest import make_deployment, make_replica, price, usage
from tests.services import REPO_ROOT, database_url
from tests.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

# What the beat runs each minute, in a process of its own; the result is the last line printed.
SYNC = "import json; from costing.tasks import sync_ledger; print(json.dumps(sync_ledger.run()))"
WAITING_ON_ADJUSTMENTS = """
    SELECT count(*) FROM pg_locks WHERE relation = 'costing_adjustment'::regclass AND NOT granted
"""


def start_sync(tmp_path, name: str) -> tuple[subprocess.Popen, object]:
    log = open(tmp_path / f"{name}.log", "w+")
    env = {**os.environ, "DATABASE_URL": database_url(), "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "manage.py", "shell", "-v", "0", "-c", SYNC], cwd=REPO_ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    return proc, log


def waiting_on_adjustments() -> int:
    with connection.cursor() as cursor:
        cursor.execute(WAITING_ON_ADJUSTMENTS)
        return cursor.fetchone()[0]


def output(log) -> str:
    log.seek(0)
    return log.read()


def test_two_overlapping_syncs_book_a_late_correction_once(tmp_path):
    now = timezone.now()
    closed_month = previous_month(now)
    start, end = month_range(closed_month)
    this_month, next_start = month_range(now.date())
    Tenant.objects.create(name="acme")
    deployment = make_deployment("chat", resources={"cpu": "1"})
    price("cpu", "0.60", start - timedelta(days=1))
    # The last two hours of last month: acme uses the first, the second is idle when the month closes.
    make_replica(deployment, started_at=end - timedelta(hours=2), state="stopped", stopped_at=end)
    usage("chat", "acme", end - timedelta(hours=2) + timedelta(minutes=5), prompt=10, completion=10)
    ledger_sync(now)
    closed = services.month_close(month=closed_month, now=now)
    assert (closed.report["total_usd"], closed.report["idle_usd"]) == ("1.2000", "0.6000")

    # A request of the idle hour arrives late: its hour's $0.60 moves from idle to beta.
    usage("chat", "beta", end - timedelta(minutes=50), prompt=5, completion=5)

    procs = []
    try:
        with transaction.atomic():
            # The gate: nobody reads or writes adjustments until this transaction ends.
            connection.cursor().execute("LOCK TABLE costing_adjustment IN ACCESS EXCLUSIVE MODE")
            first, first_log = start_sync(tmp_path, "first")
            procs.append((first, first_log))
            wait_until(lambda: waiting_on_adjustments() == 1, lambda: f"the first sync to reach the booking\n"
                       f"{output(first_log)}", timeout=60, interval=0.05)
            second, second_log = start_sync(tmp_path, "second")
            procs.append((second, second_log))
            # The second sync either stands at the booking beside the first, or has finished
            # without booking (it found the ledger busy): either way it has done what it will.
            wait_until(lambda: waiting_on_adjustments() == 2 or second.poll() is not None,
                       lambda: f"the second sync to reach the booking or finish\n{output(second_log)}",
                       timeout=60, interval=0.05)
        results = []
        for proc, log in procs:
            assert proc.wait(60) == 0, output(log)
            results.append(json.loads(output(log).strip().splitlines()[-1]))
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            log.close()

    assert sum(result.get("adjustments", 0) for result in results) == 2, results
    booked = sorted((a.source_month, a.booked_month, a.tenant, a.usd, a.prompt_tokens, a.completion_tokens)
                    for a in Adjustment.objects.all())
    assert booked == [
        (closed_month, this_month.date(), "", Decimal("-0.6"), 0, 0),
        (closed_month, this_month.date(), "beta", Decimal("0.6"), 5, 5),
    ]
    # The figures are settled: one more sync books nothing, and this month shows one correction.
    later = timezone.now()
    assert services.adjustments_book(since=start, now=later) == 0
    report = report_for(this_month, next_start, now=later)
    assert sorted((a["tenant"] or "", a["usd"]) for a in report["adjustments"]) == [("", "-0.6000"),
                                                                                   ("beta", "0.6000")]
    assert report_for(start, end, now=later) == closed.report  # the closed month itself never changes

"""`make run` seeds a price for the demo replica's cores, so a new user's cost page has numbers."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from costing.ledger import ledger_sync
from costing.models import CostHour, Price
from project.bootstrap import ensure_demo_prices
from tests.costing.conftest import make_deployment, make_replica

pytestmark = pytest.mark.django_db


def test_the_demo_price_costs_the_demo_replica_within_minutes():
    assert ensure_demo_prices() is True
    assert ensure_demo_prices() is False  # once
    [price] = Price.objects.all()
    assert (price.resource, price.usd_per_hour) == ("cpu", Decimal("0.048000"))
    now = timezone.now()
    demo = make_deployment("demo", engine_args={"max_num_seqs": 32})  # as bootstrap deploys it
    make_replica(demo, started_at=now - timedelta(minutes=5))
    ledger_sync(now)
    cost = sum(row.usd for row in CostHour.objects.all())
    assert sum(row.minutes for row in CostHour.objects.all()) >= 5
    # 4 cores (the host's, as tests set INFEROPS_COST_LOCAL_CPUS) at $0.048 an hour, for each
    # minute since the price's start (this hour's first minute).
    priced = min(5, int((now.replace(second=0, microsecond=0) - price.effective_from) / timedelta(minutes=1)))
    assert cost == Decimal(4) * Decimal("0.048") * priced / 60

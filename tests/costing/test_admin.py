"""The costing admin pages are read-only: every write to prices, list prices and budgets goes through the
services the API and the console call, which validate it and record it in the audit log."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User

from costing.models import Price

pytestmark = pytest.mark.django_db


def test_costing_rows_cannot_be_added_changed_or_deleted_in_the_admin(client):
    """Issue 40 (the permissions table's audit check): plain ModelAdmins wrote prices and budgets unaudited."""
    client.force_login(User.objects.create_superuser("root", password="pw-12345678"))
    for model in ("price", "listprice", "budget", "replicalife", "costhour", "closedmonth", "adjustment"):
        assert client.get(f"/admin/costing/{model}/").status_code == 200, model
        assert client.get(f"/admin/costing/{model}/add/").status_code == 403, model
    response = client.post("/admin/costing/price/add/", {"resource": "cpu", "tier": "on_demand",
                                                         "usd_per_hour": "1", "effective_from_0": "2030-01-01",
                                                         "effective_from_1": "00:00:00"})
    assert response.status_code == 403 and not Price.objects.exists()

"""What a CI job does, with the `requests` library over real HTTP against a live server."""

from __future__ import annotations

import io

import pytest
import requests
from django.contrib.auth.models import Group, User
from django.core.management import call_command

from inferops.models import AuditEvent
from registry.models import Alias, ModelVersion, RegisteredModel


@pytest.fixture
def ci_session(live_server, transactional_db):
    user = User.objects.create_user("ci-bot", password="unused-password")
    user.groups.add(Group.objects.get(name="operator"))
    out = io.StringIO()
    call_command("drf_create_token", "ci-bot", stdout=out)
    token = out.getvalue().split()[2]
    session = requests.Session()
    session.headers["Authorization"] = f"Token {token}"
    session.base = f"{live_server.url}/api/v1"
    return session


def test_ci_registers_a_version_and_moves_an_alias(ci_session, tiny_llama_dir):
    base = ci_session.base
    assert requests.get(f"{base}/models/", timeout=10).status_code == 401

    response = ci_session.post(f"{base}/models/", json={"name": "llama-ci", "task": "generate"}, timeout=10)
    assert response.status_code == 201
    for _ in range(2):
        response = ci_session.post(f"{base}/models/llama-ci/versions/",
                                   json={"artifact_uri": f"file://{tiny_llama_dir}"}, timeout=30)
        assert response.status_code == 201, response.text
    digest = response.json()["digest"]
    assert response.json()["number"] == 2

    first = ci_session.put(f"{base}/models/llama-ci/aliases/champion/", json={"version": 1}, timeout=10)
    moved = ci_session.put(f"{base}/models/llama-ci/aliases/champion/", json={"version": 2}, timeout=10)
    assert first.json()["previous_version"] is None
    assert moved.json()["previous_version"] == 1
    alias = ci_session.get(f"{base}/models/llama-ci/aliases/champion/", timeout=10).json()
    assert (alias["number"], alias["digest"]) == (2, digest)

    before = (RegisteredModel.objects.count(), ModelVersion.objects.count(), Alias.objects.count(),
              AuditEvent.objects.count())
    refused = [
        ci_session.post(f"{base}/models/", json={"name": "llama-ci", "task": "generate"}, timeout=10),
        ci_session.post(f"{base}/models/llama-ci/versions/", json={"artifact_uri": "/nowhere"}, timeout=10),
        ci_session.post(f"{base}/models/llama-ci/versions/",
                        json={"artifact_uri": str(tiny_llama_dir), "sha256": "f" * 64}, timeout=30),
        ci_session.post(f"{base}/models/llama-ci/versions/", data="{broken",
                        headers={"Content-Type": "application/json"}, timeout=10),
        ci_session.put(f"{base}/models/llama-ci/aliases/champion/", json={"version": 99}, timeout=10),
        ci_session.get(f"{base}/models/unknown/", timeout=10),
    ]
    assert [r.status_code for r in refused] == [409, 400, 400, 400, 404, 404]
    assert all(r.headers["Content-Type"].startswith("application/json") for r in refused)
    after = (RegisteredModel.objects.count(), ModelVersion.objects.count(), Alias.objects.count(),
             AuditEvent.objects.count())
    assert after == before

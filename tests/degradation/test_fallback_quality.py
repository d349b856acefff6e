"""A fallback's quality: the degradation document shows each fallback deployment's eval scores
beside the deployment's own (the latest succeeded run of the version each serves now), and the API
and the policy form warn, without refusing, when a fallback scores lower on a common eval set."""

from __future__ import annotations

import copy
import json
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from degradation.models import DegradationPolicy
from evals.choices import RunStatus
from tests.costing.eval_rows import finished_run, set_version
from tests.degradation.conftest import LEVELS
from tests.deployments.conftest import make_version
from tests.slo.conftest import make_deployment

pytestmark = pytest.mark.django_db
URL = "/api/v1/deployments/chat/degradation/"


def with_fallback(to: str = "small", levels=(0,)) -> list[dict]:
    changed = copy.deepcopy(LEVELS)
    for index in levels:
        changed[index]["actions"]["fallback"] = {"deployment": to, "weight": 50}
    return changed


@pytest.fixture
def scored(deployment):
    """chat (model tiny) and small (model tiny-small) scored: qa chat 90 % small 60 %; maths chat 70 % small
    80 %; style only chat; a failed run of small on qa scoring nothing."""
    small = make_deployment("small", model_name="tiny-small")
    qa, maths, style = set_version("qa"), set_version("maths", cases=10), set_version("style")
    now = timezone.now()
    runs = {
        "chat-qa": finished_run(deployment.version, qa, 0.9, deployment=deployment),
        "chat-maths": finished_run(deployment.version, maths, 0.7, deployment=deployment),
        "chat-style": finished_run(deployment.version, style, 0.5, deployment=deployment),
        "small-qa": finished_run(small.version, qa, 0.6, deployment=small, finished_at=now - timedelta(hours=1)),
        "small-maths": finished_run(small.version, maths, 0.8, deployment=small),
        "small-qa-failed": finished_run(small.version, qa, 0.0, deployment=small, status=RunStatus.FAILED),
    }
    return {"small": small, "runs": runs}


WARNING = ("Level 1 (shed-batch) falls back to small, which scores 60.0 % on eval set qa (v1), lower than chat's "
           "90.0 % (v1): requests sent there get worse answers.")


def test_the_document_shows_the_fallbacks_scores_and_warns_when_lower(api, scored):
    response = api("operator").put(URL, {"levels": with_fallback()}, format="json")
    assert response.status_code == 200, response.json()  # a warning, not a refusal
    body = response.json()
    runs = scored["runs"]
    assert body["fallbacks"] == [{
        "deployment": "small", "version": 1, "levels": [{"number": 1, "name": "shed-batch"}],
        "scores": [
            {"eval_set": "maths", "fallback": {"score": 0.8, "set_version": 1, "run": runs["small-maths"].pk},
             "own": {"score": 0.7, "set_version": 1, "run": runs["chat-maths"].pk}},
            {"eval_set": "qa", "fallback": {"score": 0.6, "set_version": 1, "run": runs["small-qa"].pk},
             "own": {"score": 0.9, "set_version": 1, "run": runs["chat-qa"].pk}},
            {"eval_set": "style", "fallback": None,
             "own": {"score": 0.5, "set_version": 1, "run": runs["chat-style"].pk}},
        ],
    }]
    assert body["warnings"] == [WARNING]
    assert DegradationPolicy.objects.get(deployment__name="chat").levels[0]["actions"]["fallback"]["deployment"] == \
        "small"
    assert api("viewer").get(URL).json()["warnings"] == [WARNING]


def test_one_warning_names_every_level_that_falls_back_there(api, scored):
    body = api("operator").put(URL, {"levels": with_fallback(levels=(0, 1))}, format="json").json()
    assert body["fallbacks"][0]["levels"] == [{"number": 1, "name": "shed-batch"},
                                              {"number": 2, "name": "short-answers"}]
    assert body["warnings"] == [WARNING.replace("Level 1 (shed-batch) falls back",
                                                "Levels 1 (shed-batch) and 2 (short-answers) fall back")]


def test_no_warning_when_the_fallback_scores_as_well_or_has_no_common_set(api, scored):
    small = scored["small"]
    qa = scored["runs"]["chat-qa"].set_version
    finished_run(small.version, qa, 0.9, deployment=small)  # its latest run on qa: as good as chat
    body = api("operator").put(URL, {"levels": with_fallback()}, format="json").json()
    assert body["warnings"] == []
    assert body["fallbacks"][0]["scores"][1]["fallback"]["score"] == 0.9
    # A new version on small, not scored yet: its scores are gone, and so is every comparison.
    small.version = make_version(small.model, 2)
    small.save(update_fields=["version"])
    body = api("viewer").get(URL).json()
    assert body["fallbacks"][0]["version"] == 2 and body["warnings"] == []
    assert all(row["fallback"] is None for row in body["fallbacks"][0]["scores"])


def test_without_a_fallback_or_scores_the_document_says_so(api, make_user, deployment):
    body = api("operator").put(URL, {"levels": LEVELS}, format="json").json()
    assert (body["fallbacks"], body["warnings"]) == ([], [])
    make_deployment("small", model_name="tiny-small")
    body = api("operator").put(URL, {"levels": with_fallback()}, format="json").json()
    assert body["fallbacks"] == [{"deployment": "small", "version": 1,
                                  "levels": [{"number": 1, "name": "shed-batch"}], "scores": []}]
    assert body["warnings"] == []
    browser = Client()
    browser.force_login(make_user("viewer"))
    assert "no eval scores for either" in browser.get("/deployments/chat/").content.decode()


def test_the_policy_form_warns_and_the_panel_shows_the_scores(make_user, scored):
    browser = Client()
    browser.force_login(make_user("operator"))
    form = {"policy-enabled": "on", "policy-window": "5m", "policy-hold_s": "60",
            "policy-levels": json.dumps(with_fallback())}
    response = browser.post("/deployments/chat/degradation/policy/", form, follow=True)
    assert response.status_code == 200
    html = response.content.decode()
    assert f'<li class="warning" role="alert">{WARNING.replace(chr(39), "&#x27;")}</li>' in html
    assert "Degradation policy of chat saved" in html
    assert DegradationPolicy.objects.filter(deployment__name="chat").exists()
    # The panel: each fallback score beside chat's, the lower one marked, linked to its run.
    assert 'data-fallback="small" data-set="qa"' in html
    assert f'<a href="/evals/runs/{scored["runs"]["small-qa"].pk}/">60.0 %</a>' in html
    assert html.count("data-lower") == 1
    assert html.count("data-warning") == 1
    # A policy whose fallback scores as well saves without a warning.
    qa = scored["runs"]["chat-qa"].set_version
    finished_run(scored["small"].version, qa, 0.95, deployment=scored["small"])
    html = browser.post("/deployments/chat/degradation/policy/", form, follow=True).content.decode()
    assert 'class="warning"' not in html and "data-lower" not in html and "data-warning" not in html

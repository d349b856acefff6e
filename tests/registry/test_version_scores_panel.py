"""A version's page shows its score on each eval set next to its parent's (the model's previous
version), on the same set version, the difference coloured, with links to the runs and to the
comparison page; the model page shows its newest version's. Real EvalRun rows, made here."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from evals.choices import RunStatus, TargetKind
from evals.models import EvalRun, EvalSet
from registry.models import RegisteredModel
from tests.conftest import text_of
from tests.deployments.conftest import make_version
from tests.evals.runs_world import eval_set_with

pytestmark = pytest.mark.django_db

CASES = [{"id": f"c{i}", "prompt": f"{i}+1=", "expected": str(i + 1)} for i in range(10)]


def scored(version, set_version, score, *, status=RunStatus.SUCCEEDED, age_min=0, done=10) -> EvalRun:
    finished = timezone.now() - timedelta(minutes=age_min)
    return EvalRun.objects.create(
        eval_set=set_version.eval_set, set_version=set_version, target_kind=TargetKind.VERSION,
        model_version=version, priority=-1000, status=status, done=done, total=set_version.case_count,
        score=score if status == RunStatus.SUCCEEDED else None, started_at=finished - timedelta(minutes=1),
        finished_at=finished if status != RunStatus.RUNNING else None)


@pytest.fixture
def world():
    """`tiny` v1..v3; sets qa (v1, v2 of its cases), style and fresh (a default of tiny, never run)."""
    model = RegisteredModel.objects.create(name="tiny", task="generate")
    versions = [make_version(model, n) for n in (1, 2, 3)]
    qa1, qa2 = eval_set_with(CASES, name="qa"), eval_set_with(CASES + [{"id": "x", "prompt": "x", "expected": "y"}],
                                                              name="qa")
    style = eval_set_with(CASES[:4], name="style")
    fresh = eval_set_with(CASES[:2], name="fresh")
    fresh.eval_set.default_for.add(model)
    return model, versions, {"qa1": qa1, "qa2": qa2, "style": style, "fresh": fresh}


def row(page: str, set_name: str) -> str:
    """The panel row of one eval set, as text."""
    start = page.index(f'<td><a href="/evals/sets/{set_name}/">{set_name}</a>')
    return page[start:page.index("</tr>", start)]


def test_a_version_page_shows_its_scores_next_to_its_parents(client, make_user, world):
    model, (v1, v2, v3), sets = world
    scored(v1, sets["qa1"], 0.6, age_min=90)
    parent_run = scored(v1, sets["qa2"], 0.7, age_min=60)
    scored(v2, sets["qa2"], 0.5, age_min=30)  # an older run of v2: the latest succeeded counts
    run = scored(v2, sets["qa2"], 0.9, age_min=5)
    scored(v2, sets["qa2"], None, status=RunStatus.FAILED, age_min=1)  # a later failure changes nothing
    scored(v1, sets["style"], 0.75)
    scored(v2, sets["style"], 0.5)
    client.force_login(make_user("viewer"))

    page = text_of(client.get("/models/tiny/versions/2/"))
    assert "Eval scores of v2 against v1" in page
    qa = row(page, "qa")
    assert 'v2 <span class="muted">(11 cases)' in qa  # the newest set version that scored both
    assert f'<a href="/evals/runs/{run.pk}/" title="eval run {run.pk}">0.900</a>' in qa
    assert f'<a href="/evals/runs/{parent_run.pk}/" title="eval run {parent_run.pk}">0.700</a>' in qa
    assert '<span class="score-up">+0.200</span>' in qa
    assert '<span class="score-down">-0.250</span>' in row(page, "style")
    fresh = row(page, "fresh")  # a default set of the model that has not scored either version
    assert fresh.count("not scored") == 2 and "—" in fresh
    assert '<a href="/models/tiny/compare/?a=1&amp;b=2" id="compare-versions">Compare v1 and v2</a>' in \
        client.get("/models/tiny/versions/2/").content.decode()


def test_scores_compare_on_one_set_version_and_a_run_in_progress_shows(client, make_user, world):
    model, (v1, v2, v3), sets = world
    scored(v2, sets["qa1"], 0.8)
    scored(v3, sets["qa2"], 0.9)  # v3 only on qa v2, its parent only on qa v1: not comparable
    scoring = scored(v3, sets["fresh"], None, status=RunStatus.RUNNING, done=1)
    client.force_login(make_user("viewer"))

    page = text_of(client.get("/models/tiny/versions/3/"))
    qa = row(page, "qa")
    assert 'v2 <span class="muted">(11 cases)' in qa and "0.900" in qa and "not scored" in qa and "score-" not in qa
    assert f'<a href="/evals/runs/{scoring.pk}/" class="muted">scoring… 1/2</a>' in row(page, "fresh")

    # The model page shows its newest version's panel.
    model_page = text_of(client.get("/models/tiny/"))
    assert "Eval scores of v3 against v2" in model_page and "scoring… 1/2" in model_page
    assert '<a href="/models/tiny/versions/3/">v3</a>' in model_page


def test_the_first_version_has_no_parent_and_an_unscored_model_says_how(client, make_user, world):
    model, (v1, v2, v3), sets = world
    scored(v1, sets["style"], 0.25)
    client.force_login(make_user("viewer"))
    page = text_of(client.get("/models/tiny/versions/1/"))
    assert "Eval scores of v1</h2>" in page and "Difference" not in page and "compare-versions" not in page
    assert "0.250" in row(page, "style")

    lonely = RegisteredModel.objects.create(name="lonely", task="generate")
    make_version(lonely, 1)
    page = text_of(client.get("/models/lonely/versions/1/"))
    assert "Not scored on any eval set." in page
    assert "inferops eval run --set NAME --model lonely --version 1" in page
    assert EvalSet.objects.count() == 3


def test_an_unknown_version_is_a_404(client, make_user, world):
    client.force_login(make_user("viewer"))
    assert client.get("/models/tiny/versions/9/").status_code == 404
    assert client.get("/models/nope/versions/1/").status_code == 404

"""The rollout quality step in deployments: its spec, its verdict (candidate, stable, drop, limits), and the
state machine's quality step, pass by pass on the `world` of the rollout tests.

The machine tests register a test double of the evals app's implementation (the interface is
deployments/rollouts/quality.RolloutQuality): its runs are numbers and each test says what it judges.
The real implementation, with real eval run rows, is tests/deployments/test_rollout_quality_evals.py; with
real replicas and a real worker, tests/e2e/test_rollout_quality_e2e.py.
"""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from alerts.models import Alert
from deployments.choices import Verdict
from deployments.models import Deployment, Rollout, RolloutMeasurement
from deployments.rollouts import quality as rollout_quality
from deployments.rollouts import services as rollouts
from deployments.rollouts.quality import QualityVerdict, judge
from deployments.rollouts.spec import DEFAULT_QUALITY_TIMEOUT_S, normalise
from project.rollout_cli import _describe_step, failing_cases
from tests.deployments.conftest import start
from tests.deployments.test_rollout_watch import FROZEN, set_degradation

pytestmark = pytest.mark.django_db(transaction=True)

LINK = "https://inferops.example/evals/runs/101/?passed=false"
QUALITY = {"eval_set": "facts", "max_drop": 0.05, "min_score": 0.8}


# ---------------------------------------------------------------------------------------------
# The spec


def test_a_quality_step_is_normalised_with_every_key():
    steps, _ = normalise("canary", steps=[{"set_weight": 20}, {"quality": QUALITY},
                                          {"quality": {"eval_set": "facts", "min_score": 1, "set_version": 2,
                                                       "timeout": "2m"}}])
    assert steps[1] == {"quality": {"eval_set": "facts", "set_version": None, "max_drop": 0.05, "min_score": 0.8,
                                    "timeout": DEFAULT_QUALITY_TIMEOUT_S}}
    assert steps[2]["quality"] == {"eval_set": "facts", "set_version": 2, "max_drop": None, "min_score": 1.0,
                                   "timeout": 120.0}
    assert normalise("canary", steps=steps)[0] == steps  # normalised steps read back as they are (retry, undo)


def test_blue_green_scores_quality_before_its_preview_and_the_switch():
    steps, _ = normalise("blue-green", preview={}, quality={"eval_set": "facts", "max_drop": 0.1}, analysis="1m")
    assert [next(iter(step)) for step in steps] == ["quality", "pause", "set_weight", "analysis"]
    with pytest.raises(ValidationError) as caught:
        normalise("canary", quality=QUALITY)
    assert caught.value.message_dict == {"quality": ["quality applies to blue-green; a canary lists its steps."]}


def test_every_bad_field_of_a_quality_step_is_named_once():
    with pytest.raises(ValidationError) as caught:
        normalise("canary", steps=[{"set_weight": 10},
                                   {"quality": {"eval_set": "", "max_drop": 1.5, "min_score": True,
                                                "set_version": 0, "timeout": "soon", "floor": 1}}])
    assert caught.value.message_dict["steps"] == [
        "steps[1].quality: unknown key(s) floor; accepted: eval_set, max_drop, min_score, set_version, timeout",
        "steps[1].quality.eval_set: required, the name of an eval set",
        "steps[1].quality.set_version: expected a version number (1 or more)",
        "steps[1].quality.max_drop: expected a number from 0 to 1",
        "steps[1].quality.min_score: expected a number from 0 to 1",
        caught.value.message_dict["steps"][5],
    ]
    assert caught.value.message_dict["steps"][5].startswith("steps[1].quality.timeout:")
    for value, says in [({"eval_set": "facts"}, "give max_drop"), ("facts", "expected an object"),
                        ({"eval_set": "facts", "max_drop": 0.1, "timeout": 0}, "longer than 0s")]:
        with pytest.raises(ValidationError) as caught:
            normalise("canary", steps=[{"quality": value}])
        assert says in caught.value.message_dict["steps"][0], value
    with pytest.raises(ValidationError) as caught:
        normalise("blue-green", quality={"eval_set": "facts", "max_drop": -0.1})
    assert caught.value.message_dict == {"quality": ["quality.max_drop: expected a number from 0 to 1"]}


# ---------------------------------------------------------------------------------------------
# The verdict


@pytest.mark.parametrize(("config", "candidate", "stable", "verdict", "oks", "says"), [
    # A drop equal to the limit passes, although 1.0 - 0.95 is 0.05000000000000004 in floats.
    ({"max_drop": 0.05}, 0.95, 1.0, Verdict.PASS, [True],
     "candidate 0.95, stable 1.00 (drop 0.05), within max drop 0.05"),
    ({"max_drop": 0.05}, 0.9, 1.0, Verdict.FAIL, [False], "(drop 0.10): a drop of 0.10 over the limit 0.05"),
    ({"max_drop": 0.05}, 0.6, 0.5, Verdict.PASS, [True], "drop -0.10"),  # better than stable
    ({"min_score": 0.8}, 0.75, 0.7, Verdict.FAIL, [False], "under the floor 0.80"),  # no drop, under the floor
    ({"min_score": 0.8, "max_drop": 0.05}, 0.4, 1.0, Verdict.FAIL, [False, False],
     "candidate 0.40, stable 1.00 (drop 0.60): under the floor 0.80 and a drop of 0.60 over the limit 0.05"),
    ({"min_score": 0.8, "max_drop": 0.05}, 0.85, 1.0, Verdict.FAIL, [True, False], "a drop of 0.15 over the limit"),
    ({"min_score": 0.8, "max_drop": 0.05}, 0.8, 0.82, Verdict.PASS, [True, True], "within max drop 0.05, min 0.80"),
])
def test_the_verdict_by_candidate_stable_drop_and_limits(config, candidate, stable, verdict, oks, says):
    got, checks, reason = judge({"eval_set": "facts", **config}, candidate, stable)
    assert got == verdict and says in reason and reason.startswith("quality facts: ")
    assert [check["ok"] for check in checks] == oks


def test_without_the_stable_score_only_the_floor_is_judged():
    verdict, checks, reason = judge({"eval_set": "facts", "max_drop": 0.05, "min_score": 0.8}, 0.5, None)
    assert verdict == Verdict.FAIL and reason == "quality facts: candidate 0.50: under the floor 0.80"
    assert [check["ok"] for check in checks] == [False, None]
    assert judge({"eval_set": "facts", "max_drop": 0.05}, 0.5, None)[1][0]["ok"] is None


# ---------------------------------------------------------------------------------------------
# The state machine, with a test double of the evals implementation


class FakeQuality:
    """A test double of evals/rollout_quality.EvalsRolloutQuality: the eval set `facts` exists, each start
    gets the next run number, and each look answers `result`."""

    def __init__(self):
        self.started: list[tuple[int, int]] = []
        self.stopped: list[int] = []
        self.looks = 0
        self.result = QualityVerdict(Verdict.RUNNING, "facts v1: candidate run 101 running, 3/10 cases",
                                     candidate={"run": 101, "done": 3, "total": 10, "score": None},
                                     stable={"run": None, "score": 1.0, "basis": "parity"})

    def validate(self, config):
        return [] if config["eval_set"] == "facts" else [f"eval_set: no eval set named {config['eval_set']!r}"]

    def start(self, rollout, config):
        self.started.append((rollout.attempt, rollout.step_index))
        return {"set_version": 1, "runs": {"candidate": 100 + len(self.started)}}

    def verdict(self, rollout, config, state):
        self.looks += 1
        return self.result

    def stop(self, state):
        self.stopped.append(state["runs"]["candidate"])

    def judged(self, candidate: float, stable: float, config=QUALITY) -> None:
        verdict, checks, reason = judge(config, candidate, stable)
        self.result = QualityVerdict(verdict, reason, link=LINK, checks=checks,
                                     candidate={"run": 101, "done": 10, "total": 10, "score": candidate},
                                     stable={"run": None, "score": stable, "basis": "parity"})


@pytest.fixture
def fake(monkeypatch):
    double = FakeQuality()
    monkeypatch.setattr(rollout_quality, "_registered", double)
    return double


def at_quality_step(world, quality=QUALITY) -> Rollout:
    """A canary of v2 at 50% whose second step is the quality step, started."""
    start(world, version=2, steps=[{"set_weight": 50}, {"quality": quality}, {"set_weight": 100}])
    world.tick()  # the candidate starts, at weight 0
    world.tick()  # ready: 50 %, then the quality step starts its runs
    return world.rollout()


def test_a_passing_quality_step_starts_its_runs_once_then_moves_on(world, fake):
    rollout = at_quality_step(world)
    assert (rollout.step_index, rollout.weight, rollout.status) == (1, 50, "progressing")
    for _ in range(3):
        world.tick(5)
    rollout = world.rollout()
    assert fake.started == [(1, 1)] and fake.looks == 4  # one start, a look on every pass
    assert rollout.message == "Scoring quality: facts v1: candidate run 101 running, 3/10 cases"
    assert rollout.quality["1.1"]["state"] == {"set_version": 1, "runs": {"candidate": 101}}
    assert rollout.quality["1.1"]["verdict"] == "running"
    assert not RolloutMeasurement.objects.filter(rollout=rollout).exists()

    fake.judged(0.97, 1.0)
    world.tick()  # pass, then all traffic at full size
    world.tick()
    rollout = world.rollout()
    assert rollout.status == "succeeded", rollout.message
    events = [(e["event"], e["detail"]) for e in rollout.timeline]
    assert ("quality started", "facts (max drop 0.05, min 0.80): candidate run 101") in events
    assert ("quality passed", "quality facts: candidate 0.97, stable 1.00 (drop 0.03), within max drop 0.05, "
                              "min 0.80") in events
    measurement = RolloutMeasurement.objects.get(rollout=rollout, step_index=1)
    assert measurement.verdict == "pass" and measurement.candidate["score"] == 0.97
    assert [c["ok"] for c in measurement.checks] == [True, True]
    assert fake.stopped == []


def test_a_failing_quality_step_aborts_with_the_figures_and_the_failing_cases(world, fake):
    at_quality_step(world)
    fake.judged(0.4, 1.0)
    world.tick()
    rollout = world.rollout()
    assert rollout.status == "aborted" and rollout.weight == 0 and world.weights() == {"stable": 100}
    assert rollout.message == ("quality failed: quality facts: candidate 0.40, stable 1.00 (drop 0.60): under the "
                               f"floor 0.80 and a drop of 0.60 over the limit 0.05; failing cases: {LINK}")
    assert [e["event"] for e in rollout.timeline][-3:] == ["quality failed", "aborted", "traffic on stable"]
    alert = Alert.objects.get(labels__alertname="RolloutAborted")
    assert alert.annotations["failing_cases_url"] == LINK and LINK in alert.annotations["description"]
    assert RolloutMeasurement.objects.get(rollout=rollout).verdict == "fail"
    assert fake.stopped == [101]  # whatever the step's runs still did, they stop with it

    # What CI reads: the step in words, and the link on its own line.
    from deployments.rollouts.api import RolloutDetailSerializer
    body = RolloutDetailSerializer(rollout).data
    assert _describe_step(body["steps"][1]) == "quality facts: max drop 0.05, min 0.80"
    assert failing_cases(body) == [LINK]
    assert body["quality"][0]["candidate"]["score"] == 0.4 and body["quality"][0]["runs"] == {"candidate": 101}

    rollouts.rollout_retry(rollout=rollout, actor=world.user)  # a retry scores again: a new attempt, new runs
    world.tick()
    world.tick()
    assert fake.started == [(1, 1), (2, 1)] and set(world.rollout().quality) == {"1.1", "2.1"}


def test_a_quality_step_with_no_verdict_by_its_timeout_aborts(world, fake):
    at_quality_step(world, {**QUALITY, "timeout": "60s"})
    world.tick(30)
    assert world.rollout().status == "progressing"
    world.tick(31)
    rollout = world.rollout()
    assert rollout.status == "aborted"
    assert rollout.message == ("quality step timed out: quality facts: no verdict within 60s (facts v1: candidate "
                               "run 101 running, 3/10 cases)")
    assert rollout.quality["1.1"]["verdict"] == "fail" and fake.stopped == [101]


def test_an_inconclusive_quality_step_waits_for_an_operator(world, fake):
    at_quality_step(world)
    fake.result = QualityVerdict(Verdict.INCONCLUSIVE, "the candidate's eval run 101 failed: replica gone.")
    world.tick()
    rollout = world.rollout()
    assert rollout.status == "paused" and rollout.message.startswith(
        "Quality inconclusive: the candidate's eval run 101 failed: replica gone. Promote to continue")
    looks = fake.looks
    world.tick(60)
    assert fake.looks == looks  # paused: no more looks
    rollouts.rollout_promote(rollout=rollout, actor=world.user, reason="the set is fine, the replica was not")
    world.tick()
    assert world.rollout().step_index == 2


def test_a_frozen_rollout_holds_its_quality_step(world, fake):
    at_quality_step(world, {**QUALITY, "timeout": "60s"})
    set_degradation(world, FROZEN)
    looks = fake.looks
    world.tick(90)  # past the timeout: frozen, it holds, and nothing is judged
    rollout = world.rollout()
    assert (rollout.status, rollout.step_index, rollout.weight) == ("progressing", 1, 50)
    assert rollout.message.startswith("Frozen by degradation level 1") and fake.looks == looks
    set_degradation(world, None)
    world.tick()  # unfrozen: the step's clock starts over, with the runs it started
    rollout = world.rollout()
    assert rollout.status == "progressing" and rollout.step_started_at == world.now
    assert fake.started == [(1, 1)] and fake.looks == looks + 1


def test_a_quality_step_starts_no_run_before_a_candidate_replica_is_ready(world, fake):
    world.driver.crashing.add(Deployment.objects.get(pk=world.deployment.pk).model.versions.get(number=2).pk)
    start(world, version=2, steps=[{"quality": QUALITY}, {"set_weight": 100}])
    world.tick()
    rollout = world.rollout()
    assert rollout.message == "Warming the candidate: 0/1 replicas ready before its quality step."
    assert fake.started == []


def test_the_eval_set_is_checked_when_the_rollout_is_created(world, fake):
    with pytest.raises(ValidationError) as caught:
        start(world, version=2, steps=[{"set_weight": 50}, {"quality": {"eval_set": "nope", "max_drop": 0.1}}])
    assert caught.value.message_dict == {"steps": ["steps[1].quality.eval_set: no eval set named 'nope'"]}
    with pytest.raises(ValidationError) as caught:
        start(world, version=2, strategy="blue-green", quality={"eval_set": "nope", "min_score": 0.5})
    assert caught.value.message_dict == {"quality": ["quality.eval_set: no eval set named 'nope'"]}
    assert not Rollout.objects.exists()


def test_the_api_refuses_a_bad_quality_step_with_a_400_naming_the_field(world, fake, api):
    client = api("operator")
    response = client.post("/api/v1/deployments/chat/rollouts/", {
        "version": 2, "strategy": "blue-green", "quality": {"eval_set": "facts", "max_drop": 2}}, format="json")
    assert response.status_code == 400
    assert response.json() == {"quality": ["quality.max_drop: expected a number from 0 to 1"]}
    response = client.post("/api/v1/deployments/chat/rollouts/", {
        "version": 2, "steps": [{"quality": {"eval_set": "ghost", "max_drop": 0.1}}]}, format="json")
    assert response.status_code == 400
    assert response.json() == {"steps": ["steps[0].quality.eval_set: no eval set named 'ghost'"]}
    assert not Rollout.objects.exists()
    response = client.post("/api/v1/deployments/chat/rollouts/", {
        "version": 2, "strategy": "blue-green", "quality": {"eval_set": "facts", "max_drop": 0.1}}, format="json")
    assert response.status_code == 201, response.content
    assert response.json()["steps"][0]["quality"]["max_drop"] == 0.1 and response.json()["quality"] == []


def test_the_console_shows_the_step_its_runs_and_scores(world, fake, client):
    at_quality_step(world)
    fake.judged(0.4, 1.0)
    world.tick()
    client.force_login(world.user)
    html = client.get(f"/deployments/chat/rollouts/{world.rollout().pk}/").content.decode()
    assert "quality facts: max drop 0.05, min 0.80 (timeout 15m)" in html
    assert '<table id="quality">' in html and 'href="/evals/runs/101/">run 101</a>: 0.40' in html
    assert 'href="/evals/runs/101/?passed=false">failing cases</a>' in html
    assert "1.00 <span class=\"muted\">(parity)</span>" in html

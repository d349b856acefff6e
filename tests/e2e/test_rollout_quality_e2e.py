"""Issue 38 end to end: a rollout's quality step refuses a worse model.

Real parts: `inferops serve` replicas of the demo checkpoint and of two copies of it registered as new
versions (a byte copy, and one whose weights have Gaussian noise added with torch), a real Celery worker
with beat that runs the reconcile passes (which advance the rollout and start its eval runs) and the eval
runs themselves (which score the candidate's replicas against the stable replicas' greedy answers), on a
private Redis and the test database. The test process only creates the rollouts and reads the rows.
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch
from rest_framework.authtoken.models import Token
from safetensors.torch import load_file, save_file

from alerts.models import Alert
from deployments import services as deployment_services
from deployments.models import Deployment, Replica, Rollout
from deployments.replicas.drivers.local import LocalProcessDriver
from deployments.rollouts import services as rollouts
from evals.models import EvalCaseResult, EvalRun
from project import cli, rollout_cli
from registry import services as registry_services
from tests.deployments.test_reconcile import all_ready, reconcile_until
from tests.e2e.test_rollout_e2e import wait_rollout
from tests.evals.runs_world import eval_set_with
from tests.services import start_worker

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(600)]

EXTERNAL = "https://inferops.example"
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "def add(a, b):", "Hello, my name is",
           "The quick brown fox", "Water boils at", "In the beginning", "Roses are red,", "SELECT * FROM",
           "My favourite colour is", "The train leaves at", "To be or not to be", "Dear Sir or Madam,",
           "The answer is", "Monday, Tuesday,", "A B C D", "Rain falls on", "import numpy as", "Thank you for"]
QUALITY = {"eval_set": "tiny-parity", "max_drop": 0.05, "min_score": 0.9}


def noisy_copy(source, target, seed: int = 0) -> None:
    """A copy of the checkpoint whose every weight has Gaussian noise of its own standard deviation added."""
    shutil.copytree(source, target)
    generator = torch.Generator().manual_seed(seed)
    for path in target.glob("*.safetensors"):
        tensors = load_file(path)
        noisy = {name: tensor + torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
                 * tensor.float().std().nan_to_num(0).to(tensor.dtype) if tensor.is_floating_point() else tensor
                 for name, tensor in tensors.items()}
        save_file(noisy, path, metadata={"format": "pt"})


@pytest.fixture
def platform(private_redis, worker_env, tmp_path, settings, monkeypatch, make_user, tiny_llama_dir):
    """`chat` on v1 (one ready replica); v2 a byte copy of v1's checkpoint, v3 a noisy copy; the parity eval set
    `tiny-parity`; a worker with beat."""
    settings.INFEROPS_EXTERNAL_URL = EXTERNAL
    settings.INFEROPS_RECONCILE_TIMINGS = {"routing_propagation_s": 0, "health_timeout_s": 1}
    # The worker's beat runs the reconcile passes (every second); the test's queue is not the worker's.
    monkeypatch.setattr(deployment_services, "request_reconcile", lambda deployment: None)
    monkeypatch.setattr(rollouts, "request_reconcile", lambda deployment: None)
    actor = make_user("operator")
    model = registry_services.model_create(name="tiny", task="generate", actor=actor)
    identical, noisy = tmp_path / "identical", tmp_path / "noisy"
    shutil.copytree(tiny_llama_dir, identical)
    noisy_copy(tiny_llama_dir, noisy)
    for directory in (tiny_llama_dir, identical, noisy):
        registry_services.version_register(model=model, artifact_uri=str(directory), actor=actor)
    eval_set_with([{"id": f"p{index:02d}", "prompt": prompt} for index, prompt in enumerate(PROMPTS)],
                  name="tiny-parity", scorer="parity")
    deployment = deployment_services.deployment_create(name="chat", model=model, version=1, actor=actor)
    reconcile_until(deployment, all_ready(1))
    env = {**worker_env, "REDIS_URL": private_redis.url, "INFEROPS_EXTERNAL_URL": EXTERNAL}
    worker = start_worker(env, tmp_path, "worker")
    yield {"deployment": deployment, "actor": actor, "tmp": tmp_path}
    if worker.poll() is None:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(10)
    for replica in Replica.objects.all():
        LocalProcessDriver().kill(replica)


def candidate_run(rollout) -> EvalRun:
    (look,) = rollout.quality.values()
    return EvalRun.objects.get(pk=look["state"]["runs"]["candidate"])


def test_a_noisy_candidate_fails_the_parity_step_an_identical_one_passes(platform, client, live_server, monkeypatch,
                                                                         capsys):
    deployment, actor = platform["deployment"], platform["actor"]
    steps = [{"quality": QUALITY}, {"set_weight": 100}]  # judged before it takes any traffic

    same = rollouts.rollout_create(deployment=deployment, actor=actor, version=2, steps=steps, watch=0)
    wait_rollout(same, {"succeeded", "aborted"}, 240)
    assert same.status == "succeeded", (same.message, (platform["tmp"] / "worker.log").read_text()[-3000:])
    run = candidate_run(same)
    assert (run.status, run.score, run.reference_version.number, run.model_version.number) == ("succeeded", 1.0, 1, 2)
    assert (run.trigger, run.priority, run.rollout_id, run.total) == ("rollout", -1000, same.pk, len(PROMPTS))
    assert not EvalCaseResult.objects.filter(run=run, passed=False).exists()
    passed = next(e for e in same.timeline if e["event"] == "quality passed")
    assert passed["detail"] == ("quality tiny-parity: candidate 1.00, stable 1.00 (drop 0.00), within max drop "
                                "0.05, min 0.90")
    deployment.refresh_from_db()
    assert deployment.version.number == 2

    # The worse one as CI starts it: the CLI shows the step, waits, and says why with the link.
    monkeypatch.setenv("INFEROPS_URL", live_server.url)
    monkeypatch.setenv("INFEROPS_TOKEN", Token.objects.create(user=actor).key)
    code = cli.main(["rollout", "--deployment", "chat", "--version", "3", "--steps", json.dumps(steps),
                     "--watch", "0", "--wait", "--timeout", "240", "--poll-interval", "0.5"])
    out, err = capsys.readouterr()
    worse = Rollout.objects.get(candidate_version__number=3)
    assert code == rollout_cli.EXIT_ABORTED, (out, err, worse.message)
    assert "steps: quality tiny-parity: max drop 0.05, min 0.90; set_weight 100%" in out
    run = candidate_run(worse)
    assert run.status == "succeeded" and run.reference_version.number == 2 and run.score < 0.9
    failing = list(EvalCaseResult.objects.filter(run=run, passed=False).order_by("index"))
    assert len(failing) == round((1 - run.score) * len(PROMPTS)) > 0
    assert failing[0].reason.startswith("diverged at token ")
    link = f"{EXTERNAL}/evals/runs/{run.pk}/?passed=false"
    drop = 1 - run.score
    assert worse.message == (
        f"quality failed: quality tiny-parity: candidate {run.score:.2f}, stable 1.00 (drop {drop:.2f}): under the "
        f"floor 0.90 and a drop of {drop:.2f} over the limit 0.05; failing cases: {link}")
    alert = Alert.objects.get(labels__alertname="RolloutAborted", labels__rollout=str(worse.pk))
    assert alert.annotations["failing_cases_url"] == link
    assert Deployment.objects.get(pk=deployment.pk).version.number == 2  # stable keeps serving
    assert worse.message in err and f"failing cases: {link}" in err

    # The link opens the run's failing cases in the console.
    client.force_login(actor)
    page = client.get(link.removeprefix(EXTERNAL))
    assert page.status_code == 200
    html = page.content.decode()
    assert all(case.case_id in html for case in failing)
    rollout_page = client.get(f"/deployments/chat/rollouts/{worse.pk}/").content.decode()
    assert f'href="/evals/runs/{run.pk}/?passed=false">failing cases</a>' in rollout_page
    print(f"quality e2e: identical copy scored {candidate_run(same).score:.2f} and was promoted; the noisy copy "
          f"scored {run.score:.2f} ({len(failing)} of {len(PROMPTS)} cases diverged) and was aborted "
          f"{(worse.finished_at - worse.created_at).total_seconds():.1f}s after its creation")

"""Rows the eval-run tests share: a registered tiny model, an eval set with one version of cases,
a deployment of the model (rows only; the tests that serve start its replicas themselves)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx

from deployments.choices import ReplicaState
from deployments.models import Replica
from evals.models import EvalSet, EvalSetVersion
from registry import services as registry_services
from registry.models import ModelVersion, RegisteredModel
from tests.waiting import wait_until


def register_tiny(checkpoint_dir, name: str = "tiny") -> ModelVersion:
    """Version 1 (or the next) of model `name` from a demo checkpoint directory."""
    model = RegisteredModel.objects.filter(name=name).first() or registry_services.model_create(
        name=name, task="generate", actor=None)
    return registry_services.version_register(model=model, artifact_uri=str(checkpoint_dir), actor=None)


def normalised(case: dict, scorer: str) -> dict:
    """A case as the set's upload stores it: its scorer and max_tokens always filled."""
    return {"scorer": scorer, "max_tokens": 8, **case}


def eval_set_with(cases: list[dict], name: str = "smoke", scorer: str = "exact") -> EvalSetVersion:
    """Eval set `name` (made if missing) with one more version holding these cases."""
    eval_set = EvalSet.objects.filter(name=name).first() or EvalSet.objects.create(name=name, scorer=scorer)
    items = [normalised(case, scorer) for case in cases]
    content = "".join(json.dumps(case) + "\n" for case in cases)
    number = (eval_set.versions.count() or 0) + 1
    return EvalSetVersion.objects.create(
        eval_set=eval_set, number=number, sha256=hashlib.sha256(content.encode()).hexdigest(),
        case_count=len(items), content=content, items=items)


PROMPTS = ["one two three", "the cat sat", "hello there", "count to five", "a b c d", "numbers go up", "x y"]


def greedy(url: str, prompt: str, model: str = "e2e") -> str:
    body = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "seed": 0}).json()
    return body["choices"][0]["text"]


def deployed_with_half_right_set(operator, log: Path, name: str = "e2e", eval_set: str = "e2e-set"):
    """A deployment `name` of the tiny model made through the API and waited for (a worker must run), and
    an exact set of PROMPTS whose cases 0, 2, 4, 6 expect the replica's own greedy answer and the others
    something it never says; returns the ready replica."""
    assert operator.post("/api/v1/deployments/", {"name": name, "model": "tiny", "version": 1},
                         format="json").status_code == 201
    wait_until(lambda: operator.get(f"/api/v1/deployments/{name}/").json()["up_to_date"],
               lambda: f"the deployment to be ready\n{log.read_text()[-3000:]}", 120, 0.5)
    replica = Replica.objects.get(deployment__name=name, state=ReplicaState.READY)
    cases = [{"id": f"c{i}", "prompt": prompt, "expected": greedy(replica.url, prompt, name) if i % 2 == 0 else "nope"}
             for i, prompt in enumerate(PROMPTS)]
    eval_set_with(cases, name=eval_set)
    return replica

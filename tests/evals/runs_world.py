"""Rows the eval-run tests share: a registered tiny model, an eval set with one version of cases,
a deployment of the model (rows only; the tests that serve start its replicas themselves)."""

from __future__ import annotations

import hashlib
import json

from evals.models import EvalSet, EvalSetVersion
from registry import services as registry_services
from registry.models import ModelVersion, RegisteredModel


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

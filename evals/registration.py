"""Scoring a new model version on its model's default eval sets by itself.

A version registered for a model that has default eval sets (EvalSet.default_for) gets one run per
set, on the set's latest version, once the registration has committed: the run's task must find the
version's row, and a registration that rolls back must start nothing. Starting a run never breaks a
registration: a set that cannot be run (no version yet, a parity set for a model's first version)
is logged and skipped.
"""

from __future__ import annotations

import logging

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models.signals import post_save
from rest_framework.exceptions import APIException

from evals.choices import Trigger
from evals.models import EvalRun, EvalSet
from evals.runs.services import run_create, uses_parity
from registry.models import ModelVersion

logger = logging.getLogger(__name__)

DISPATCH_UID = "evals.registration.score_new_version"


def connect() -> None:
    """Called once from EvalsConfig.ready."""
    post_save.connect(_version_saved, sender=ModelVersion, dispatch_uid=DISPATCH_UID)


def _version_saved(sender, instance: ModelVersion, created: bool, raw: bool = False, **kwargs) -> None:
    if created and not raw:  # not when loading fixtures
        version_pk = instance.pk
        transaction.on_commit(lambda: score_new_version(version_pk), robust=True)


def score_new_version(version_pk: int) -> list[EvalRun]:
    """Starts a run on each of the version's model's default eval sets; the runs started."""
    version = ModelVersion.objects.select_related("model", "created_by").filter(pk=version_pk).first()
    if version is None:  # deleted before the commit hook ran
        return []
    started = []
    for eval_set in EvalSet.objects.filter(default_for=version.model_id).order_by("name"):
        try:
            started.append(_start(eval_set, version))
        except Exception as exc:  # one set's failure must not stop the others, nor the registration
            logger.warning("not scoring %s on eval set %s: %s", version, eval_set.name, _reason(exc),
                           exc_info=not isinstance(exc, ValidationError | APIException))
    return started


def _start(eval_set: EvalSet, version: ModelVersion) -> EvalRun:
    set_version = eval_set.latest_version()
    reference = parent_version(version) if set_version is not None and uses_parity(set_version) else None
    return run_create(eval_set=eval_set, actor=version.created_by, set_version=set_version,
                      target={"model": version.model.name, "version": version.number},
                      reference=reference, trigger=Trigger.REGISTER)


def parent_version(version: ModelVersion) -> ModelVersion | None:
    """The version this one follows, the model's previous number: parity cases of a new version
    compare with it, and its page shows its scores next to this one's."""
    return (ModelVersion.objects.filter(model_id=version.model_id, number__lt=version.number)
            .order_by("-number").first())


def _reason(exc: Exception) -> str:
    if isinstance(exc, ValidationError) and hasattr(exc, "error_dict"):
        return "; ".join(f"{field}: {' '.join(messages)}" for field, messages in exc.message_dict.items())
    if isinstance(exc, ValidationError):
        return " ".join(exc.messages)
    return str(getattr(exc, "detail", exc))

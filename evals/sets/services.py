"""Eval sets and their versions. Each operation owns its transaction and records one audit event per write.

A version is immutable: the JSONL as uploaded, its sha256 and its checked cases. A file with any bad
line stores nothing (evals/sets/jsonl.py names every one).
"""

from __future__ import annotations

import hashlib

from django.conf import settings
from django.db import transaction
from django.db.models import Max

from evals.models import EvalSet, EvalSetVersion
from evals.sets import jsonl
from inferops.audit import actor_or_none, audit_record
from inferops.writes import create_audited, update_audited


def upload_limits() -> jsonl.Limits:
    return jsonl.Limits(max_bytes=settings.INFEROPS_EVALSET_MAX_BYTES,
                        max_cases=settings.INFEROPS_EVALSET_MAX_CASES)


def upload_body_limit() -> int:
    """The largest request body an upload URL takes: the file, and a multipart envelope within the usual limit."""
    return settings.INFEROPS_EVALSET_MAX_BYTES + settings.DATA_UPLOAD_MAX_MEMORY_SIZE


def evalset_create(*, name: str, scorer: str, actor, description: str = "", default_for=()) -> EvalSet:
    eval_set = EvalSet(name=name, scorer=scorer, description=description, created_by=actor_or_none(actor))
    return create_audited(eval_set, actor=actor, action="evalset.create",
                          taken=f"An eval set named {name!r} already exists.",
                          also=lambda created: created.default_for.set(default_for))


def evalset_update(*, eval_set: EvalSet, actor, **changes) -> EvalSet:
    """Change the description, default scorer or the models it scores by default (`default_for`).
    A new default scorer applies to versions uploaded from now on: stored cases keep theirs."""
    default_for = changes.pop("default_for", None)

    def set_models(locked, before) -> dict:
        if default_for is not None:
            locked.default_for.set(default_for)
        return {}

    return update_audited(eval_set, changes, actor=actor, action="evalset.update", adjust=set_models)


def version_upload(*, eval_set: EvalSet, raw: bytes, actor) -> EvalSetVersion:
    """Check the JSONL and store it as the set's next version.

    Raises jsonl.FileTooLarge or jsonl.BadFile (every bad line) and stores nothing. Parsing happens
    before the transaction: thousands of cases must not hold the set's row lock.
    """
    cases = jsonl.parse_cases(raw, default_scorer=eval_set.scorer, limits=upload_limits())
    sha256 = hashlib.sha256(raw).hexdigest()
    with transaction.atomic():
        # Locking the set row serialises concurrent uploads, so numbers never collide.
        EvalSet.objects.select_for_update().get(pk=eval_set.pk)
        latest = eval_set.versions.aggregate(latest=Max("number"))["latest"] or 0
        version = EvalSetVersion.objects.create(
            eval_set=eval_set, number=latest + 1, sha256=sha256, case_count=len(cases),
            content=raw.decode("utf-8"), items=cases, created_by=actor_or_none(actor),
        )
        # The cases themselves stay out of the trail: the digest fixes them.
        audit_record(actor=actor, action="evalset.version.upload", obj=version,
                     after={"eval_set": eval_set.name, "number": version.number, "sha256": sha256,
                            "case_count": version.case_count})
    return version

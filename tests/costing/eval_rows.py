"""Finished eval runs as rows, for the suites that read scores (the comparison, degradation's
fallback): real EvalRun rows as the runner leaves them, without scoring anything."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.utils import timezone

from evals.choices import RunStatus, TargetKind
from evals.models import EvalRun, EvalSetVersion
from registry.models import ModelVersion
from tests.evals.runs_world import eval_set_with


def set_version(name: str = "qa", cases: int = 4) -> EvalSetVersion:
    """One more version of eval set `name`, with `cases` exact cases."""
    return eval_set_with([{"id": f"c{i}", "prompt": f"say {i}", "expected": str(i)} for i in range(cases)],
                         name=name)


def finished_run(version: ModelVersion, on: EvalSetVersion, score: float, *, status: str = RunStatus.SUCCEEDED,
                 finished_at: datetime | None = None, started_at: datetime | None = None, deployment=None,
                 **fields) -> EvalRun:
    finished_at = finished_at or timezone.now()
    passed = round(score * on.case_count)
    return EvalRun.objects.create(
        eval_set=on.eval_set, set_version=on, model_version=version, priority=-1000, status=status,
        target_kind=TargetKind.DEPLOYMENT if deployment else TargetKind.VERSION, deployment=deployment,
        deployment_name=deployment.name if deployment else "", done=on.case_count, total=on.case_count,
        score=score if status == RunStatus.SUCCEEDED else None,
        scores={on.items[0]["scorer"]: {"cases": on.case_count, "passed": passed, "score": score}},
        started_at=started_at or finished_at - timedelta(seconds=30), finished_at=finished_at, **fields)

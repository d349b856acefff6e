"""What a fallback costs in quality: the eval scores of the deployment a level sends requests to,
beside the deployment's own, per eval set.

A deployment's score on a set is evals.runs.services.deployment_score: the latest succeeded run
of the version it serves now. A fallback that scores lower than the deployment on a set both
have a score on is warned about (in the API's document and on the policy form), never refused:
answering worse is often the point of degrading.
"""

from __future__ import annotations

from deployments.models import Deployment
from evals.choices import RunStatus
from evals.models import EvalRun, EvalSet
from evals.runs.services import deployment_score


def percent(score: float) -> str:
    return f"{score * 100:.1f} %"


def deployment_scores(deployment: Deployment) -> dict[str, EvalRun]:
    """Eval set name -> the run that gives the deployment its score on that set now."""
    sets = EvalSet.objects.filter(runs__model_version_id=deployment.version_id,
                                  runs__status=RunStatus.SUCCEEDED).distinct().order_by("name")
    return {eval_set.name: run for eval_set in sets if (run := deployment_score(deployment, eval_set=eval_set))}


def fallbacks_of(levels: list[dict]) -> dict[str, list[dict]]:
    """Fallback deployment name -> the levels that send requests there ({number, name}), in level order."""
    found: dict[str, list[dict]] = {}
    for number, level in enumerate(levels, start=1):
        fallback = (level.get("actions") or {}).get("fallback")
        if fallback:
            found.setdefault(fallback["deployment"], []).append({"number": number, "name": level["name"]})
    return found


def levels_fall_back(levels: list[dict]) -> str:
    """ "Level 1 (shed) falls back", "Levels 1 (shed) and 2 (cap) fall back": the warning's subject."""
    named = [f"{level['number']} ({level['name']})" for level in levels]
    if len(named) == 1:
        return f"Level {named[0]} falls back"
    return f"Levels {', '.join(named[:-1])} and {named[-1]} fall back"


def run_figures(run: EvalRun | None) -> dict | None:
    if run is None:
        return None
    return {"score": run.score, "set_version": run.set_version.number, "run": run.pk}


def fallback_quality(deployment: Deployment, levels: list[dict]) -> list[dict]:
    """Per fallback of the levels: the version it serves and, per eval set either side has a score
    on, its score and the deployment's own (null where a side has none)."""
    own = deployment_scores(deployment)
    quality = []
    for name, used_by in fallbacks_of(levels).items():
        target = Deployment.objects.filter(name=name, deleted_at__isnull=True).select_related("version").first()
        if target is None:
            continue  # deleted since the policy was saved: nothing serves it to score
        theirs = deployment_scores(target)
        quality.append({
            "deployment": name, "version": target.version.number, "levels": used_by,
            "scores": [{"eval_set": eval_set, "fallback": run_figures(theirs.get(eval_set)),
                        "own": run_figures(own.get(eval_set))} for eval_set in sorted(set(theirs) | set(own))],
        })
    return quality


def fallback_warnings(deployment: Deployment, quality: list[dict]) -> list[str]:
    """A line per fallback and eval set where the fallback scores lower than the deployment."""
    warnings = []
    for fallback in quality:
        for row in fallback["scores"]:
            theirs, own = row["fallback"], row["own"]
            if theirs is None or own is None or theirs["score"] >= own["score"]:
                continue
            warnings.append(
                f"{levels_fall_back(fallback['levels'])} to {fallback['deployment']}, which scores "
                f"{percent(theirs['score'])} on eval set {row['eval_set']} (v{theirs['set_version']}), lower than "
                f"{deployment.name}'s {percent(own['score'])} (v{own['set_version']}): requests sent there get "
                "worse answers.")
    return warnings

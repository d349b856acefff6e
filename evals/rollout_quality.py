"""The rollout quality step's implementation (the interface is deployments/rollouts/quality.py),
registered with deployments.rollouts when Django starts.

The candidate is scored by an eval run through the rollout's preview route ({"rollout": id,
"track": "canary"}) at the lowest priority, and compared with the stable spec's latest succeeded
score on the same set version; when the stable spec has none, a run on the deployment's stable
replicas starts beside the candidate's and the step compares once both finish. A set of parity
cases compares the candidate's answers with the stable version's own: the stable score is 1.0 by
definition.
"""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ValidationError

from deployments.choices import Verdict
from deployments.rollouts import quality as rollout_quality
from deployments.rollouts.quality import QualityVerdict, judge
from evals.choices import FINISHED_RUN, RunStatus, Scorer, Trigger
from evals.models import EvalRun, EvalSet, EvalSetVersion
from evals.runs.services import latest_run, run_cancel, run_create, uses_parity
from inferops.api import Conflict

# Where the stable score comes from: the stable spec's latest run, a run started beside the candidate's, or
# the definition of parity (the stable version agrees with itself).
LATEST, STARTED, PARITY = "latest run", "run on stable", "parity"


def run_url(run_id: int) -> str:
    return f"{settings.INFEROPS_EXTERNAL_URL}/evals/runs/{run_id}/"


def failing_cases_url(run_id: int) -> str:
    return f"{run_url(run_id)}?passed=false"


def _set_version(config: dict) -> tuple[EvalSet | None, EvalSetVersion | None, list[str]]:
    """The step's eval set and set version (the latest when it names none), or what is wrong."""
    eval_set = EvalSet.objects.filter(name=config["eval_set"]).first()
    if eval_set is None:
        return None, None, [f"eval_set: no eval set named {config['eval_set']!r}"]
    if config.get("set_version") is None:
        version = eval_set.latest_version()
        if version is None:
            return eval_set, None, [f"eval_set: {eval_set.name!r} has no version yet: upload its cases first"]
        return eval_set, version, []
    version = eval_set.versions.filter(number=config["set_version"]).first()
    if version is None:
        return eval_set, None, [f"set_version: {eval_set.name!r} has no version {config['set_version']}"]
    return eval_set, version, []


def only_parity(version: EvalSetVersion) -> bool:
    return bool(version.items) and all(case.get("scorer") == Scorer.PARITY for case in version.items)


def stable_baseline(rollout, version: EvalSetVersion) -> EvalRun | None:
    """The stable spec's latest succeeded run on this set version; a run of the same version with other
    engine args (a quantization, another engine setting) scored something else, so it does not count."""
    run = latest_run(model_version=rollout.stable_version, set_version=version)
    return run if run is not None and run.engine_args == rollout.stable_engine_args else None


class EvalsRolloutQuality:
    def validate(self, config: dict) -> list[str]:
        return _set_version(config)[2]

    def start(self, rollout, config: dict) -> dict:
        eval_set, version, problems = _set_version(config)
        if problems:
            raise ValidationError(problems)
        # Parity cases compare with the stable version, which the runner reads from the deployment's stable replicas.
        reference = rollout.stable_version if uses_parity(version) else None
        candidate = run_create(eval_set=eval_set, actor=None, target={"rollout": rollout.pk, "track": "canary"},
                               set_version=version, reference=reference, trigger=Trigger.ROLLOUT)
        state = {"set_version": version.number, "runs": {"candidate": candidate.pk}}
        if only_parity(version):
            return {**state, "stable_basis": PARITY}
        baseline = stable_baseline(rollout, version)
        if baseline is None:
            baseline = run_create(eval_set=eval_set, actor=None, target={"deployment": rollout.deployment.name},
                                  set_version=version, reference=reference, trigger=Trigger.ROLLOUT)
            return {**state, "runs": {**state["runs"], "stable": baseline.pk}, "stable_basis": STARTED}
        return {**state, "runs": {**state["runs"], "stable": baseline.pk}, "stable_basis": LATEST}

    def verdict(self, rollout, config: dict, state: dict) -> QualityVerdict:
        runs = {role: EvalRun.objects.filter(pk=run_id).first() for role, run_id in state["runs"].items()}
        candidate, stable = runs["candidate"], runs.get("stable")
        candidate_figures = _figures(candidate, state["runs"]["candidate"])
        stable_figures = ({"run": None, "score": 1.0, "basis": PARITY} if state["stable_basis"] == PARITY
                          else {**_figures(stable, state["runs"]["stable"]), "basis": state["stable_basis"]})
        for role, run in runs.items():
            if run is None or run.status in (RunStatus.FAILED, RunStatus.CANCELLED):
                what = "was deleted" if run is None else f"{run.status}" + (f": {run.error}" if run.error else "")
                return QualityVerdict(Verdict.INCONCLUSIVE, f"the {role}'s eval run {state['runs'][role]} {what}.",
                                      candidate=candidate_figures, stable=stable_figures)
        if candidate.status != RunStatus.SUCCEEDED:
            return QualityVerdict(Verdict.RUNNING, f"{config['eval_set']} v{state['set_version']}: "
                                  f"{_progress('candidate', candidate)}; {_stable_text(stable, state)}",
                                  candidate=candidate_figures, stable=stable_figures)
        link = failing_cases_url(candidate.pk)
        stable_score = stable_figures["score"] if stable is None or stable.status == RunStatus.SUCCEEDED else None
        verdict, checks, reason = judge(config, candidate.score, stable_score)
        if verdict != Verdict.FAIL and stable_score is None:  # only the floor could fail without the stable score
            return QualityVerdict(Verdict.RUNNING, f"candidate scored {candidate.score:.2f}; "
                                  f"{_progress('stable', stable)}", link=link,
                                  candidate=candidate_figures, stable=stable_figures, checks=checks)
        return QualityVerdict(verdict, reason, link=link, candidate=candidate_figures, stable=stable_figures,
                              checks=checks)

    def stop(self, state: dict) -> None:
        # Only the candidate's run: a run on stable scores the deployment's version for later rollouts too.
        run = EvalRun.objects.filter(pk=state["runs"]["candidate"]).exclude(status__in=FINISHED_RUN).first()
        if run is not None:
            try:
                run_cancel(run=run, actor=None)
            except Conflict:  # it finished meanwhile
                pass


def _figures(run: EvalRun | None, run_id: int) -> dict:
    if run is None:
        return {"run": run_id, "status": "deleted", "score": None}
    return {"run": run.pk, "status": run.status, "done": run.done, "total": run.total, "score": run.score,
            "url": run_url(run.pk)}


def _progress(role: str, run: EvalRun) -> str:
    return f"{role} run {run.pk} {run.status}, {run.done}/{run.total} cases"


def _stable_text(stable: EvalRun | None, state: dict) -> str:
    if state["stable_basis"] == PARITY:
        return "stable 1.00 by definition (parity with it)"
    if state["stable_basis"] == LATEST:
        return f"stable {stable.score:.2f} (its latest run, {stable.pk})"
    return _progress("stable", stable) if stable.status != RunStatus.SUCCEEDED else f"stable scored {stable.score:.2f}"


def register() -> None:
    """Called once from EvalsConfig.ready."""
    rollout_quality.register(EvalsRolloutQuality())

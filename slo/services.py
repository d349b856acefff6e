"""SLO operations for the API, the console and OpenSLO import. Each owns its transaction,
validates through Slo.clean() and records one audit event per write."""

from __future__ import annotations

import logging

from django.db import IntegrityError, transaction

from inferops.api import Conflict
from inferops.audit import actor_or_none, audit_record, snapshot
from inferops.locks import LockId, advisory_xact_lock
from inferops.writes import create_audited, update_audited
from slo.models import Slo, SloEvalRun, SloMinute, SloStatus
from slo.usage import FOLD_LOCK

log = logging.getLogger(__name__)

# Changing any of these changes which events are good or counted, so the stored minutes no
# longer describe the SLI: they are dropped and the SLO is back-filled again.
SLI_DEFINITION_FIELDS = frozenset({
    "scope", "deployment", "model", "tenant", "sli_kind", "ttft_ms", "tpot_ms", "e2e_ms", "ratio_good",
    "ratio_total", "budgeting", "timeslice_target", "eval_set",
})


def _evaluate_soon(slo_id: int) -> None:
    """Back-fill and evaluate right after the commit instead of waiting for the next cycle; the
    engines' latency targets follow at once too."""
    from slo.engine_targets import sync_after_commit
    from slo.tasks import evaluate_slo_task

    sync_after_commit()

    def enqueue():
        try:
            evaluate_slo_task.delay(slo_id)
        except Exception:  # the broker being down must not fail the write; the cycle catches up
            log.exception("could not enqueue the evaluation of SLO %s", slo_id)

    transaction.on_commit(enqueue)


def slo_create(*, actor, **fields) -> Slo:
    slo = Slo(**fields, created_by=actor_or_none(actor))
    create_audited(slo, actor=actor, action="slo.create", taken=f"An SLO named {fields.get('name')!r} already exists.",
                   also=lambda created: SloStatus.objects.create(slo=created))
    _evaluate_soon(slo.pk)
    return slo


def _forget_minutes_if_redefined(locked: Slo, before: dict) -> dict:
    """A changed SLI definition drops the stored minutes, which no longer describe it: back-filled again
    (a quality SLI's from the runs of its eval set, which are counted anew)."""
    redefined = any(before.get(name) != snapshot(locked).get(name) for name in SLI_DEFINITION_FIELDS)
    if redefined:
        SloMinute.objects.filter(slo=locked).delete()
        SloEvalRun.objects.filter(slo=locked).delete()
        locked.watermark = None
        locked.backfilled_from = None
    return {"sli_recomputed": redefined}


def slo_update(*, slo: Slo, actor, **fields) -> Slo:
    try:
        locked = update_audited(slo, fields, actor=actor, action="slo.update", adjust=_forget_minutes_if_redefined)
    except IntegrityError:
        raise Conflict(f"An SLO named {fields.get('name')!r} already exists.") from None
    _evaluate_soon(locked.pk)
    return locked


def slo_delete(*, slo: Slo, actor) -> None:
    """Deletes the SLO and its minutes; its alerts stay as history (their SLO link is cleared),
    firing ones resolved first so receivers hear the end."""
    from django.utils import timezone

    from alerts.choices import OPEN_STATUSES
    from alerts.services import alert_resolve
    from slo.engine_targets import sync_after_commit

    with transaction.atomic():
        # Waits for a running evaluation cycle (it holds this key) so the cycle never writes a
        # status or an alert for an SLO that vanished under it; the next cycle skips it.
        advisory_xact_lock(LockId.SLO_EVALUATION)
        # And for the usage batches adding into its minutes (slo/usage.py): none may add a row after
        # its minutes are deleted; later batches no longer find it.
        advisory_xact_lock(LockId.SLO_EVALUATION, FOLD_LOCK[1])
        for alert in slo.alerts.filter(status__in=OPEN_STATUSES):
            alert_resolve(alert=alert, now=timezone.now())
        audit_record(actor=actor, action="slo.delete", obj=slo, before=snapshot(slo))
        slo.delete()
        sync_after_commit()

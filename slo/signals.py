"""What the slo app tells the apps above it, which it must not import (the layers contract).

`cycle_evaluated` is sent by slo.tasks after each full evaluation cycle, with `now` and
`evaluations` ({slo id: slo.evaluation.Evaluation}): every SLO's burn rates as the cycle just
computed them, so a listener (the degradation engine) never queries them again.
`burn_windows` lists callables (slos) -> {slo id: {minutes}}: windows a listener needs beyond the
alerting ones; the cycle computes their burn too (`Evaluation.window_burns`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from django.dispatch import Signal

cycle_evaluated = Signal()

burn_windows: list[Callable[[list], dict[int, set[int]]]] = []


def wanted_windows(slos: list) -> dict[int, set[int]]:
    """Every listener's extra windows, per SLO id."""
    wanted: dict[int, set[int]] = defaultdict(set)
    for provider in burn_windows:
        for slo_id, minutes in provider(slos).items():
            wanted[slo_id].update(minutes)
    return dict(wanted)

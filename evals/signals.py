"""Signals of the evals app, for the apps above it (slo records a quality SLO's score, costing prices a run)."""

from django.dispatch import Signal

# Sent once when a run reaches succeeded, failed or cancelled, after its row is saved: run=EvalRun.
run_finished = Signal()

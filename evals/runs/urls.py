"""Eval run pages (under /evals/) and the eval run API (under /api/v1/), included by evals/urls.py."""

from django.urls import path

from evals.runs import api, views
from inferops.api import PlainMetadata

urlpatterns = [
    path("runs/", views.run_list, name="run-list"),
    path("runs/<int:pk>/", views.run_detail, name="run"),
    path("runs/<int:pk>/cancel/", views.run_cancel, name="run-cancel"),
]

api_urlpatterns = [
    path("evals/runs/", api.EvalRunViewSet.as_view({"get": "list", "post": "create"}), name="api-eval-run-list"),
    path("evals/runs/<int:run_id>/", api.EvalRunViewSet.as_view({"get": "retrieve"}), name="api-eval-run-detail"),
    path("evals/runs/<int:run_id>/cases/", api.EvalRunViewSet.as_view({"get": "cases"}), name="api-eval-run-cases"),
    # An action's OPTIONS has no `actions`: a run's fields are not what cancel takes.
    path("evals/runs/<int:run_id>/cancel/", api.EvalRunViewSet.as_view({"post": "cancel"},
                                                                      metadata_class=PlainMetadata),
         name="api-eval-run-cancel"),
]

"""The rollout pages (under deployments/<name>/) and the rollout API, included by deployments/urls.py."""

from django.urls import path

from deployments.rollouts import api, views
from inferops.api import PlainMetadata

urlpatterns = [
    path("<slug:name>/rollouts/new/", views.rollout_start, name="rollout-start"),
    path("<slug:name>/rollouts/undo/", views.rollout_undo, name="rollout-undo"),
    path("<slug:name>/rollouts/<int:pk>/", views.rollout_detail, name="rollout"),
    path("<slug:name>/rollouts/<int:pk>/promote/", views.rollout_action, {"action": "promote"},
         name="rollout-promote"),
    path("<slug:name>/rollouts/<int:pk>/promote-full/", views.rollout_action, {"action": "promote-full"},
         name="rollout-promote-full"),
    path("<slug:name>/rollouts/<int:pk>/abort/", views.rollout_action, {"action": "abort"}, name="rollout-abort"),
    path("<slug:name>/rollouts/<int:pk>/retry/", views.rollout_action, {"action": "retry"}, name="rollout-retry"),
    path("<slug:name>/rollouts/<int:pk>/auto-rollback/on/", views.rollout_action, {"action": "auto-rollback-on"},
         name="rollout-auto-rollback-on"),
    path("<slug:name>/rollouts/<int:pk>/auto-rollback/off/", views.rollout_action, {"action": "auto-rollback-off"},
         name="rollout-auto-rollback-off"),
]

# An action's OPTIONS has no `actions` (a rollout's fields are not what it takes), as before the ViewSet.
ACTION = {"metadata_class": PlainMetadata}

api_urlpatterns = [
    path("deployments/<str:name>/rollouts/", api.RolloutViewSet.as_view({"get": "list", "post": "create"}),
         name="api-rollout-list"),
    path("deployments/<str:name>/rollouts/undo/", api.RolloutViewSet.as_view({"post": "undo"}, **ACTION),
         name="api-rollout-undo"),
    path("deployments/<str:name>/rollouts/<int:rollout_id>/",
         api.RolloutViewSet.as_view({"get": "retrieve", "patch": "partial_update"}), name="api-rollout-detail"),
    path("deployments/<str:name>/rollouts/<int:rollout_id>/promote/",
         api.RolloutViewSet.as_view({"post": "promote"}, **ACTION),
         name="api-rollout-promote"),
    path("deployments/<str:name>/rollouts/<int:rollout_id>/abort/",
         api.RolloutViewSet.as_view({"post": "abort"}, **ACTION),
         name="api-rollout-abort"),
    path("deployments/<str:name>/rollouts/<int:rollout_id>/retry/",
         api.RolloutViewSet.as_view({"post": "retry"}, **ACTION),
         name="api-rollout-retry"),
]

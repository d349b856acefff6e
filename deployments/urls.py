from django.urls import path

from deployments import api, live_views, rollout_api, views
from deployments.prometheus_sd import PrometheusTargets

app_name = "deployments"

urlpatterns = [
    path("", views.deployment_list, name="list"),
    path("new/", views.deployment_create, name="create"),
    path("<slug:name>/", views.deployment_detail, name="detail"),
    path("<slug:name>/live/", live_views.deployment_live, name="live"),
    path("<slug:name>/edit/", views.deployment_edit, name="edit"),
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

api_urlpatterns = [
    path("prometheus/sd/", PrometheusTargets.as_view(), name="api-prometheus-sd"),
    path("deployments/", api.DeploymentListCreate.as_view(), name="api-deployment-list"),
    path("deployments/<str:name>/", api.DeploymentDetail.as_view(), name="api-deployment-detail"),
    path("deployments/<str:name>/replicas/", api.ReplicaList.as_view(), name="api-deployment-replicas"),
    path("deployments/<str:name>/metrics/", api.DeploymentMetrics.as_view(), name="api-deployment-metrics"),
    path("deployments/<str:name>/rollouts/", rollout_api.RolloutListCreate.as_view(), name="api-rollout-list"),
    path("deployments/<str:name>/rollouts/undo/", rollout_api.RolloutUndo.as_view(), name="api-rollout-undo"),
    path("deployments/<str:name>/rollouts/<int:rollout_id>/", rollout_api.RolloutDetail.as_view(),
         name="api-rollout-detail"),
    path("deployments/<str:name>/rollouts/<int:rollout_id>/promote/", rollout_api.RolloutPromote.as_view(),
         name="api-rollout-promote"),
    path("deployments/<str:name>/rollouts/<int:rollout_id>/abort/", rollout_api.RolloutAbort.as_view(),
         name="api-rollout-abort"),
    path("deployments/<str:name>/rollouts/<int:rollout_id>/retry/", rollout_api.RolloutRetry.as_view(),
         name="api-rollout-retry"),
]

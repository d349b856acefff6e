from django.urls import path

from deployments import api, views

app_name = "deployments"

urlpatterns = [
    path("", views.deployment_list, name="list"),
    path("new/", views.deployment_create, name="create"),
    path("<slug:name>/", views.deployment_detail, name="detail"),
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
]

api_urlpatterns = [
    path("deployments/", api.DeploymentListCreate.as_view(), name="api-deployment-list"),
    path("deployments/<str:name>/", api.DeploymentDetail.as_view(), name="api-deployment-detail"),
    path("deployments/<str:name>/replicas/", api.ReplicaList.as_view(), name="api-deployment-replicas"),
    path("deployments/<str:name>/metrics/", api.DeploymentMetrics.as_view(), name="api-deployment-metrics"),
    path("deployments/<str:name>/rollouts/", api.RolloutListCreate.as_view(), name="api-rollout-list"),
    path("deployments/<str:name>/rollouts/undo/", api.RolloutUndo.as_view(), name="api-rollout-undo"),
    path("deployments/<str:name>/rollouts/<int:rollout_id>/", api.RolloutDetail.as_view(), name="api-rollout-detail"),
    path("deployments/<str:name>/rollouts/<int:rollout_id>/promote/", api.RolloutPromote.as_view(),
         name="api-rollout-promote"),
    path("deployments/<str:name>/rollouts/<int:rollout_id>/abort/", api.RolloutAbort.as_view(),
         name="api-rollout-abort"),
    path("deployments/<str:name>/rollouts/<int:rollout_id>/retry/", api.RolloutRetry.as_view(),
         name="api-rollout-retry"),
]

from django.urls import path

from deployments import api, live_views, views
from deployments.replicas.prometheus_sd import PrometheusTargets
from deployments.rollouts import urls as rollout_urls

app_name = "deployments"

urlpatterns = [
    path("", views.deployment_list, name="list"),
    path("new/", views.deployment_create, name="create"),
    path("<slug:name>/", views.deployment_detail, name="detail"),
    path("<slug:name>/live/", live_views.deployment_live, name="live"),
    path("<slug:name>/edit/", views.deployment_edit, name="edit"),
    *rollout_urls.urlpatterns,
]

api_urlpatterns = [
    path("prometheus/sd/", PrometheusTargets.as_view(), name="api-prometheus-sd"),
    path("deployments/", api.DeploymentViewSet.as_view({"get": "list", "post": "create"}),
         name="api-deployment-list"),
    path("deployments/<str:name>/",
         api.DeploymentViewSet.as_view({"get": "retrieve", "patch": "partial_update", "delete": "destroy"}),
         name="api-deployment-detail"),
    # The replicas are one unpaginated list, as they always were.
    path("deployments/<str:name>/replicas/", api.DeploymentViewSet.as_view({"get": "replicas"}, pagination_class=None),
         name="api-deployment-replicas"),
    path("deployments/<str:name>/metrics/", api.DeploymentViewSet.as_view({"get": "metrics"}),
         name="api-deployment-metrics"),
    path("deployments/<str:name>/cold-starts/", api.DeploymentViewSet.as_view({"get": "cold_starts"}),
         name="api-deployment-cold-starts"),
    *rollout_urls.api_urlpatterns,
]

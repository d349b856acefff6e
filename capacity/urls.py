"""The capacity app's REST API (mounted at /api/v1/) and console forms (mounted at /capacity/)."""

from django.urls import path

from capacity import autoscaling_api, planning_api, planning_views, views

api_urlpatterns = [*autoscaling_api.urlpatterns, *planning_api.urlpatterns]
urlpatterns = [
    path("deployments/<str:name>/autoscaling/", views.policy_edit, name="autoscaling-edit"),
    path("deployments/<str:name>/capacity-runs/", planning_views.capacity_run_start, name="capacity-run-start"),
]

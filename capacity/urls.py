"""The capacity app's REST API (mounted at /api/v1/) and console forms (mounted at /capacity/)."""

from capacity import autoscaling_api, planning_api

api_urlpatterns = [*autoscaling_api.urlpatterns, *planning_api.urlpatterns]
urlpatterns = [*autoscaling_api.console_urlpatterns, *planning_api.console_urlpatterns]

from django.urls import path

from degradation import api, views

# Console forms, under deployments/<name>/degradation/ (project/urls.py); the page is the deployment's.
app_name = "degradation"

urlpatterns = [
    path("policy/", views.policy_edit, name="policy"),
    path("override/", views.override_set, name="override"),
    path("override/clear/", views.override_clear, name="override-clear"),
]

api_urlpatterns = [
    path("deployments/<str:name>/degradation/", api.DegradationViewSet.as_view({"get": "retrieve", "put": "update"}),
         name="api-degradation"),
    path("deployments/<str:name>/degradation/override/",
         api.DegradationViewSet.as_view({"post": "override", "delete": "override_clear"}),
         name="api-degradation-override"),
]

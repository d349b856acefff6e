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
    path("deployments/<str:name>/degradation/", api.DegradationView.as_view(), name="api-degradation"),
    path("deployments/<str:name>/degradation/override/", api.OverrideView.as_view(),
         name="api-degradation-override"),
]

from django.urls import path

from slo import api, interchange_api, views

app_name = "slo"

# Console pages, under /slos/.
urlpatterns = [
    path("", views.slo_list, name="list"),
    path("new/", views.slo_create, name="create"),
    path("<int:pk>/", views.slo_detail, name="detail"),
    path("<int:pk>/edit/", views.slo_edit, name="edit"),
    # Links sent before SLO pages were addressed by id (alerts' generatorURL) named the SLO.
    path("<slug:name>/", views.slo_by_name, name="by-name"),
]

api_urlpatterns = [
    path("slos/", api.SloViewSet.as_view({"get": "list", "post": "create"}), name="api-slo-list"),
    path("slos/<int:pk>/",
         api.SloViewSet.as_view({"get": "retrieve", "patch": "partial_update", "delete": "destroy"}),
         name="api-slo-detail"),
    path("slos/<int:pk>/status/", api.SloViewSet.as_view({"get": "evaluated_status"}), name="api-slo-status"),
    path("slos/<int:pk>/history/", api.SloViewSet.as_view({"get": "history"}), name="api-slo-history"),
    path("slos/<int:pk>/eval-runs/", api.SloViewSet.as_view({"get": "eval_runs"}), name="api-slo-eval-runs"),
    path("slos/import/", interchange_api.SloImport.as_view(), name="api-slo-import"),
    path("slos/<int:pk>/openslo/", interchange_api.SloOpenSlo.as_view(), name="api-slo-openslo"),
    path("slos/<int:pk>/prometheus-rules/", interchange_api.SloPrometheusRules.as_view(),
         name="api-slo-prometheus-rules"),
]

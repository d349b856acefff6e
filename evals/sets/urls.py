from django.urls import path

from evals.sets import api, views

urlpatterns = [
    path("", views.set_list, name="set-list"),
    path("sets/new/", views.set_new, name="set-new"),
    path("sets/<slug:name>/", views.set_detail, name="set-detail"),
    path("sets/<slug:name>/versions/new/", views.version_new, name="version-new"),
]

api_urlpatterns = [
    path("evalsets/", api.EvalSetViewSet.as_view({"get": "list", "post": "create"}), name="api-evalset-list"),
    path("evalsets/<str:name>/", api.EvalSetViewSet.as_view({"get": "retrieve", "patch": "partial_update"}),
         name="api-evalset-detail"),
    path("evalsets/<str:name>/versions/", api.EvalSetVersionViewSet.as_view({"get": "list", "post": "create"}),
         name="api-evalset-version-list"),
    path("evalsets/<str:name>/versions/<int:number>/", api.EvalSetVersionViewSet.as_view({"get": "retrieve"}),
         name="api-evalset-version-detail"),
]

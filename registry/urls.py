from django.urls import path

from registry import api, views

app_name = "registry"

urlpatterns = [
    path("", views.model_list, name="model-list"),
    path("<slug:name>/", views.model_detail, name="model-detail"),
    path("<slug:name>/versions/new/", views.version_new, name="version-new"),
    path("<slug:name>/versions/<int:number>/", views.version_detail, name="version-detail"),
    path("<slug:name>/aliases/", views.alias_move, name="alias-move"),
]

api_urlpatterns = [
    path("models/", api.ModelViewSet.as_view({"get": "list", "post": "create"}), name="api-model-list"),
    path("models/<str:name>/", api.ModelViewSet.as_view({"get": "retrieve", "patch": "partial_update"}),
         name="api-model-detail"),
    path("models/<str:name>/versions/", api.VersionViewSet.as_view({"get": "list", "post": "create"}),
         name="api-version-list"),
    path("models/<str:name>/versions/<int:number>/", api.VersionViewSet.as_view({"get": "retrieve"}),
         name="api-version-detail"),
    path("models/<str:name>/aliases/", api.AliasViewSet.as_view({"get": "list"}), name="api-alias-list"),
    path("models/<str:name>/aliases/<str:alias>/",
         api.AliasViewSet.as_view({"get": "retrieve", "put": "update", "delete": "destroy"}),
         name="api-alias-detail"),
]

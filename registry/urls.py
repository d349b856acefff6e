from django.urls import path

from registry import api, views

app_name = "registry"

urlpatterns = [
    path("", views.model_list, name="model-list"),
    path("<slug:name>/", views.model_detail, name="model-detail"),
    path("<slug:name>/versions/new/", views.version_new, name="version-new"),
    path("<slug:name>/aliases/", views.alias_move, name="alias-move"),
]

api_urlpatterns = [
    path("models/", api.ModelListCreate.as_view(), name="api-model-list"),
    path("models/<str:name>/", api.ModelDetail.as_view(), name="api-model-detail"),
    path("models/<str:name>/versions/", api.VersionListCreate.as_view(), name="api-version-list"),
    path("models/<str:name>/versions/<int:number>/", api.VersionDetail.as_view(), name="api-version-detail"),
    path("models/<str:name>/aliases/", api.AliasList.as_view(), name="api-alias-list"),
    path("models/<str:name>/aliases/<str:alias>/", api.AliasDetail.as_view(), name="api-alias-detail"),
]

from django.urls import path

from tenants import api, views

app_name = "tenants"

urlpatterns = [
    path("", views.tenant_list, name="list"),
    path("<slug:name>/", views.tenant_detail, name="detail"),
    path("<slug:name>/limits/", views.tenant_limits, name="limits"),
    path("<slug:name>/keys/<str:prefix>/revoke/", views.key_revoke, name="key-revoke"),
]

api_urlpatterns = [
    path("tenants/", api.TenantViewSet.as_view({"get": "list", "post": "create"}), name="api-tenant-list"),
    path("tenants/<str:name>/", api.TenantViewSet.as_view({"get": "retrieve", "patch": "partial_update"}),
         name="api-tenant-detail"),
    path("tenants/<str:name>/keys/", api.ApiKeyViewSet.as_view({"get": "list", "post": "create"}),
         name="api-key-list"),
    path("tenants/<str:name>/keys/<str:prefix>/", api.ApiKeyViewSet.as_view({"get": "retrieve", "delete": "destroy"}),
         name="api-key-detail"),
    path("usage/", api.Usage.as_view(), name="api-usage"),
]

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView

from alerts.urls import api_urlpatterns as alerts_api
from batches.urls import openai_urlpatterns as batches_openai
from capacity.urls import api_urlpatterns as capacity_api
from costing import views as costing_views
from costing.urls import api_urlpatterns as costing_api
from degradation.urls import api_urlpatterns as degradation_api
from deployments.urls import api_urlpatterns as deployments_api
from evals.urls import api_urlpatterns as evals_api
from inferops import api, user_views, views
from inferops.login_limits import LoginView
from project.metrics import ControlPlaneMetrics
from registry.urls import api_urlpatterns as registry_api
from slo.urls import api_urlpatterns as slo_api
from tenants.urls import api_urlpatterns as tenants_api

urlpatterns = [
    path("", views.home, name="home"),
    path("login/", LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    # A model's page, but costing's view: the comparison reads eval runs, usage and costs, all above the registry.
    path("models/<slug:name>/compare/", costing_views.version_compare_page, name="model-compare"),
    path("models/", include("registry.urls")),
    path("deployments/", include("deployments.urls")),
    path("deployments/<slug:name>/degradation/", include("degradation.urls")),
    path("tenants/", include("tenants.urls")),
    path("slos/", include("slo.urls")),
    path("evals/", include("evals.urls")),
    path("alerts/", include("alerts.urls")),
    path("costs/", costing_views.report_page, name="costs"),
    path("costs/", include("costing.urls")),
    path("capacity/", include("capacity.urls")),
    path("batches/", include("batches.urls")),
    path("assets/plotly-<str:digest>.min.js", views.plotly_js, name="plotly-js"),
    path("audit/", views.audit_log, name="audit"),
    path("users/", user_views.user_list, name="users"),
    path("users/<int:pk>/role/", user_views.user_role_change, name="user-role"),
    path("users/<int:pk>/deactivate/", user_views.user_deactivate_view, name="user-deactivate"),
    path("healthz", views.healthz, name="healthz"),
    path("favicon.ico", views.favicon, name="favicon"),
    path("metrics", ControlPlaneMetrics.as_view(), name="metrics"),
    path("admin/", admin.site.urls),
    path("api/v1/audit/", api.AuditList.as_view(), name="api-audit-list"),
    path("api/v1/", include(registry_api)),
    path("api/v1/", include(deployments_api)),
    path("api/v1/", include(degradation_api)),
    path("api/v1/", include(evals_api)),
    path("api/v1/", include(slo_api)),
    path("api/v1/", include(alerts_api)),
    path("api/v1/", include(tenants_api)),
    path("api/v1/", include(costing_api)),
    path("api/v1/", include(capacity_api)),
    # OpenAI's Files and Batches API, with API keys; the gateway forwards its /v1/files* and /v1/batches* here.
    path("v1/", include(batches_openai)),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    # The split view serves its script from a URL of its own: no inline script (the console's CSP).
    path("api/docs/", SpectacularSwaggerSplitView.as_view(url_name="schema"), name="api-docs"),
]

handler404 = views.page_not_found

from django.urls import path

from alerts import api, views
from alerts.inbound import api as inbound_api
from alerts.inbound import views as integration_views
from alerts.receivers import urls as receiver_urls
from alerts.routing import api as routing_api
from alerts.routing import urls as routing_urls
from alerts.schedules import urls as schedule_urls
from alerts.silences import api as silence_api
from alerts.silences import views as silence_views
from inferops.roles import OPERATOR

app_name = "alerts"

urlpatterns = [
    path("", views.alert_list, name="list"),
    path("ack/<str:token>/", views.acknowledge_by_link, name="ack-link"),
    path("integrations/", integration_views.integration_list, name="integrations"),
    path("integrations/<int:pk>/deactivate/", integration_views.integration_deactivate,
         name="integration-deactivate"),
    path("silences/", silence_views.silence_list, name="silence-list"),
    path("silences/new/", silence_views.silence_new, name="silence-new"),
    path("silences/<int:pk>/edit/", silence_views.silence_edit, name="silence-edit"),
    path("silences/<int:pk>/expire/", silence_views.silence_expire, name="silence-expire"),
    path("<int:pk>/", views.alert_detail, name="detail"),
    path("<int:pk>/acknowledge/", views.alert_action, {"action": "ack"}, name="acknowledge"),
    path("<int:pk>/resolve/", views.alert_action, {"action": "resolve"}, name="resolve"),
    path("<int:pk>/snooze/", views.alert_action, {"action": "snooze"}, name="snooze"),
    path("<int:pk>/comment/", views.alert_action, {"action": "comment"}, name="comment"),
    *schedule_urls.urlpatterns,
    *routing_urls.urlpatterns,
    *receiver_urls.urlpatterns,
]

api_urlpatterns = [
    path("alerts/", api.AlertViewSet.as_view({"get": "list"}), name="api-alert-list"),
    path("alerts/alertmanager/", inbound_api.AlertmanagerReceiver.as_view(), name="api-alertmanager-receiver"),
    path("alerts/<int:pk>/", api.AlertViewSet.as_view({"get": "retrieve"}), name="api-alert-detail"),
    path("alerts/<int:pk>/ack/", api.AlertViewSet.as_view({"post": "ack"}), name="api-alert-ack"),
    path("alerts/<int:pk>/resolve/", api.AlertViewSet.as_view({"post": "resolve"}), name="api-alert-resolve"),
    path("alerts/<int:pk>/snooze/", api.AlertViewSet.as_view({"post": "snooze"}), name="api-alert-snooze"),
    # The timeline is one unpaginated list, as it always was.
    path("alerts/<int:pk>/comments/",
         api.AlertViewSet.as_view({"get": "comments", "post": "comment"}, pagination_class=None),
         name="api-alert-comments"),
    path("receivers/", api.ReceiverViewSet.as_view({"get": "list", "post": "create"}), name="api-receiver-list"),
    path("receivers/<int:pk>/",
         api.ReceiverViewSet.as_view({"get": "retrieve", "patch": "partial_update", "delete": "destroy"}),
         name="api-receiver-detail"),
    # A write to this read-only list is a 405 for an operator, as before the ViewSet (not the admin-only 403).
    path("receivers/<int:pk>/deliveries/", api.ReceiverViewSet.as_view({"get": "deliveries"}, write_role=OPERATOR),
         name="api-receiver-deliveries"),
    path("integrations/", inbound_api.IntegrationViewSet.as_view({"get": "list", "post": "create"}),
         name="api-integration-list"),
    path("integrations/<int:pk>/", inbound_api.IntegrationViewSet.as_view({"get": "retrieve", "delete": "destroy"}),
         name="api-integration-detail"),
    path("silences/", silence_api.SilenceViewSet.as_view({"get": "list", "post": "create"}), name="api-silence-list"),
    path("silences/<int:pk>/", silence_api.SilenceViewSet.as_view({"get": "retrieve", "delete": "destroy"}),
         name="api-silence-detail"),
    path("routes/", routing_api.RouteViewSet.as_view({"get": "list", "post": "create"}), name="api-route-list"),
    path("routes/<int:pk>/", routing_api.RouteViewSet.as_view(
        {"get": "retrieve", "patch": "partial_update", "put": "partial_update", "delete": "destroy"}),
         name="api-route-detail"),
    path("escalation-policies/", routing_api.EscalationPolicyViewSet.as_view({"get": "list", "post": "create"}),
         name="api-policy-list"),
    path("escalation-policies/<str:name>/", routing_api.EscalationPolicyViewSet.as_view(
        {"get": "retrieve", "put": "update", "delete": "destroy"}), name="api-policy-detail"),
    *schedule_urls.api_urlpatterns,
]

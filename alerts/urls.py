from django.urls import path

from alerts import api, views

app_name = "alerts"

urlpatterns = [
    path("", views.alert_list, name="list"),
]

api_urlpatterns = [
    path("alerts/", api.AlertList.as_view(), name="api-alert-list"),
    path("alerts/<int:pk>/", api.AlertDetail.as_view(), name="api-alert-detail"),
    path("receivers/", api.ReceiverListCreate.as_view(), name="api-receiver-list"),
    path("receivers/<int:pk>/", api.ReceiverDetail.as_view(), name="api-receiver-detail"),
    path("receivers/<int:pk>/deliveries/", api.ReceiverDeliveries.as_view(), name="api-receiver-deliveries"),
]

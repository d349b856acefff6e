"""Console pages of the routing tree and escalation policies (included by alerts/urls.py)."""

from __future__ import annotations

from django.urls import path

from alerts.routing import views as routing_views

urlpatterns = [
    path("routes/", routing_views.route_list, name="routes"),
    path("routes/new/", routing_views.route_edit, name="route-new"),
    path("routes/<int:pk>/edit/", routing_views.route_edit, name="route-edit"),
    path("routes/<int:pk>/delete/", routing_views.route_remove, name="route-delete"),
    path("escalation-policies/", routing_views.policy_list, name="policies"),
    path("escalation-policies/new/", routing_views.policy_edit, name="policy-new"),
    path("escalation-policies/<slug:name>/edit/", routing_views.policy_edit, name="policy-edit"),
    path("escalation-policies/<slug:name>/delete/", routing_views.policy_remove, name="policy-delete"),
]

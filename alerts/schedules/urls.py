"""URLs of on-call schedules: console pages and the REST API (included by alerts/urls.py)."""

from __future__ import annotations

from django.urls import path

from alerts.schedules import api as schedule_api
from alerts.schedules import views as schedule_views

urlpatterns = [
    path("schedules/", schedule_views.schedule_list, name="schedule-list"),
    path("schedules/new/", schedule_views.schedule_edit, name="schedule-new"),
    path("schedules/<slug:name>/", schedule_views.schedule_detail, name="schedule-detail"),
    path("schedules/<slug:name>/edit/", schedule_views.schedule_edit, name="schedule-edit"),
    path("schedules/<slug:name>/delete/", schedule_views.schedule_remove, name="schedule-delete"),
    path("schedules/<slug:name>/overrides/", schedule_views.override_add, name="schedule-override-add"),
    path("schedules/<slug:name>/overrides/<int:pk>/delete/", schedule_views.override_remove,
         name="schedule-override-delete"),
]

api_urlpatterns = [
    path("schedules/", schedule_api.ScheduleViewSet.as_view({"get": "list", "post": "create"}),
         name="api-schedule-list"),
    path("schedules/<slug:name>/",
         schedule_api.ScheduleViewSet.as_view({"get": "retrieve", "put": "update", "delete": "destroy"}),
         name="api-schedule-detail"),
    path("schedules/<slug:name>/on-call/", schedule_api.ScheduleViewSet.as_view({"get": "on_call"}),
         name="api-schedule-on-call"),
    path("schedules/<slug:name>/shifts/", schedule_api.ScheduleViewSet.as_view({"get": "shifts"}),
         name="api-schedule-shifts"),
    path("schedules/<slug:name>/overrides/", schedule_api.ScheduleOverrideViewSet.as_view({"post": "create"}),
         name="api-schedule-overrides"),
    path("schedules/<slug:name>/overrides/<int:pk>/", schedule_api.ScheduleOverrideViewSet.as_view(
        {"delete": "destroy"}), name="api-schedule-override-detail"),
]

"""Console pages of receivers (included by alerts/urls.py)."""

from __future__ import annotations

from django.urls import path

from alerts.receivers import views as receiver_views

urlpatterns = [
    path("receivers/", receiver_views.receiver_list, name="receivers"),
    path("receivers/new/", receiver_views.receiver_edit, name="receiver-new"),
    path("receivers/<int:pk>/edit/", receiver_views.receiver_edit, name="receiver-edit"),
    path("receivers/<int:pk>/delete/", receiver_views.receiver_remove, name="receiver-delete"),
]

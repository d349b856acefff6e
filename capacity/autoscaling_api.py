"""Placeholder: filled in by this issue."""

urlpatterns: list = []
console_urlpatterns: list = []

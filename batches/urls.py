from django.urls import path

from batches import openai_api, views

# OpenAI's Files and Batches API (mounted at /v1/; the gateway forwards these paths here).
openai_urlpatterns = [
    path("files", openai_api.files, name="openai-files"),
    path("files/<str:file_id>", openai_api.file_detail, name="openai-file"),
    path("files/<str:file_id>/content", openai_api.file_content, name="openai-file-content"),
    path("batches", openai_api.batches, name="openai-batches"),
    path("batches/<str:batch_id>", openai_api.batch_detail, name="openai-batch"),
    path("batches/<str:batch_id>/cancel", openai_api.batch_cancel, name="openai-batch-cancel"),
]

# The console's pages (mounted at /batches/).
urlpatterns = [
    path("", views.batch_list, name="batch-list"),
    path("<str:batch_id>/", views.batch_detail, name="batch-detail"),
    path("files/<str:file_id>/download/", views.file_download, name="batch-file-download"),
]

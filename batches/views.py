"""The console's batch pages (filled out by the console work)."""

from django.http import Http404


def batch_list(request):
    raise Http404


def batch_detail(request, batch_id: str):
    raise Http404


def file_download(request, file_id: str):
    raise Http404

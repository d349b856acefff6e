"""The evals app's console pages (mounted at /evals/) and API routes (under /api/v1/), by concern."""

from evals.runs import urls as runs
from evals.sets import urls as sets

app_name = "evals"

urlpatterns = sets.urlpatterns + runs.urlpatterns
api_urlpatterns = sets.api_urlpatterns + runs.api_urlpatterns

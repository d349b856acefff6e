from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.db.models import Case, IntegerField, Prefetch, Value, When
from django.shortcuts import render

from alerts.choices import AlertStatus
from alerts.models import Alert, Notification


@login_required
def alert_list(request):
    """Firing alerts first (newest first), then the resolved history, with their webhook deliveries."""
    status = request.GET.get("status", "")
    alerts = (Alert.objects.select_related("slo")
              .prefetch_related(Prefetch("notifications", Notification.objects.select_related("receiver")))
              .annotate(firing_first=Case(When(status=AlertStatus.FIRING, then=Value(0)), default=Value(1),
                                          output_field=IntegerField()))
              .order_by("firing_first", "-starts_at"))
    if status in AlertStatus.values:
        alerts = alerts.filter(status=status)
    page = Paginator(alerts, 50).get_page(request.GET.get("page"))
    return render(request, "alerts/list.html", {"page": page, "status": status, "statuses": AlertStatus.choices})

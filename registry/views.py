from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.db.models import Q
from django.shortcuts import get_object_or_404, render

from registry.api import model_queryset
from registry.choices import Task
from registry.models import AuditEvent


@login_required
def model_list(request):
    search = request.GET.get("q", "").strip()
    task = request.GET.get("task", "")
    models = model_queryset()
    if search:
        models = models.filter(
            Q(name__icontains=search) | Q(description__icontains=search)
            | Q(owner__icontains=search) | Q(tags__contains=[search])
        )
    if task in Task.values:
        models = models.filter(task=task)
    page = Paginator(models, 50).get_page(request.GET.get("page"))
    return render(request, "registry/model_list.html", {
        "page": page, "search": search, "task": task, "tasks": Task.choices,
    })


@login_required
def model_detail(request, name: str):
    model = get_object_or_404(model_queryset(), name=name)
    versions = model.versions.prefetch_related("aliases").order_by("-number")
    version_ids = [str(v.pk) for v in versions]
    alias_ids = [str(a.pk) for a in model.aliases.all()]
    audit = AuditEvent.objects.filter(
        Q(object_type="registry.registeredmodel", object_id=str(model.pk))
        | Q(object_type="registry.modelversion", object_id__in=version_ids)
        | Q(object_type="registry.alias", object_id__in=alias_ids)
        | Q(object_type="registry.alias", before__model=model.pk)
    )[:100]
    return render(request, "registry/model_detail.html", {
        "model": model, "versions": versions, "aliases": model.aliases.all(), "audit": audit,
    })

"""Operator pages.  Login is required everywhere (LoginRequiredMiddleware)."""

from __future__ import annotations

from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET

from runs.models import Run


@require_GET
def runs_list(request: HttpRequest) -> HttpResponse:
    runs = Run.objects.only(
        "id", "question", "status", "phase", "lease_epoch", "created_at", "finished_at"
    )
    status = request.GET.get("status", "")
    if status:
        runs = runs.filter(status=status)
    page = Paginator(runs, 50).get_page(request.GET.get("page"))
    return render(request, "runs_list.html", {"page": page, "status": status})


@require_GET
def run_detail(request: HttpRequest, run_id: int) -> HttpResponse:
    run = get_object_or_404(Run, pk=run_id)
    context = {
        "run": run,
        "actions": run.actions.select_related("receipt").order_by("id"),
        "revisions": run.revisions.order_by("number"),
        "events": run.events.select_related("action").order_by("created_at", "id")[:500],
    }
    return render(request, "run_detail.html", context)

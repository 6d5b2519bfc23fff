"""Operator pages.  Login is required everywhere (LoginRequiredMiddleware);
actions need the operate_run permission, checked here, in the view.  A
parameter a view cannot use answers 400 with what was wrong
(security.rejects_bad_input), never a page that quietly ignored it."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from functools import wraps
from typing import Any

import markdown
import nh3
from django.contrib import messages
from django.core.exceptions import BadRequest, PermissionDenied
from django.db.models import Q, QuerySet, Sum
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.utils.safestring import SafeString, mark_safe
from django.views.decorators.http import require_GET, require_POST
from django_htmx.http import HttpResponseStopPolling

from dashboard import charts
from dashboard.security import rejects_bad_input
from evidence import locks, pglog
from evidence.models import (
    CaptureGap,
    CaptureGapHour,
    CaptureStats,
    EvidenceCopy,
    IncidentSource,
    LockIncident,
    LockWait,
)
from runs.models import OutcomeState, Run, RunStatus, older_than, page_cursor

PAGE_SIZE = 50
EVENTS_PAGE = 50
LOG_UPLOAD_LIMIT = 5 * 1024 * 1024


def operator_required(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    @wraps(view)
    def checked(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not request.user.has_perm("runs.operate_run"):
            raise PermissionDenied("operators only")
        return view(request, *args, **kwargs)

    return checked


def _choice(request: HttpRequest, name: str, choices: list[str]) -> str:
    """The query parameter `name`, "" when absent or empty."""
    value = request.GET.get(name, "")
    if value and value not in choices:
        raise BadRequest(f"{name}={value!r} is not one of: {', '.join(choices)}")
    return value


def _flag(request: HttpRequest, name: str) -> bool:
    return _choice(request, name, ["0", "1"]) == "1"


def _older_than(rows: QuerySet, cursor: str) -> QuerySet:
    try:
        return older_than(rows, cursor)
    except ValueError as error:
        raise BadRequest(str(error)) from None


def _partial(request: HttpRequest, target: str) -> bool:
    return bool(request.htmx) and request.htmx.target == target  # type: ignore[attr-defined]


# -- runs -------------------------------------------------------------------------


@require_GET
@rejects_bad_input
def runs_list(request: HttpRequest) -> HttpResponse:
    filters = {
        "status": _choice(request, "status", RunStatus.values),
        "unknown": _flag(request, "unknown"),
        "gaps": _flag(request, "gaps"),
        "q": request.GET.get("q", "").strip(),
    }
    runs = Run.objects.listing().only(
        "id", "question", "status", "phase", "lease_owner", "lease_epoch", "created_at"
    )
    if filters["status"]:
        runs = runs.filter(status=filters["status"])
    if filters["unknown"]:
        runs = runs.with_open_unknowns()
    if filters["gaps"]:
        runs = runs.with_capture_gaps()
    if filters["q"]:
        runs = runs.filter(question__icontains=filters["q"])
    if cursor := request.GET.get("before"):
        runs = _older_than(runs, cursor)
    page = list(runs.order_by("-created_at", "-id")[: PAGE_SIZE + 1])
    more, page = len(page) > PAGE_SIZE, page[:PAGE_SIZE]
    context = {
        "runs": page,
        "filters": filters,
        "statuses": RunStatus.choices,
        "next_cursor": page_cursor(page[-1]) if more and page else "",
        "live": any(run.is_active for run in page),
        "now": timezone.now(),
    }
    if _partial(request, "run-rows"):
        response = render(request, "runs_list.html#rows", context)
        return response if context["live"] else HttpResponseStopPolling(response.content)
    return render(request, "runs_list.html", context)


@require_GET
@rejects_bad_input
def run_detail(request: HttpRequest, run_id: int) -> HttpResponse:
    run = get_object_or_404(Run, pk=run_id)
    before = request.GET.get("events_before", "")
    if before and request.htmx:  # type: ignore[attr-defined]
        return render(request, "run_detail.html#events", _events(run, before))
    context = {"run": run, **_live(run), **_events(run, before)}
    if _partial(request, "run-live"):
        response = render(request, "run_detail.html#live", context)
        return response if run.is_active else HttpResponseStopPolling(response.content)
    return render(request, "run_detail.html", context)


def _live(run: Run) -> dict[str, Any]:
    """What changes while a run is active."""
    revisions = list(run.revisions.order_by("number"))
    for revision in revisions:
        revision.html = _answer_html(revision.content) if revision.is_final else ""
    stats = CaptureStats.objects.filter(run=run).first()
    items = list(run.outcome_items.order_by("id"))
    return {
        "actions": run.actions.select_related("receipt").order_by("id"),
        "checkpoints": run.checkpoints.select_related("after_action").order_by("id"),
        "revisions": revisions,
        "items": items,
        "open_items": sum(item.state == OutcomeState.OPEN for item in items),
        "copies": EvidenceCopy.objects.filter(run=run).order_by("id")[:50],
        "gaps": CaptureGap.objects.filter(run=run).order_by("id")[:50],
        "capture": stats,
        "waits": LockWait.objects.filter(Q(waiter_run=run) | Q(blocker_run=run))
        .select_related("incident")
        .order_by("-first_seen")[:50],
        "faults": json.dumps(run.faults, indent=1) if run.faults else "",
        "timeline": json.loads(charts.timeline(run)),
    }


def _events(run: Run, before: str) -> dict[str, Any]:
    """The event log, newest first, a page at a time from `before`
    (a page_cursor); BadRequest when `before` is not one."""
    events = run.events.select_related("action").order_by("-created_at", "-id")
    if before:
        events = _older_than(events, before)
    page = list(events[: EVENTS_PAGE + 1])
    more, page = len(page) > EVENTS_PAGE, page[:EVENTS_PAGE]
    return {
        "run": run,
        "events": page,
        "events_cursor": page_cursor(page[-1]) if more else "",
    }


def _answer_html(content: str) -> SafeString:
    """Model output, rendered from markdown and sanitised: no script, no
    event handler attribute survives."""
    html = markdown.markdown(content, extensions=["tables"])
    return mark_safe(nh3.clean(html))  # noqa: S308 (sanitised by nh3 just above)


@require_POST
@operator_required
@rejects_bad_input
def run_cancel(request: HttpRequest, run_id: int) -> HttpResponse:
    run = get_object_or_404(Run, pk=run_id)
    if run.request_cancel(by=request.user.get_username()):
        messages.success(request, f"Cancel requested for run {run.pk}.")
    else:
        messages.info(request, f"Run {run.pk} had already ended or was being cancelled.")
    run.refresh_from_db()
    if request.htmx:  # type: ignore[attr-defined]
        return render(request, "run_detail.html#live", {"run": run, **_live(run)})
    return redirect("run-detail", run_id=run.pk)


# -- locks ------------------------------------------------------------------------


@require_GET
@rejects_bad_input
def locks_list(request: HttpRequest) -> HttpResponse:
    incidents = LockIncident.objects.order_by("-started_at", "-id")
    source = _choice(request, "source", IncidentSource.values)
    if source:
        incidents = incidents.filter(source=source)
    context = {
        "incidents": incidents[:100],
        "source": source,
        "sources": IncidentSource.choices,
        "upload_limit_mb": LOG_UPLOAD_LIMIT // (1024 * 1024),
    }
    return render(request, "locks.html", context)


@require_GET
@rejects_bad_input
def lock_detail(request: HttpRequest, incident_id: int) -> HttpResponse:
    incident = get_object_or_404(LockIncident, pk=incident_id)
    context = {
        "incident": incident,
        "waits": incident.waits.order_by("id"),
        "graph": json.loads(charts.lock_graph(incident)),
    }
    return render(request, "lock_detail.html", context)


@require_POST
@operator_required
@rejects_bad_input
def locks_import(request: HttpRequest) -> HttpResponse:
    upload = request.FILES.get("log")
    if upload is None:
        messages.error(request, "Choose a PostgreSQL log file to import.")
        return redirect("locks")
    if upload.size > LOG_UPLOAD_LIMIT:
        messages.error(
            request, f"{upload.name} is {upload.size} bytes; the limit is {LOG_UPLOAD_LIMIT}."
        )
        return redirect("locks")
    # NUL is replaced like an undecodable byte: PostgreSQL text cannot hold
    # one, and the statements quoted in a report are stored as text.
    text = upload.read().decode(errors="replace").replace("\x00", "\ufffd")
    reports = pglog.parse(text)
    if not reports:
        messages.error(request, f"No 'deadlock detected' report found in {upload.name}.")
        return redirect("locks")
    for report in reports:
        locks.store(
            IncidentSource.LOG,
            report.graph,
            summary=f"deadlock of {len(report.graph.processes)} processes from {upload.name}",
        )
    messages.success(request, f"{len(reports)} deadlock reports imported from {upload.name}.")
    return redirect("locks")


# -- capture gaps -----------------------------------------------------------------


@require_GET
@rejects_bad_input
def gaps(request: HttpRequest) -> HttpResponse:
    """Read from the hourly and per-run counters capture keeps, so the page
    costs the same however many gaps there are."""
    since = timezone.now() - dt.timedelta(days=7)
    hours = CaptureGapHour.objects.filter(hour__gte=since)
    hourly = hours.order_by("hour").values_list("hour", "reason", "count")
    context = {
        "chart": json.loads(
            charts.gaps_over_time((hour.isoformat(), reason, n) for hour, reason, n in hourly)
        ),
        "by_reason": hours.values("reason").annotate(n=Sum("count")).order_by("-n"),
        "by_run": CaptureStats.objects.filter(lost__gt=0)
        .select_related("run")
        .order_by("-lost")[:50],
        "latest": CaptureGap.objects.order_by("-created_at", "-id")[:50],
        "since": since,
    }
    return render(request, "gaps.html", context)

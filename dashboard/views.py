"""Operator pages.  Login is required everywhere (LoginRequiredMiddleware);
actions need the operate_run permission, checked here, in the view.  A
parameter a view cannot use answers 400 with what was wrong
(security.rejects_bad_input), never a page that quietly ignored it."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import markdown
import nh3
from django.contrib import messages
from django.core.exceptions import BadRequest
from django.db.models import Q, QuerySet, Sum
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.utils.safestring import SafeString, mark_safe
from django.views.decorators.http import require_GET, require_POST
from django_htmx.http import HttpResponseStopPolling

from dashboard import charts
from dashboard.context import evidence_fields, plain, status_words, words
from dashboard.inbox import run_choices
from dashboard.security import operator_required, rejects_bad_input
from evidence import locks, pglog
from evidence.models import (
    CaptureGap,
    CaptureGapHour,
    CaptureStats,
    EvidenceCopy,
    GapReason,
    IncidentSource,
    LockIncident,
    LockWait,
)
from runs.models import (
    ActionState,
    Checkpoint,
    CheckpointOutcome,
    EffectClass,
    EventKind,
    OutcomeKind,
    OutcomeState,
    Phase,
    Run,
    RunStatus,
    older_than,
    page_cursor,
)

PAGE_SIZE = 50
EVENTS_PAGE = 50
LOG_UPLOAD_LIMIT = 5 * 1024 * 1024


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
        "id",
        "question",
        "status",
        "phase",
        "lease_owner",
        "lease_epoch",
        "cancel_requested_by",
        "created_at",
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
    for run in page:
        run.status_label, run.phase_label = status_words(run), plain(Phase, run.phase)
    context = {
        "runs": page,
        "filters": filters,
        "statuses": [(value, plain(RunStatus, value)) for value in RunStatus.values],
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
    context = {"run": run, **_live(run), **_events(run, before), "plotly": True}
    if _partial(request, "run-live"):
        response = render(request, "run_detail.html#live", context)
        return response if run.is_active else HttpResponseStopPolling(response.content)
    return render(request, "run_detail.html", {**context, **run_choices(request, run)})


def _live(run: Run) -> dict[str, Any]:
    """What changes while a run is active, in an operator's words."""
    run.status_label, run.phase_label = status_words(run), plain(Phase, run.phase)
    revisions = list(run.revisions.order_by("number"))
    for revision in revisions:
        revision.html = _answer_html(revision.content)
    actions = list(run.actions.select_related("receipt").order_by("id"))
    for action in actions:
        action.state_label = plain(ActionState, action.state)
        action.class_label = plain(EffectClass, action.effect_class)
        action.kind_label = words(action.kind)
    items = list(run.outcome_items.select_related("action").order_by("id"))
    for item in items:
        item.kind_label = plain(OutcomeKind, item.kind)
        item.state_label = plain(OutcomeState, item.state)
        item.fields = evidence_fields(item.evidence)
    gaps = list(CaptureGap.objects.filter(run=run).order_by("id")[:50])
    for gap in gaps:
        gap.reason_label = plain(GapReason, gap.reason)
    checkpoints = checkpoint_rows(run.checkpoints.select_related("after_action").order_by("id"))
    return {
        "actions": actions,
        "checkpoints": checkpoints,
        "revisions": revisions,
        "items": items,
        "open_items": sum(item.state == OutcomeState.OPEN for item in items),
        "copies": EvidenceCopy.objects.filter(run=run).order_by("id")[:50],
        "gaps": gaps,
        "capture": CaptureStats.objects.filter(run=run).first(),
        "waits": LockWait.objects.filter(Q(waiter_run=run) | Q(blocker_run=run))
        .select_related("incident")
        .order_by("-first_seen")[:50],
        "faults": json.dumps(run.faults, indent=1) if run.faults else "",
        "timeline": json.loads(charts.timeline(run, actions, checkpoints)),
    }


@dataclass
class Step:
    """One thing that happened to a checkpoint: attempted, saved, settled."""

    at: dt.datetime | None
    what: str
    detail: str = ""


@dataclass
class CheckpointRow:
    """A checkpoint number of a run, with its final outcome and its history.

    The database keeps the saved state and the record of an attempt whose
    COMMIT got no answer (or that failed before writing) as separate rows
    under the same number; an operator sees one checkpoint."""

    number: int
    after: str
    outcome: str
    outcome_label: str
    xid: int | None
    at: dt.datetime
    history: list[Step] = field(default_factory=list)

    @property
    def summary(self) -> str:
        return "; ".join(
            f"{step.what}{': ' + step.detail if step.detail else ''}" for step in self.history
        )


def checkpoint_rows(records: Iterable[Checkpoint]) -> list[CheckpointRow]:
    """One row per checkpoint number.  Its outcome: unknown while any attempt
    is still unknown (an open item says so too); else written when a saved
    state exists (settled by evidence if an attempt needed settling); else
    the last attempt's outcome."""
    by_number: dict[int, list[Checkpoint]] = {}
    for record in records:
        by_number.setdefault(record.number, []).append(record)
    rows = []
    for number, group in sorted(by_number.items()):
        saved = next((r for r in group if r.state is not None), None)
        attempts = [r for r in group if r.state is None]
        outcomes = {r.outcome for r in attempts}
        if CheckpointOutcome.UNKNOWN in outcomes:
            outcome = CheckpointOutcome.UNKNOWN
        elif saved is not None:
            settled = CheckpointOutcome.RESOLVED_COMMITTED in outcomes
            outcome = CheckpointOutcome.RESOLVED_COMMITTED if settled else saved.outcome
        else:
            outcome = attempts[-1].outcome
        history = []
        for record in attempts:
            if record.outcome == CheckpointOutcome.FAILED_BEFORE_WRITE:
                history.append(Step(record.created_at, "failed before write", record.error))
                continue
            # Unknown first, whatever settled it since.
            history.append(Step(record.created_at, record.error or "COMMIT sent, no answer"))
            if record.resolved_at:
                history.append(Step(record.resolved_at, "settled", record.resolution))
        history.sort(key=lambda step: step.at)
        if saved is not None and attempts:  # alone, a saved state needs no history
            history.append(Step(None, "its saved state is readable"))
        rows.append(
            CheckpointRow(
                number=number,
                after=group[0].after_action.step_key,
                outcome=outcome,
                outcome_label=plain(CheckpointOutcome, outcome),
                xid=next((r.xid for r in group if r.xid is not None), None),
                at=min(r.created_at for r in group),
                history=history,
            )
        )
    return rows


def _events(run: Run, before: str) -> dict[str, Any]:
    """The event log, newest first, a page at a time from `before`
    (a page_cursor); BadRequest when `before` is not one."""
    events = run.events.select_related("action").order_by("-created_at", "-id")
    if before:
        events = _older_than(events, before)
    page = list(events[: EVENTS_PAGE + 1])
    more, page = len(page) > EVENTS_PAGE, page[:EVENTS_PAGE]
    for event in page:
        event.kind_label = plain(EventKind, event.kind)
    return {
        "run": run,
        "events": page,
        "events_cursor": page_cursor(page[-1]) if more else "",
    }


def _answer_html(content: str) -> SafeString:
    """Model output, rendered from markdown and sanitised: no script, no
    event handler attribute survives.  Drafts and the final answer alike."""
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
        "plotly": True,
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
    hourly = list(hours.order_by("hour").values_list("hour", "reason", "count"))
    by_reason = list(hours.values("reason").annotate(n=Sum("count")).order_by("-n"))
    for row in by_reason:
        row["label"] = plain(GapReason, row["reason"])
    by_run = list(
        CaptureStats.objects.filter(lost__gt=0).select_related("run").order_by("-lost")[:50]
    )
    for stats in by_run:
        stats.run.status_label = status_words(stats.run)
    latest = list(CaptureGap.objects.order_by("-created_at", "-id")[:50])
    for gap in latest:
        gap.reason_label = plain(GapReason, gap.reason)
    context = {
        "chart": json.loads(
            charts.gaps_over_time(
                (hour.isoformat(), plain(GapReason, reason), n) for hour, reason, n in hourly
            )
        )
        if hourly
        else None,
        "plotly": bool(hourly),
        "by_reason": by_reason,
        "by_run": by_run,
        "latest": latest,
        "since": since,
    }
    return render(request, "gaps.html", context)

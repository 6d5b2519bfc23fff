"""Operator pages.  Login is required everywhere (LoginRequiredMiddleware);
actions need the operate_run permission, checked here, in the view
(permission_required: a client can post to any URL, whatever the page
showed it).  A parameter a view cannot use answers 400 with what was wrong
(dashboard.params, security.rejects_bad_input), never a page that quietly
ignored it."""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import permission_required
from django.core.exceptions import BadRequest
from django.db.models import QuerySet, Sum
from django.http import FileResponse, Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.http import urlencode
from django.views.decorators.http import require_POST, require_safe
from django_htmx.http import HttpResponseStopPolling

from dashboard import params
from dashboard.htmx import HtmxHttpRequest, asks_for
from dashboard.inbox import run_choices
from dashboard.models import SavedView
from dashboard.run_page import CancelForm, run_now
from dashboard.security import form_lock_waits, rejects_bad_input, shown_unless_locked
from evidence import bundles, charts, locks, pglog, tasks
from evidence.models import (
    BundleExport,
    CaptureGap,
    CaptureGapHour,
    CaptureStats,
    GapReason,
    IncidentSource,
    LockIncident,
)
from evidence.run_facts import agent_words, run_facts
from runs import finding, selection
from runs.attention import needing_you, unblocking
from runs.decisions import OPERATE
from runs.models import Phase, Run, RunStatus, older_than, page_cursor
from runs.sql import unless_locked
from runs.tasks import hand_over
from runs.timeline import EventKind
from runs.words import WITH_GAPS, human_duration, plain, status_now, status_words

PAGE_SIZE = 50
# The runs list's status filter: each status and, after completed, the
# completed runs whose answer leaves work out (Run.objects.completed_with_gaps()).
STATUS_FILTER = [
    (value, WITH_GAPS if value == selection.GAPS_FILTER else plain(RunStatus, value))
    for value in selection.STATUS_VALUES
]
EVENTS_PAGE = 50
BUNDLES_SHOWN = 10
LOG_UPLOAD_LIMIT = 5 * 1024 * 1024
CANCEL_LOCK_WAIT = "5s"


def _older_than(rows: QuerySet, cursor: str) -> QuerySet:
    try:
        return older_than(rows, cursor)
    except ValueError as error:
        raise BadRequest(str(error)) from None


# -- what needs an operator --------------------------------------------------------


class SignIn(auth_views.LoginView):
    """Sign-in lands on "Needs you" (LOGIN_REDIRECT_URL), also when the
    sign-in was asked for the site's root: whoever types the address wants
    first what needs them.  Any other page asked for is returned to."""

    def get_redirect_url(self) -> str:
        asked = super().get_redirect_url()
        return "" if asked == "/" else asked


@require_safe
@rejects_bad_input
def needs_you(request: HtmxHttpRequest) -> HttpResponse:
    """What needs an operator now, each line linking to where it is acted
    on (runs.attention); the lines refresh every few seconds, always: new
    trouble may come at any time."""
    context = {"attention": needing_you(timezone.now())}
    if asks_for(request, "needs-you-lines"):
        return render(request, "needs_you.html#lines", context)
    return render(request, "needs_you.html", context)


# -- runs -------------------------------------------------------------------------


def listed_runs(request: HttpRequest) -> tuple[selection.RunFilter, QuerySet[Run]]:
    """The runs list's filters as its query string gives them, and the
    runs they select, from its cursor (`before`) on: the runs list's and
    the API's (dashboard/api).  BadRequest for a filter or cursor it
    cannot use.  Unordered: the caller picks its columns and its page.
    What it selects is runs/selection.py's: a bulk job acts on the same
    runs."""
    filters = selection.read(request.GET)
    runs = filters.select(Run.objects.listing())
    if cursor := request.GET.get("before"):
        runs = _older_than(runs, cursor)
    return filters, runs


def newest_first(rows: QuerySet, size: int) -> tuple[list[Any], str]:
    """A page of `rows`, newest first (created_at, id), and the cursor
    of the next page ("" when it is the last)."""
    page = list(rows.order_by("-created_at", "-id")[: size + 1])
    more, page = len(page) > size, page[:size]
    return page, page_cursor(page[-1]) if more and page else ""


@require_safe
@rejects_bad_input
def runs_list(request: HtmxHttpRequest) -> HttpResponse:
    filters = selection.read(request.GET)
    sort = params.choice(request, "sort", list(finding.SORTS)) or finding.NEWEST.name
    # The page is chosen first, its columns then worked out for its rows
    # alone (finding.in_page): in one query with the filters, PostgreSQL
    # plans the columns' subqueries for every row it estimates the filters
    # leave, and at a million runs hashes the whole actions table.
    columns = Run.objects.listing().only(
        "id",
        "agent",
        "question",
        "status",
        "phase",
        "imported_at",
        "origin_installation",
        "origin_run_id",
        "lease_owner",
        "lease_epoch",
        "lease_expires_at",
        "queued_at",
        "cancel_requested_by",
        "created_at",
        "started_at",
        "finished_at",
        "labels",
    )
    try:
        found, next_cursor = finding.page(
            filters.select(Run.objects.all()).only(*finding.SORT_COLUMNS),
            finding.SORTS[sort],
            request.GET.get("before", ""),
            PAGE_SIZE,
        )
    except ValueError as error:
        raise BadRequest(str(error)) from None
    page = finding.in_page(columns, found)
    now = timezone.now()
    for run in page:
        said = status_now(run, now)
        run.status_label, run.status_warning = said.words, said.warning
        run.phase_label = plain(Phase, run.phase)
    context = {
        "runs": page,
        "filters": filters,
        "statuses": STATUS_FILTER,
        # Installed here, and the one filtered on if it is no longer.
        "agents": sorted({*settings.RUNDESK_AGENTS, filters.agent} - {""}),
        "next_cursor": next_cursor,
        "sort": sort,
        "sorts": finding.SORTS.values(),
        "created_sort": "created" if sort == finding.NEWEST.name else "-created",
        "times": finding.TIMES,
        "saved_views": SavedView.objects.visible_to(request.user),
        "live": any(run.is_active for run in page),
        "now": now,
        "search_max": params.SEARCH_MAX,
    }
    if asks_for(request, "run-rows"):
        response = render(request, "runs_list.html#rows", context)
        return response if context["live"] else HttpResponseStopPolling(response.content)
    return render(request, "runs_list.html", context)


@require_safe
@rejects_bad_input
def run_detail(request: HttpRequest, run_id: int) -> HttpResponse:
    """The run page; its event log from `events_before` (a page_cursor) when
    given: the "load older events" link without htmx."""
    run = get_object_or_404(Run, pk=run_id)
    return _run_page(request, run)


def _run_page(
    request: HttpRequest, run: Run, cancel_form: CancelForm | None = None
) -> HttpResponse:
    """The whole run page; with a refused cancel's form (400), as it was sent."""
    context = {
        **_live(request, run, cancel_form),
        **_events(run, request.GET.get("events_before", "")),
        **_bundles(run, timezone.now()),
        "origin_signer": bundles.signer_of(run.origin_manifest) if run.is_imported else None,
        "plotly": True,
    }
    return render(request, "run_detail.html", context, status=200 if cancel_form is None else 400)


def _live(request: HttpRequest, run: Run, cancel_form: CancelForm | None = None) -> dict[str, Any]:
    """The run page's live region: the facts, what the run is doing now
    (a lease that expired, a queue nobody takes from, a cancel and what
    came of it), and for a run that waits for an operator the choices that
    let it go on, at its top (a decision returns to the run page, wherever
    the region was drawn from)."""
    return {
        **run_facts(run),
        **run_choices(request, run),
        # After the two above, which name the status without the time.
        **run_now(run, timezone.now(), cancel_form),
        "back": reverse("run-detail", args=[run.pk]),
        "unblocking": unblocking(run),
        "agent": agent_words(run),
    }


@require_safe
@rejects_bad_input
def run_live(request: HtmxHttpRequest, run_id: int) -> HttpResponse:
    """The run page's live region, which polls this while the run is active
    and is told to stop (286) once it is not."""
    run = get_object_or_404(Run, pk=run_id)
    if not request.htmx:
        return redirect("run-detail", run_id=run.pk)
    response = render(request, "run_detail.html#live", _live(request, run))
    return response if run.is_active else HttpResponseStopPolling(response.content)


@require_safe
@rejects_bad_input
def run_events(request: HtmxHttpRequest, run_id: int) -> HttpResponse:
    """A page of the run's event log, older than `before` (a page_cursor)."""
    run = get_object_or_404(Run, pk=run_id)
    before = request.GET.get("before", "")
    if not request.htmx:
        page = reverse("run-detail", args=[run.pk])
        return redirect(f"{page}?{urlencode({'events_before': before})}" if before else page)
    return render(request, "run_detail.html#events", _events(run, before))


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


@require_POST
@permission_required(OPERATE, raise_exception=True)
@rejects_bad_input
def run_cancel(request: HtmxHttpRequest, run_id: int) -> HttpResponse:
    """Cancels a run, with a reason and a confirmation (CancelForm).  A form
    without them changes nothing and comes back with what is missing, the
    reason typed kept."""
    with form_lock_waits():
        run = get_object_or_404(Run, pk=run_id)
    form = CancelForm(request.POST)
    if not form.is_valid():
        if request.htmx:
            # htmx swaps no 4xx answer: the region comes back as a 200, its
            # form saying what is missing; nothing was changed.
            return render(request, "run_detail.html#live", _live(request, run, form))
        return _run_page(request, run, cancel_form=form)
    by, reason = request.user.get_username(), form.cleaned_data["reason"]
    if run.is_imported:
        say, said = (
            messages.error,
            f"Run {run.pk} is imported and read-only: cancel it where it runs.",
        )
    # Its owner holds the run's row a statement at a time (milliseconds): a
    # longer wait is a stranger's lock, said instead of the request hanging.
    elif (
        asked := unless_locked(lambda: run.request_cancel(by=by, reason=reason), CANCEL_LOCK_WAIT)
    ) is None:
        say, said = (
            messages.error,
            f"Run {run.pk} is locked by another session (see the lock pages): the cancel "
            "was not asked; try again once it is free.",
        )
    elif asked:
        say, said = messages.success, f"Cancel requested for run {run.pk}."
    else:
        say, said = messages.info, f"Run {run.pk} had already ended or was being cancelled."
    if request.htmx:
        # Said in the region it replaces, not left for whatever page comes next.
        def live() -> HttpResponse:
            run.refresh_from_db()
            context = {**_live(request, run), "notice": said}
            return render(request, "run_detail.html#live", context)

        page = reverse("run-detail", args=[run.pk])
        return shown_unless_locked(request, live, page, lambda: say(request, said))
    say(request, said)
    return redirect("run-detail", run_id=run.pk)


# -- investigation bundles ----------------------------------------------------------


def _bundles(run: Run, now: dt.datetime) -> dict[str, Any]:
    """The run's latest bundle exports, for the run page's bundles region."""
    exports = list(BundleExport.objects.for_run(run)[:BUNDLES_SHOWN])
    for export in exports:
        export.downloadable = export.is_downloadable(now)
        # Lost (its task or worker): not waited for, and said so.
        export.lost = export.is_lost(now)
        export.signer = (
            bundles.signer_of(bundles.manifest_of(export.path)) if export.downloadable else None
        )
    return {
        "run": run,
        "bundles": exports,
        "bundles_active": any(export.is_active and not export.lost for export in exports),
    }


def _bundles_region(request: HttpRequest, run: Run) -> HttpResponse:
    context = _bundles(run, timezone.now())
    response = render(request, "run_detail.html#bundles", context)
    return response if context["bundles_active"] else HttpResponseStopPolling(response.content)


@require_POST
@permission_required(OPERATE, raise_exception=True)
@rejects_bad_input
def run_bundle(request: HtmxHttpRequest, run_id: int) -> HttpResponse:
    """Queues an export of the run's bundle; a worker writes it."""
    leave_evidence_out = request.POST.get("no_evidence", "")
    if leave_evidence_out not in ("", "1"):
        raise BadRequest(f"no_evidence={leave_evidence_out!r} is not 1 (or absent)")
    with form_lock_waits():
        run = get_object_or_404(Run.objects.local(), pk=run_id)  # an import is not re-sealed
        export = BundleExport.objects.create(
            run=run,
            requested_by=request.user.get_username(),
            include_evidence=not leave_evidence_out,
        )
    if refused := hand_over(tasks.export_bundle, export.pk):
        # No worker will write it: said on its row, not left "waiting".
        export.fail(f"could not be handed to a worker ({refused})", timezone.now())
    if refused:
        say, said = messages.error, f"Bundle export {export.pk} failed: no worker could be asked."
    else:
        say, said = messages.success, f"Bundle export {export.pk} of run {run.pk} queued."
    page = reverse("run-detail", args=[run.pk]) + "#run-bundles"
    if request.htmx:
        return shown_unless_locked(
            request,
            lambda: render(request, "run_detail.html#bundles", _bundles(run, timezone.now())),
            page,
            lambda: say(request, said),
        )
    say(request, said)
    return redirect(page)


@require_safe
@rejects_bad_input
def run_bundles(request: HtmxHttpRequest, run_id: int) -> HttpResponse:
    """The bundles region, which polls this while an export is queued or
    running and is told to stop (286) once none is."""
    run = get_object_or_404(Run, pk=run_id)
    if not request.htmx:
        return redirect(reverse("run-detail", args=[run.pk]) + "#run-bundles")
    return _bundles_region(request, run)


@require_safe
@permission_required(OPERATE, raise_exception=True)
@rejects_bad_input
def bundle_download(request: HttpRequest, export_id: int) -> FileResponse:
    """Operators only: a bundle may hold copies of model calls (model inputs and
    outputs), which viewers may read on the pages but not carry away."""
    export = get_object_or_404(BundleExport, pk=export_id)
    if not export.is_downloadable(timezone.now()):
        raise Http404("This bundle is not ready, or it expired and its file was removed.")
    try:
        # Open now: the file stays readable if it is removed while streamed.
        file = export.path.open("rb")
    except FileNotFoundError:
        raise Http404("This bundle's file is missing.") from None
    return FileResponse(
        file, as_attachment=True, filename=export.download_name, content_type="application/zip"
    )


# -- locks ------------------------------------------------------------------------


# Where an incident was seen: this installation's server, or another's
# (opened with the bundle of one of its runs).
INCIDENT_ORIGINS = {"here": "this installation", "imported": "imported with a run's bundle"}


def _incidents() -> QuerySet[LockIncident]:
    """Incidents with what their pages say of an imported one's run."""
    return LockIncident.objects.select_related("imported_run").defer(
        "imported_run__question", "imported_run__origin_manifest", "imported_run__faults"
    )


@require_safe
@rejects_bad_input
def locks_list(request: HttpRequest) -> HttpResponse:
    incidents = _incidents().order_by("-started_at", "-id")
    source = params.choice(request, "source", IncidentSource.values)
    if source:
        incidents = incidents.filter(source=source)
    origin = params.choice(request, "origin", list(INCIDENT_ORIGINS))
    if origin == "here":
        incidents = incidents.local()
    elif origin == "imported":
        incidents = incidents.imported()
    now = timezone.now()
    shown = list(incidents.prefetch_related("waits")[:100])
    for incident in shown:
        incident.said = locks.incident_words(incident, now)
    context = {
        "incidents": shown,
        "source": source,
        "sources": IncidentSource.choices,
        "origin": origin,
        "origins": INCIDENT_ORIGINS.items(),
        "formats": pglog.FORMATS,
        "upload_limit_mb": LOG_UPLOAD_LIMIT // (1024 * 1024),
    }
    return render(request, "locks.html", context)


@require_safe
@rejects_bad_input
def lock_detail(request: HttpRequest, incident_id: int) -> HttpResponse:
    incident = get_object_or_404(_incidents(), pk=incident_id)
    waits = list(incident.waits.order_by("id"))
    for wait in waits:
        wait.waited = human_duration(wait.waited_ms / 1000)
    context = {
        "incident": incident,
        "said": locks.incident_words(incident, timezone.now()),
        "waits": [wait for wait in waits if not wait.lead_up],
        "lead_up": [wait for wait in waits if wait.lead_up],
        "graph": charts.lock_graph(incident),
        "victim": locks.victim_of(incident),
        "plotly": True,
    }
    return render(request, "lock_detail.html", context)


@require_POST
@permission_required(OPERATE, raise_exception=True)
@rejects_bad_input
def locks_import(request: HttpRequest) -> HttpResponse:
    log_format = request.POST.get("format") or "auto"
    if log_format not in pglog.FORMATS:
        raise BadRequest(f"format={log_format!r} is not one of: {', '.join(pglog.FORMATS)}")
    upload = request.FILES.get("log")
    if upload is None:
        messages.error(request, "Choose a PostgreSQL log file to import.")
        return redirect("locks")
    if upload.size > LOG_UPLOAD_LIMIT:
        messages.error(
            request, f"{upload.name} is {upload.size} bytes; the limit is {LOG_UPLOAD_LIMIT}."
        )
        return redirect("locks")
    try:
        # Decompressed, no more than the limit either: a small .gz can
        # hold gigabytes, each read while the page waits.
        zone = pglog.log_timezone(request.POST.get("log_timezone", ""))
        encoding = request.POST.get("encoding", "").strip() or "utf-8"
        text, warning = pglog.decode(upload.read(), encoding, limit=LOG_UPLOAD_LIMIT)
        reports = pglog.parse(text, log_format, zone)
        with form_lock_waits():
            imported = pglog.store(reports, upload.name)
    except pglog.LogFormatError as error:
        larger = " (a larger log: manage.py import_pg_log)" if "decompressed" in str(error) else ""
        messages.error(request, f"{upload.name}: {error}{larger}. Nothing was imported.")
        return redirect("locks")
    if warning:
        messages.warning(request, f"{upload.name}: {warning}.")
    if not reports:
        messages.error(request, f"No 'deadlock detected' report found in {upload.name}.")
        return redirect("locks")
    said = [f"{len(imported)} deadlock reports imported from {upload.name}."]
    if partial := sum(bool(incident.unread) for _, incident in imported):
        said.append(f"{partial} could not be read in full: their pages say what is missing.")
    if before := len(reports) - len(imported):
        said.append(pglog.imported_before(before))
    messages.success(request, " ".join(said))
    return redirect("locks")


# -- capture gaps -----------------------------------------------------------------


@require_safe
@rejects_bad_input
def gaps(request: HttpRequest) -> HttpResponse:
    """Read from the hourly and per-run counters capture keeps, so the page
    costs the same however many gaps there are."""
    since = timezone.now() - dt.timedelta(days=7)
    # An hour whose gaps were all saved later (evidence/retries.py) lost nothing.
    hours = CaptureGapHour.objects.filter(hour__gte=since, count__gt=0)
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
        "chart": charts.gaps_over_time(
            (hour.isoformat(), plain(GapReason, reason), n) for hour, reason, n in hourly
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

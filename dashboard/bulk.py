"""Bulk actions' pages (HTTP only; the rules are runs/bulk.py's): the dry
run of an action on the runs a runs-list filter (or a list of ids)
selects, its confirmation with a reason, the job's progress (live until
it ends) with a stop button, and the jobs done before.  Viewers read every
page; confirming and stopping need the operator permission, checked here
(permission_required: a client can post to any URL)."""

from __future__ import annotations

import uuid
from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import permission_required
from django.core.exceptions import BadRequest
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST, require_safe
from django_htmx.http import HttpResponseStopPolling

from dashboard.htmx import HtmxHttpRequest
from dashboard.security import form_lock_waits, rejects_bad_input
from runs import tasks
from runs.bulk import (
    ITEM_CHOICES,
    TOKEN_MAX,
    Ask,
    BulkAction,
    BulkJob,
    DryRun,
    ItemResult,
    Refused,
    Selection,
    cap,
    create_job,
    dry_run,
)
from runs.decisions import OPERATE, REASON_MAX
from runs.models import DecisionChoice, OutcomeKind
from runs.tasks import hand_over
from runs.words import plain, status_words

JOBS_SHOWN = 50


class AskForm(forms.Form):
    """What a dry run is asked: the action, and the runs: a runs-list
    filter (its query string) or ids."""

    action = forms.ChoiceField(choices=BulkAction.choices, required=False)
    choice = forms.ChoiceField(
        choices=[("", "—"), *[(c, DecisionChoice(c).label) for c in ITEM_CHOICES]],
        required=False,
    )
    kind = forms.ChoiceField(
        choices=[("", "—"), *[(k, plain(OutcomeKind, k)) for k in OutcomeKind.values]],
        required=False,
    )
    filter = forms.CharField(required=False, max_length=2000)
    ids = forms.CharField(required=False, max_length=100_000)

    def selection(self) -> Selection:
        data = self.cleaned_data
        if data["ids"]:
            return Selection.by_ids(data["ids"])
        return Selection.by_filter(data["filter"])

    def ask(self) -> Ask | None:
        data = self.cleaned_data
        if not data["action"]:
            return None
        if data["action"] != BulkAction.DECIDE:
            return Ask(data["action"])
        return Ask(data["action"], data["choice"], data["kind"])


class ConfirmForm(AskForm):
    """The confirmation: the runs the dry run said would change, why, and
    a request token (the same one twice makes one job)."""

    shown = forms.CharField(max_length=100_000)
    reason = forms.CharField(
        max_length=REASON_MAX,
        strip=True,
        error_messages={"required": "Say why: the reason is kept with every run's change."},
        widget=forms.Textarea(attrs={"rows": 2, "maxlength": REASON_MAX}),
    )
    token = forms.CharField(max_length=TOKEN_MAX)

    def run_ids(self) -> list[int]:
        return list(Selection.by_ids(self.cleaned_data["shown"]).ids)


def _asked(data: Any, form_class: type[AskForm] = AskForm) -> AskForm:
    form = form_class(data)
    if not form.is_valid() and any(name != "reason" for name in form.errors):
        problems = "; ".join(
            f"{name}: {' '.join(errors)}"
            for name, errors in form.errors.items()
            if name != "reason"
        )
        raise BadRequest(problems)
    return form


@require_safe
@rejects_bad_input
def bulk_dry_run(request: HttpRequest) -> HttpResponse:
    """The dry run: what the action would change on each run, and what it
    would refuse, and why; nothing is written.  Without an action, the
    form that chooses one."""
    form = _asked(request.GET)
    return _dry_run_page(request, form, ConfirmForm(initial={"token": uuid.uuid4().hex}))


def _dry_run_page(
    request: HttpRequest, form: AskForm, confirm: ConfirmForm, status: int = 200
) -> HttpResponse:
    try:
        chosen = form.selection()
        ask = form.ask()
        planned: DryRun | None = dry_run(chosen, ask) if ask is not None else None
    except Refused as refused:
        raise BadRequest(str(refused)) from None
    for plan in planned.plans if planned else []:
        plan.run.status_label = status_words(plan.run)
    context = {
        "form": form,
        "chosen": chosen,
        "ask": ask,
        "planned": planned,
        "confirm": confirm,
        "runs_list": reverse("runs-list") + (f"?{chosen.query}" if chosen.query else ""),
        "can_act": request.user.has_perm(OPERATE),
    }
    return render(request, "bulk_dry_run.html", context, status=status)


@require_POST
@permission_required(OPERATE, raise_exception=True)
@rejects_bad_input
def bulk_confirm(request: HttpRequest) -> HttpResponse:
    """Makes the job for the runs the dry run said would change, and hands
    it to a worker; the same request token again shows the same job."""
    form = _asked(request.POST, ConfirmForm)
    if not form.is_valid():  # only the reason is missing: said on the page, as it was
        return _dry_run_page(request, form, form, status=400)
    ask = form.ask()
    if ask is None:
        raise BadRequest("action: choose one")
    try:
        with form_lock_waits():
            created = create_job(
                ask,
                form.selection(),
                form.run_ids(),
                user=request.user,
                reason=form.cleaned_data["reason"],
                token=form.cleaned_data["token"],
            )
    except Refused as refused:
        form.add_error(None, f"Nothing was started: {refused}.")
        return _dry_run_page(request, form, form, status=400)
    job = created.job
    if created.repeated:
        messages.info(request, f"Bulk job {job.pk} was already started with this form.")
    elif refused := hand_over(tasks.bulk_job, job.pk):
        # Queued: beat hands it out again once it is seen to stall.
        messages.warning(
            request,
            f"Bulk job {job.pk} is recorded but no worker could be asked yet ({refused}): "
            "it is handed out again within a minute.",
        )
    else:
        messages.success(request, f"Bulk job {job.pk} started: {job.total} runs.")
    return redirect("bulk-job", job_id=job.pk)


def _progress(job: BulkJob) -> dict[str, Any]:
    items = list(job.items.select_related("run").order_by("id"))
    for item in items:
        item.result_label = ItemResult(item.result).label
        item.run.status_label = status_words(item.run)
    counts = job.counts()
    return {
        "job": job,
        "ask_words": job.ask.words(),
        "counts": counts,
        "finished": job.total - counts[ItemResult.PENDING],
        "items": items,
        "runs_list": reverse("runs-list") + (f"?{job.filter_query}" if job.filter_query else ""),
    }


@require_safe
@rejects_bad_input
def bulk_job(request: HttpRequest, job_id: int) -> HttpResponse:
    job = get_object_or_404(BulkJob, pk=job_id)
    return render(request, "bulk_job.html", _progress(job))


@require_safe
@rejects_bad_input
def bulk_progress(request: HtmxHttpRequest, job_id: int) -> HttpResponse:
    """The progress region, which polls this until the job ends (286)."""
    job = get_object_or_404(BulkJob, pk=job_id)
    if not request.htmx:
        return redirect("bulk-job", job_id=job.pk)
    response = render(request, "bulk_job.html#progress", _progress(job))
    return HttpResponseStopPolling(response.content) if job.is_finished else response


def stop(job_id: int, user: Any) -> tuple[BulkJob, int, str]:
    """Stops job `job_id` for `user` (the page's button, the API's stop):
    the job as it is now, how many runs this stop left not done, and what
    became of the stop, said."""
    by = user.get_username()
    with form_lock_waits():
        job = get_object_or_404(BulkJob, pk=job_id)
        stopped = job.request_stop(by)
    job.refresh_from_db()
    if job.stop_requested_by == by and stopped:
        said = f"Bulk job {job.pk} stopped: {stopped} runs not done."
    elif job.stop_requested_at is not None:
        said = f"Bulk job {job.pk} was stopped by {job.stop_requested_by}."
    else:
        said = f"Bulk job {job.pk} had ended: nothing to stop."
    return job, stopped, said


@require_POST
@permission_required(OPERATE, raise_exception=True)
@rejects_bad_input
def bulk_stop(request: HtmxHttpRequest, job_id: int) -> HttpResponse:
    job, _, said = stop(job_id, request.user)
    if request.htmx:
        return render(request, "bulk_job.html#progress", {**_progress(job), "notice": said})
    messages.info(request, said)
    return redirect("bulk-job", job_id=job.pk)


@require_safe
@rejects_bad_input
def bulk_selects(request: HttpRequest) -> HttpResponse:
    """The runs list's "Act on these N runs", counted apart from the page
    (htmx loads it) and up to one past the cap: the list's own time stays
    its own, and a filter of millions costs no more than a thousand."""
    try:
        chosen = Selection.by_filter(request.GET.get("filter", ""))
    except Refused as refused:
        raise BadRequest(str(refused)) from None
    most = cap()
    context = {
        "filters": chosen.run_filter,
        "bulk_selects": chosen.runs().values("pk")[: most + 1].count(),
        "bulk_max": most,
    }
    return render(request, "runs_list.html#bulk-act", context)


@require_safe
@rejects_bad_input
def bulk_jobs(request: HttpRequest) -> HttpResponse:
    """The jobs made before, newest first, with their results counted."""
    jobs = list(BulkJob.objects.with_counts().order_by("-created_at", "-id")[:JOBS_SHOWN])
    return render(request, "bulk_jobs.html", {"jobs": jobs})

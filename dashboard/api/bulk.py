"""The API's bulk jobs (runs/bulk.py's rules, the bulk pages' paths): the
dry run of an action on the runs a runs-list filter (or a list of ids)
selects, the job confirmed with a reason and a request token and handed
to a Celery worker, the jobs (newest first, keyset pages), one job with
its per-run results a page at a time, and its stop.

As on the pages, a dry run writes nothing and anyone signed in may ask
for one (the dry-run page is a viewer's too); confirming and stopping
need the operator permission."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from django.shortcuts import get_object_or_404
from django.urls import reverse
from ninja import Query, Router, Status

from dashboard.api.auth import operating
from dashboard.api.errors import ACT, READ, ApiError
from dashboard.api.schemas import (
    BulkConfirmIn,
    BulkIn,
    BulkJobOut,
    BulkJobPage,
    BulkResults,
    BulkStartedOut,
    BulkStoppedOut,
    DryRunOut,
    Paged,
)
from dashboard.bulk import stop
from dashboard.models import ApiBulkRequest, TokenReused
from dashboard.security import form_lock_waits
from dashboard.views import newest_first
from runs import tasks
from runs.bulk import Ask, BulkJob, Created, ItemResult, Refused, Selection, dry_run
from runs.handover import hand_over
from runs.models import older_than

router = Router(tags=["bulk"])


def _asked(payload: BulkIn) -> tuple[Selection, Ask]:
    """The runs and the action asked; 400, naming the field, for a filter
    the runs list cannot read, ids that are none, or an action missing
    its choice and kind (or given one it takes none of)."""
    try:
        if payload.ids is not None:
            chosen = Selection.by_ids(",".join(map(str, payload.ids)))
        else:
            chosen = Selection.by_filter(payload.filter or "")
    except Refused as refused:
        raise ApiError(400, str(refused), field="ids" if payload.ids else "filter") from None
    ask = Ask(payload.action, payload.choice or "", payload.kind or "")
    try:
        ask.check()
    except Refused as refused:
        raise ApiError(400, str(refused), field="action") from None
    return chosen, ask


@router.post("/bulk/dry-run/", response={200: DryRunOut, **READ}, summary="Dry-run a bulk action")
def dry_run_bulk(request: HttpRequest, payload: BulkIn) -> dict[str, Any]:
    """What the action would do to each run selected, worked out now, and
    nothing written: per run what would change and what would be refused,
    and why; `refused` says why the whole selection is (more runs than the
    cap, ids of no run, none selected).  The dry-run page's, a viewer's too."""
    chosen, ask = _asked(payload)
    return dry_run(chosen, ask).json()


@router.post(
    "/bulk/", response={201: BulkStartedOut, 200: BulkStartedOut, **ACT}, summary="Start a bulk job"
)
def start_bulk(request: HttpRequest, payload: BulkConfirmIn) -> Status:
    """Confirms a dry run: makes the job for the runs it says would change
    now (those it refuses are left alone), with the reason, and hands it to
    a Celery worker, as the confirm page does.  The same request token
    again answers the job it made (200, `repeated`); the token with another
    request is refused (409), as is a selection the dry run refuses whole
    or on which nothing would change."""
    operating(request)
    chosen, ask = _asked(payload)
    asked = payload.model_dump(mode="json", exclude={"request_token"})
    token = payload.request_token
    try:
        with form_lock_waits():
            earlier = ApiBulkRequest.objects.earlier(request.user, token, asked)
        if earlier is not None:
            created = Created(earlier, repeated=True)
        else:
            # Outside a transaction: a decision's evidence is gathered anew
            # (a receiver may be asked), as the dry-run page gathers it.
            planned = dry_run(chosen, ask)
            with form_lock_waits():
                created = ApiBulkRequest.objects.start(
                    request.user, token, asked, planned, payload.reason
                )
    except TokenReused as reused:
        raise ApiError(409, str(reused), field="request_token") from None
    except Refused as refused:
        raise ApiError(409, f"nothing was started: {refused}", code="refused") from None
    # After the commit: a worker that takes it finds its rows.  A broker
    # that does not answer loses nothing: beat hands it out within a minute.
    failed = "" if created.repeated else hand_over(tasks.bulk_job, created.job.pk)
    return Status(
        200 if created.repeated else 201,
        {
            "job": job_out(created.job, BulkResults()),
            "repeated": created.repeated,
            "handover": failed or None,
        },
    )


def job_row(job: BulkJob, counts: dict[str, int]) -> dict[str, Any]:
    return {
        "id": job.pk,
        "action": job.action,
        "choice": job.choice,
        "kind": job.kind,
        "asks": job.ask.words(),
        "filter": job.filter_query or None,
        "requested_by": job.requested_by,
        "reason": job.reason,
        "state": job.state,
        "total": job.total,
        "counts": counts,
        "stop_requested_by": job.stop_requested_by,
        "stop_requested_at": job.stop_requested_at,
        "created_at": job.created_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "page": reverse("bulk-job", args=[job.pk]),
    }


def job_out(job: BulkJob, page: BulkResults) -> dict[str, Any]:
    """The job with a page of its per-run results, in the order it takes
    the runs (by item id, from `page.after` on)."""
    if page.result and page.result not in ItemResult.values:
        raise ApiError(400, f"result must be one of {', '.join(ItemResult.values)}", field="result")
    items = job.items.select_related("run").filter(pk__gt=page.after).order_by("id")
    if page.result:
        items = items.filter(result=page.result)
    shown = list(items[: page.limit + 1])
    more, shown = len(shown) > page.limit, shown[: page.limit]
    return {
        **job_row(job, job.counts()),
        "results": [
            {
                "id": item.pk,
                "run_id": item.run_id,
                "run_status": item.run.status,
                "result": item.result,
                "detail": item.detail,
                "decisions": item.decisions,
                "finished_at": item.finished_at,
            }
            for item in shown
        ],
        "next_after": shown[-1].pk if more else None,
    }


@router.get("/bulk/", response={200: BulkJobPage, **READ}, summary="List bulk jobs")
def list_bulk_jobs(request: HttpRequest, page: Query[Paged]) -> dict[str, Any]:
    """Bulk jobs, newest first, a page at a time, each with its results
    counted; `next_cursor` (as `before`) reads the next page."""
    jobs = BulkJob.objects.with_counts()
    if page.before:
        try:
            jobs = older_than(jobs, page.before)
        except ValueError as error:
            raise ApiError(400, str(error), field="before") from None
    shown, cursor = newest_first(jobs, page.limit)
    return {
        "jobs": [
            job_row(job, {result: getattr(job, f"n_{result}") for result in ItemResult.values})
            for job in shown
        ],
        "next_cursor": cursor or None,
    }


@router.get("/bulk/{job_id}/", response={200: BulkJobOut, **READ}, summary="Follow a bulk job")
def read_bulk_job(request: HttpRequest, job_id: int, page: Query[BulkResults]) -> dict[str, Any]:
    """A job: its state, its results counted, and its per-run results (done:
    what changed; refused: why; stopped: by whom), a page at a time
    (`next_after`, as `after`); `result` shows one kind of result only.
    Poll it until `state` is done or stopped."""
    return job_out(get_object_or_404(BulkJob, pk=job_id), page)


@router.post(
    "/bulk/{job_id}/stop/", response={200: BulkStoppedOut, **ACT}, summary="Stop a bulk job"
)
def stop_bulk_job(request: HttpRequest, job_id: int) -> dict[str, Any]:
    """Stops the job, as the page's button does: every run not yet taken is
    "not done: stopped by" its operator; the run a worker is carrying out
    finishes.  A job that ended, or was stopped before, is left as it is
    (`stopped` 0, `said` says so)."""
    operating(request)
    job, stopped, said = stop(job_id, request.user)
    return {"job": job_out(job, BulkResults()), "stopped": stopped, "said": said}

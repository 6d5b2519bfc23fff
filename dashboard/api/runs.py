"""The API's runs: the list (the runs list page's filters, keyset pages),
one run with its actions, receipts and items, a submission."""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.db.models import Count, Max
from django.http import HttpRequest
from django.shortcuts import get_object_or_404
from django.utils import timezone
from ninja import Query, Router, Status

from dashboard.api.auth import operating
from dashboard.api.errors import ACT, READ, ApiError
from dashboard.api.schemas import RunFilters, RunOut, RunPage, SubmitIn, SubmittedOut
from dashboard.models import ApiSubmission, Submitted, TokenReused
from dashboard.security import form_lock_waits
from dashboard.views import listed_runs, newest_first
from runs.decisions import run_offers
from runs.handover import hand_over_run
from runs.inbox import items_listed, listing_row
from runs.management.commands.outcomes import offer_json
from runs.models import OutcomeItem, Run
from runs.submission import SubmissionRefused, submit
from runs.words import status_now

router = Router(tags=["runs"])


def run_row(run: Run, now: dt.datetime) -> dict[str, Any]:
    return {
        "id": run.pk,
        "agent": run.agent,
        "agent_version": run.agent_version,
        "question": run.question,
        "status": run.status,
        "status_words": status_now(run, now).words,
        "phase": run.phase,
        "is_drill": run.is_drill,
        "imported": run.is_imported,
        "created_at": run.created_at,
        "started_at": run.started_at,
        "finished_at": run.finished_at,
        "actions_done": run.actions_done,
        "open_items": run.unknown_open,
        "capture_gaps": run.gaps,
        "completed_with_gaps": run.with_gaps,
    }


@router.get("/runs/", response={200: RunPage, **READ}, summary="List runs")
def list_runs(request: HttpRequest, filters: Query[RunFilters]) -> dict[str, Any]:
    """Runs newest first, a page at a time, with the runs list page's
    filters; `next_cursor` (as `before`) reads the next page."""
    # The filters are read by the page's own code, from the query string:
    # declared above for the document and for `limit`'s bounds.
    _, runs = listed_runs(request)
    page, cursor = newest_first(runs, filters.limit)
    now = timezone.now()
    return {"runs": [run_row(run, now) for run in page], "next_cursor": cursor or None}


def run_out(run_id: int) -> dict[str, Any]:
    run = get_object_or_404(Run.objects.listing(), pk=run_id)
    now = timezone.now()
    actions = list(run.actions.select_related("receipt").order_by("id"))
    receipts = run.receipts.aggregate(count=Count("*"), last_at=Max("created_at"))
    answer = run.revisions.order_by("-number").first()
    items = items_listed(OutcomeItem.objects.filter(run=run)).order_by("created_at", "id")
    return {
        **run_row(run, now),
        "status_reason": run.status_reason,
        "phase_reason": run.phase_reason,
        "input": run.input,
        "action_budget": run.action_budget,
        "deadline": run.deadline,
        "cancel_requested_by": run.cancel_requested_by,
        "offers": [offer_json(offer) for offer in run_offers(run)],
        "answer": None
        if answer is None
        else {
            "number": answer.number,
            "content": answer.content,
            "is_final": answer.is_final,
            "committed_at": answer.committed_at,
        },
        "actions": [
            {
                "id": action.pk,
                "step_key": action.step_key,
                "identity": action.identity,
                "kind": action.kind,
                "effect_class": action.effect_class,
                "state": action.state,
                "attempts": action.attempts,
                "epoch": action.epoch,
                "dispatched_at": action.dispatched_at,
                "finished_at": action.finished_at,
                "error": action.error,
                "receipt": _receipt(action),
            }
            for action in actions
        ],
        "receipts": {
            **receipts,
            "actions_without_receipt": sum(_receipt(action) is None for action in actions),
        },
        "items": [listing_row(item, now) for item in items],
    }


def _receipt(action: Any) -> dict[str, Any] | None:
    receipt = getattr(action, "receipt", None)
    if receipt is None:
        return None
    return {
        "result_digest": receipt.result_digest,
        "epoch": receipt.epoch,
        "created_at": receipt.created_at,
    }


@router.get("/runs/{run_id}/", response={200: RunOut, **READ}, summary="Read a run")
def read_run(request: HttpRequest, run_id: int) -> dict[str, Any]:
    """A run with its actions (each with its receipt), a summary of its
    receipts, its latest answer, its outcome items, and the decisions on
    the run itself (resume, abandon) offered now."""
    return run_out(run_id)


@router.post("/runs/", response={201: SubmittedOut, 200: SubmittedOut, **ACT}, summary="Submit")
def submit_run(request: HttpRequest, payload: SubmitIn) -> Status:
    """Queues a run of an installed agent, with the checks `submit_run`
    makes (a bad input is refused, its field named, nothing queued).  The
    same request token again answers the run it queued (200, `repeated`)."""
    operating(request)
    asked = payload.dict(exclude={"request_token"})
    try:
        with form_lock_waits():
            submitted: Submitted = ApiSubmission.objects.submitted(
                request.user,
                payload.request_token,
                {**asked, "deadline": payload.deadline and payload.deadline.isoformat()},
                lambda: submit(
                    payload.agent,
                    payload.input,
                    action_budget=payload.action_budget,
                    deadline=payload.deadline,
                ),
            )
    except SubmissionRefused as refused:
        raise ApiError(400, str(refused), field=refused.field) from None
    except TokenReused as reused:
        raise ApiError(409, str(reused), field="request_token") from None
    if not submitted.repeated:
        # After the commit: a worker that takes it finds its rows.  A broker
        # that does not answer loses nothing: the sweep hands it out later.
        hand_over_run(submitted.run.pk, submitted.run.is_drill)
    return Status(
        200 if submitted.repeated else 201,
        {"run": run_out(submitted.run.pk), "repeated": submitted.repeated},
    )

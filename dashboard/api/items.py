"""The API's outcome items and decisions: the inbox's filters, an item
with the choices its evidence allows now (runs.decisions `gather`,
`offers`) and its decisions, and a decision on an item or a run, taken by
the inbox's path (`decide`, `decide_run`: who may, idempotency by request
token, one decision settles an item, lock waits bounded)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.http import HttpRequest
from django.shortcuts import get_object_or_404
from django.utils import timezone
from ninja import Query, Router

from dashboard.api.auth import operating
from dashboard.api.errors import ACT, READ, ApiError
from dashboard.api.schemas import DecidedOut, DecideIn, ItemFilters, ItemOut, ItemPage
from dashboard.inbox import filtered_items, item_filters
from dashboard.params import choice
from dashboard.security import form_lock_waits
from dashboard.views import newest_first
from runs.decisions import (
    Decided,
    DecisionRefused,
    Request,
    Who,
    decide,
    decide_run,
    gather,
    offers,
)
from runs.inbox import history, items_listed, listing_row
from runs.management.commands.outcomes import decision_json, offer_json
from runs.models import OutcomeItem, OutcomeState, Run, older_than
from runs.sql import lock_refused

router = Router(tags=["items"])


@router.get("/items/", response={200: ItemPage, **READ}, summary="List outcome items")
def list_items(request: HttpRequest, filters: Query[ItemFilters]) -> dict[str, Any]:
    """Outcome items, open and resolved, newest first, a page at a time,
    with the inbox's filters (kind, run) and the state."""
    items = filtered_items(OutcomeItem.objects.all(), item_filters(request))
    if state := choice(request, "state", OutcomeState.values):
        items = items.filter(state=state)
    if filters.before:
        try:
            items = older_than(items, filters.before)
        except ValueError as error:
            raise ApiError(400, str(error), field="before") from None
    page, cursor = newest_first(items_listed(items), filters.limit)
    now = timezone.now()
    return {"items": [listing_row(item, now) for item in page], "next_cursor": cursor or None}


@router.get("/items/{item_id}/", response={200: ItemOut, **READ}, summary="Read an item")
def read_item(request: HttpRequest, item_id: int) -> dict[str, Any]:
    """An item with its evidence gathered now, the choices that evidence
    allows (what each does), and the decisions taken on it."""
    item = get_object_or_404(items_listed(OutcomeItem.objects.all()), pk=item_id)
    shown = gather(item)  # fresh: the xid's status and the probe are asked again
    return {
        **listing_row(item, timezone.now()),
        "evidence": shown,
        "offers": [offer_json(offer) for offer in offers(item, shown)],
        "decisions": [decision_json(decision) for decision in history(item.decisions.all())],
    }


def decided(decision: Decided) -> dict[str, Any]:
    return {
        "decision": decision_json(decision.decision),
        "repeated": decision.repeated,
        "run_resumed": decision.run_resumed,
    }


def refused(refusal: DecisionRefused) -> ApiError:
    """A decision refused: a stranger's lock (503), the decision that
    stands when another settled the item first or took the token (409),
    or what the rules or the evidence do not allow now (409)."""
    if refusal.__cause__ is not None and lock_refused(refusal.__cause__):
        return ApiError(503, str(refusal))
    stands = refusal.decision.pk if refusal.decision is not None else None
    return ApiError(409, f"not decided: {refusal}", decision=stands, code="refused")


@router.post(
    "/items/{item_id}/decide/", response={200: DecidedOut, **ACT}, summary="Decide an item"
)
def decide_item(request: HttpRequest, item_id: int, payload: DecideIn) -> dict[str, Any]:
    """Takes one of the offered choices, with a reason, as the inbox's form
    does.  The same request token again answers the decision it took
    (`repeated`); a decision another took first is refused (409) and named."""
    operating(request)
    with form_lock_waits():
        item = get_object_or_404(OutcomeItem, pk=item_id)
    return _taken(request, payload, lambda asked: decide(item.pk, asked))


@router.post("/runs/{run_id}/decide/", response={200: DecidedOut, **ACT}, summary="Decide a run")
def decide_a_run(request: HttpRequest, run_id: int, payload: DecideIn) -> dict[str, Any]:
    """Resumes or abandons a run that waits for an operator, as the run
    page's form does (`decide_run`): `resume` only when no open item holds
    it, `abandon` always; a run's choices are in its page's words in
    `outcomes --help`."""
    operating(request)
    with form_lock_waits():
        run = get_object_or_404(Run, pk=run_id)
    return _taken(request, payload, lambda asked: decide_run(run.pk, asked))


def _taken(
    request: HttpRequest, payload: DecideIn, take: Callable[[Request], Decided]
) -> dict[str, Any]:
    asked = Request(
        choice=payload.choice,
        who=Who(user=request.user),
        token=payload.request_token,
        reason=payload.reason,
        reference=payload.reference,
    )
    try:
        return decided(take(asked))
    except DecisionRefused as refusal:
        raise refused(refusal) from None

"""The operators' inbox: what the runtime could not settle itself, the
evidence for each item, and the decisions on it.

Pages do HTTP only.  What is shown comes from runs.decisions (`gather`, the
evidence, fresh on every load; `offers` and `run_offers`, the choices the
evidence allows), said in the words of runs/inbox.py (shared with the
`outcomes` command and a bundle's report); every decision goes through
`decide` / `decide_run`, which hold the rules: who may decide, idempotency
by request token, one decision settles an item.  The permission is also
checked here, in the view (permission_required: a client can post to any
URL): viewers read, operators decide.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import permission_required
from django.core.exceptions import BadRequest
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST, require_safe
from django_htmx.http import HttpResponseStopPolling

from dashboard import params
from dashboard.approvals import approval_page
from dashboard.htmx import HtmxHttpRequest, asks_for
from dashboard.security import form_lock_waits, rejects_bad_input, shown_unless_locked
from runs import holds
from runs.approvals import rendered
from runs.decisions import (
    OPERATE,
    REFERENCE_MAX,
    Decided,
    DecisionRefused,
    Offer,
    Request,
    Who,
    decide,
    decide_run,
    gather,
    offers,
    run_offers,
)
from runs.inbox import (
    afterwards,
    blocks,
    history,
    items_listed,
    known,
    panels,
    receipts,
    waiting_unheld,
    what,
)
from runs.models import OutcomeItem, OutcomeKind, OutcomeState, Run, read_cursor
from runs.words import plain, status_now, status_words

PAGE_SIZE = 50
TOKEN_MAX = 100  # OperatorDecision.request_token

# -- pages --------------------------------------------------------------------------


def _cursor(item: OutcomeItem) -> str:
    return f"{item.created_at.isoformat()}|{item.pk}"


def _after(rows: QuerySet[OutcomeItem], cursor: str) -> QuerySet[OutcomeItem]:
    """The rows after `cursor` in (created_at, id) order, oldest first."""
    try:
        created_at, row_id = read_cursor(cursor)
    except ValueError:
        raise BadRequest(f"after={cursor!r} is not a page cursor") from None
    return rows.filter(created_at__gte=created_at).filter(
        Q(created_at__gt=created_at) | Q(id__gt=row_id)
    )


def item_filters(request: HttpRequest) -> dict[str, Any]:
    """The inbox's filters (kind, run): the inbox's and the API's."""
    kind = params.choice(request, "kind", OutcomeKind.values)
    run = request.GET.get("run", "").strip()
    if run and not (run.isascii() and run.isdigit()):
        raise BadRequest(f"run={params.quoted(run)} is not a run number")
    return {"kind": kind, "run": int(run) if run else None}


def filtered_items(items: QuerySet[OutcomeItem], filters: dict[str, Any]) -> QuerySet[OutcomeItem]:
    if filters["kind"]:
        items = items.filter(kind=filters["kind"])
    if filters["run"] is not None:
        items = items.filter(run_id=filters["run"])
    return items


def _rows(items: QuerySet[OutcomeItem]) -> list[OutcomeItem]:
    rows = list(items)
    for item in rows:
        item.kind_label = plain(OutcomeKind, item.kind)
        item.what = what(item)
        item.blocks = blocks(item)
        item.run.status_label = status_words(item.run)
        # An approval item's row shows what it asks: the email, as one.
        gate = getattr(item, "approval", None)
        item.mail = rendered(gate.proposed) if gate is not None else None
    return rows


@require_safe
@rejects_bad_input
def inbox(request: HtmxHttpRequest) -> HttpResponse:
    """Open items of runs that have not ended, oldest first (served by
    outcome_open_idx), a page at a time; the rows refresh while anything
    is open.  Below them, on the whole page, the open items of runs that
    have ended: they block nothing, and stay decidable for the record."""
    filters = item_filters(request)
    items = filtered_items(OutcomeItem.objects.in_inbox().needing_someone(), filters)
    total = items.count()
    if cursor := request.GET.get("after", ""):
        items = _after(items, cursor)
    page = _rows(items_listed(items).order_by("created_at", "id")[: PAGE_SIZE + 1])
    more, page = len(page) > PAGE_SIZE, page[:PAGE_SIZE]
    context = {
        "items": page,
        "total": total,
        "filters": filters,
        "kinds": [(value, plain(OutcomeKind, value)) for value in OutcomeKind.values],
        "next_cursor": _cursor(page[-1]) if more else "",
        "live": total > 0,
        "now": timezone.now(),
    }
    if asks_for(request, "inbox-rows"):
        response = render(request, "inbox.html#rows", context)
        return response if context["live"] else HttpResponseStopPolling(response.content)
    # The whole page only: the rows refresh every 3 s and do not show them.
    context["waiting"] = [] if filters["kind"] else waiting_unheld(filters["run"])
    context["held"] = [] if filters["kind"] or filters["run"] else holds.waiting(context["now"])
    ended = filtered_items(OutcomeItem.objects.in_inbox().no_longer_blocking(), filters)
    context["ended_total"] = ended.count()
    # The newest first: the runs that ended last are the ones still in mind.
    context["ended"] = _rows(items_listed(ended).order_by("-created_at", "-id")[:PAGE_SIZE])
    return render(request, "inbox.html", context)


def _token() -> str:
    return uuid.uuid4().hex


def _item_context(request: HttpRequest, item: OutcomeItem) -> dict[str, Any]:
    shown = gather(item)  # fresh: the xid's status and the probe are asked again
    choices: list[Offer] = offers(item, shown)
    run = item.run
    return {
        "item": item,
        "kind_label": plain(OutcomeKind, item.kind),
        "state_label": plain(OutcomeState, item.state),
        "what": what(item),
        "blocks": blocks(item),
        "known": known(item, shown),
        "panels": panels(item, shown),
        "receipts": receipts(item, shown),
        "afterwards_said": shown["afterwards"],
        "afterwards": afterwards(item),
        "offers": choices,
        "effect": item.kind == OutcomeKind.EFFECT,
        "token": _token(),
        "decisions": history(item.decisions.all()),
        "alerts": list(item.alerts.all()),
        **run_choices(request, run),
    }


def run_choices(request: HttpRequest, run: Run) -> dict[str, Any]:
    """The context templates/run_decisions.html needs (resume / abandon for
    a run that waits for an operator), for any page that includes it.  The
    run's status as the run page says it now (a lease that expired)."""
    run.status_label = status_now(run, timezone.now()).words
    held = holds.open_wait(run)
    return {
        "run": run,
        "held": held,
        "held_said": holds.waits_on_words(held) if held else "",
        "run_offers": run_offers(run),
        "run_token": _token(),
        "run_decisions": history(run.decisions.filter(item__isnull=True)),
        "can_decide": request.user.has_perm(OPERATE),
        # Where a plain run decision returns to: the page it was taken on.
        "back": request.get_full_path()
        if request.method == "GET"
        else request.POST.get("next", ""),
    }


@require_safe
@rejects_bad_input
def item_detail(request: HttpRequest, item_id: int) -> HttpResponse:
    item = get_object_or_404(items_listed(OutcomeItem.objects.all()), pk=item_id)
    # An imported run's approval item comes without its gate (bundles
    # carry items, not gates): the item page shows what it recorded.
    if getattr(item, "approval", None) is not None:
        return approval_page(request, item)
    return render(request, "outcome_item.html", _item_context(request, item))


@dataclass
class Asked:
    choice: str
    token: str
    reason: str
    reference: str


def _asked(request: HttpRequest) -> Asked:
    """The decision form's fields.  A missing or malformed request token is
    the client's fault (400); what the operator typed is judged by decide."""
    token = request.POST.get("token", "").strip()
    if not token or len(token) > TOKEN_MAX:
        raise BadRequest("the request token is missing or too long: reload the page")
    reference = request.POST.get("reference", "").strip()
    if len(reference) > REFERENCE_MAX:
        raise BadRequest(f"the reference is longer than {REFERENCE_MAX} characters")
    return Asked(
        choice=request.POST.get("choice", ""),
        token=token,
        reason=request.POST.get("reason", ""),
        reference=reference,
    )


def _said(decided: Decided) -> str:
    decision = decided.decision
    if decided.repeated:
        return (
            f"Already recorded: {decision.get_choice_display()} by {decision.decided_by} at "
            f"{timezone.localtime(decision.created_at):%H:%M:%S} (decision {decision.pk}). "
            "Nothing changed."
        )
    said = f"Recorded: {decision.get_choice_display()} by {decision.decided_by}."
    if decision.state_after == OutcomeState.OPEN:
        said += " The evidence still cannot tell: the item stays open."
    if decided.run_resumed:
        said += f" Run {decision.run_id} is back in the queue: it continues from its receipts."
    return said


def _refused(refused: DecisionRefused) -> str:
    said = f"Not decided: {refused}."
    if (winner := refused.decision) is not None:
        said += (
            f" The decision that stands: {winner.get_choice_display()} by {winner.decided_by} "
            f"at {timezone.localtime(winner.created_at):%H:%M:%S} (decision {winner.pk}): "
            f"{winner.reason}"
        )
    return said


@require_POST
@permission_required(OPERATE, raise_exception=True)
@rejects_bad_input
def item_decide(request: HtmxHttpRequest, item_id: int) -> HttpResponse:
    with form_lock_waits():
        item = get_object_or_404(OutcomeItem, pk=item_id)
    said, refused = _taken(request, lambda asked: decide(item.pk, asked), "one of the choices")
    say = messages.error if refused else messages.success
    if request.htmx:

        def shown() -> HttpResponse:
            listed = items_listed(OutcomeItem.objects.all()).get(pk=item_id)
            context = {**_item_context(request, listed), "notice": said, "refused": refused}
            return render(
                request, "outcome_item.html#item", context, status=409 if refused else 200
            )

        page = reverse("inbox-item", args=[item_id])
        return shown_unless_locked(request, shown, page, lambda: say(request, said))
    say(request, said)
    return redirect("inbox-item", item_id=item_id)


@require_POST
@permission_required(OPERATE, raise_exception=True)
@rejects_bad_input
def run_decide(request: HtmxHttpRequest, run_id: int) -> HttpResponse:
    """Resume or abandon a run that waits for an operator."""
    with form_lock_waits():
        run = get_object_or_404(Run, pk=run_id)
    said, refused = _taken(request, lambda asked: decide_run(run.pk, asked), "resume or abandon")
    say = messages.error if refused else messages.success
    if request.htmx:

        def shown() -> HttpResponse:
            run.refresh_from_db()
            context = {**run_choices(request, run), "notice": said, "refused": refused}
            return render(request, "run_decisions.html", context, status=409 if refused else 200)

        page = reverse("run-detail", args=[run.pk])
        return shown_unless_locked(request, shown, page, lambda: say(request, said))
    say(request, said)
    # Back to the page the decision was taken on: a path of this site, never
    # a view name (redirect() would look a bare word up as one) nor another site.
    back = request.POST.get("next", "")
    if not back.startswith("/") or not url_has_allowed_host_and_scheme(
        back, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        back = reverse("run-detail", args=[run.pk])
    return HttpResponseRedirect(back)


def _taken(
    request: HttpRequest, take: Callable[[Request], Decided], choices: str
) -> tuple[str, bool]:
    """Takes the decision the form asks for: what to say, and whether it
    was refused."""
    asked = _asked(request)
    try:
        if not asked.choice:
            raise DecisionRefused(f"choose {choices}")
        decision = Request(
            choice=asked.choice,
            who=Who(user=request.user),
            token=asked.token,
            reason=asked.reason,
            reference=asked.reference,
        )
        return _said(take(decision)), False
    except DecisionRefused as refusal:
        return _refused(refusal), True

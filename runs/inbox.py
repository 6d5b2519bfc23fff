"""The operators' inbox, in the words its three readers say it with: the
pages (dashboard/inbox.py), the `outcomes` command and a bundle's
report.html.  What an item is about and what it holds up (the CLI's
stable codes), what is known and what is not, the evidence as labelled
panels, the decisions taken, and the runs that wait with no item holding
them.  The evidence itself comes from runs.decisions.gather."""

from __future__ import annotations

import datetime as dt
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db.models import QuerySet
from django.utils import timezone

from runs.decisions import offered_from
from runs.models import (
    TERMINAL_STATUSES,
    Action,
    ActionState,
    OperatorDecision,
    OutcomeItem,
    OutcomeKind,
    OutcomeState,
    Run,
    RunStatus,
)
from runs.outcomes import NOT_KNOWN_HERE, UNKNOWN_TO_SERVER
from runs.timeline import EventKind
from runs.words import Field, did, evidence_fields, plain, status_words

EVENTS_AFTER = 20
# The runs waiting with no item holding them: the oldest this many.
WAITING_SHOWN = 50

# -- what an item holds up ----------------------------------------------------------


@dataclass(frozen=True)
class Blocks:
    code: str  # "nothing", "further_effects", "whole_run": stable, the CLI's JSON says it
    words: str
    why: str


def blocks(item: OutcomeItem) -> Blocks:
    """What an open item holds up.  The rule, in this order:

    - nothing: a settled item; an item of a run that has ended
      (completed, failed or cancelled: nothing in it waits any more); or a
      checkpoint item (an unknown checkpoint never holds a run: it went on
      with independent work and does not resume from that checkpoint; a
      run that waits for an operator all the same waits for something
      else, which its status says);
    - the whole run: a receipt, publication or effect item of a run that
      waits for an operator: nothing more happens in it until the item is
      settled or the run is abandoned;
    - further effects: a receipt, publication or effect item of a run that
      is queued or running again (its owner died before it could stop, and
      it was requeued): the run goes on from its receipts, but stops for an
      operator when it reaches this action again; nothing after it, no
      effect, is dispatched while the item is open.
    """
    run = item.run
    if item.state != OutcomeState.OPEN:
        return Blocks("nothing", "nothing", "settled")
    if run.status in TERMINAL_STATUSES:
        return Blocks("nothing", "nothing", f"the run has ended: {status_words(run)}")
    if item.kind == OutcomeKind.CHECKPOINT and run.status == RunStatus.NEEDS_OPERATOR:
        return Blocks(
            "nothing",
            "nothing",
            "a checkpoint holds nothing: the run waits for an operator for another reason: "
            f"{run.status_reason or 'its page says why'}",
        )
    if item.kind == OutcomeKind.CHECKPOINT:
        return Blocks("nothing", "nothing", "a checkpoint: the run went on with independent work")
    if run.status == RunStatus.NEEDS_OPERATOR:
        waits = "the run waits for an operator until this is settled"
        if run.is_imported:
            # As it stood when exported; here nobody can settle it.
            waits = f"at {run.origin_installation}, {waits} there (imported: read-only here)"
        return Blocks("whole_run", "the whole run", waits)
    return Blocks(
        "further_effects",
        "further effects",
        f"the run is {plain(RunStatus, run.status)}; it stops again at this action while "
        "this is open",
    )


def what(item: OutcomeItem) -> str:
    """The write or action an item is about, as an operator names it: by
    what the action did ("delivering the report to hooks.example.com"), not
    by its id or the item's subject (effect:action-71:attempt-1)."""
    deed = functools.partial(did, run=item.run)
    return _about(item, deed, deed)


def named(item: OutcomeItem) -> str:
    """The write or action an item is about as the CLI's JSON names it (its
    "what", stable): the action's identity, or the step a checkpoint is after."""
    return _about(item, lambda action: action.identity, lambda action: action.step_key)


def _about(
    item: OutcomeItem, action: Callable[[Action], str], after: Callable[[Action], str]
) -> str:
    """What an item is about, its action named by `action`, the action a
    checkpoint is after by `after`."""
    if item.action_id is not None:
        return action(item.action)
    if item.kind == OutcomeKind.APPROVAL:
        return f"{item.evidence.get('tool', 'an action')} ({item.evidence.get('identity', '')})"
    if item.checkpoint_id is not None:
        checkpoint = item.checkpoint
        return f"checkpoint {checkpoint.number} after {after(checkpoint.after_action)}"
    if item.revision_number is not None:
        return f"answer revision {item.revision_number}"
    return item.subject


def said(item: OutcomeItem, text: str) -> str:
    """`text` (a summary, an event's message) with the internal names of
    what the item is about (its subject, "action 73") as `what` says it."""
    text = text.replace(item.subject, what(item))
    if item.action_id is not None:
        text = re.sub(rf"\baction {item.action_id}\b", what(item), text)
    return text


def items_listed(queryset: QuerySet[OutcomeItem]) -> QuerySet[OutcomeItem]:
    return queryset.select_related("run", "action", "checkpoint__after_action", "approval")


def listing_row(item: OutcomeItem, now: dt.datetime) -> dict[str, Any]:
    """An item as the CLI's JSON lists it (stable keys; see `outcomes --help`)."""
    found = blocks(item)
    return {
        "id": item.pk,
        "kind": item.kind,
        "state": item.state,
        "run_id": item.run_id,
        "run_status": item.run.status,
        "subject": item.subject,
        "what": named(item),
        "summary": item.summary,
        "opened_at": item.created_at.isoformat(),
        "age_seconds": int((now - item.created_at).total_seconds()),
        "blocks": found.code,
        "blocks_why": found.why,
        "resolution": item.resolution,
        "resolved_at": item.resolved_at.isoformat() if item.resolved_at else None,
    }


# -- what is known, in sentences ------------------------------------------------------


def known(item: OutcomeItem, shown: dict[str, Any]) -> list[str]:
    """What is known and what is not, in plain sentences, from the evidence
    shown (gather)."""
    subject = what(item)
    if item.state != OutcomeState.OPEN:
        when = timezone.localtime(item.resolved_at).strftime("%Y-%m-%d %H:%M:%S")
        return [f"Settled at {when}: {item.resolution}", "Nothing is left to decide on this item."]
    opened = timezone.localtime(item.created_at).strftime("%Y-%m-%d %H:%M:%S")
    if item.kind == OutcomeKind.EFFECT:
        boundary = shown.get("boundary", {})
        delivery = shown["delivery"]
        sent = _moment(boundary["dispatched_at"]) if boundary else opened
        sentences = [
            f"Known: {subject} was dispatched at {sent} (attempt {boundary.get('attempts', 1)}), "
            f"and no answer came back: {said(item, item.summary)}.",
            # Said once, here: what is not known, and where to look.
            f"Not known: whether the receiver has it. Only the receiver can say: "
            f"{_look_up(delivery)}. Nothing is sent again until someone decides.",
        ]
        if until := delivery.get("in_flight_until"):
            sentences.append(
                "Its owner lost the run during the call, which may still reach the receiver: "
                f"sending it again and saying it did not happen are "
                f"{offered_from(dt.datetime.fromisoformat(until))} (reload then)."
            )
        return sentences
    if item.kind == OutcomeKind.APPROVAL:
        approvers = item.evidence.get("approvers", {})
        return [
            f"Asked at {opened}: {item.summary}. Nothing is sent until an approver decides "
            f"(the {approvers.get('group', 'approvers')} group); not approved by "
            f"{_moment(item.evidence.get('expires_at'))}, it is refused and the run goes on "
            "without it."
        ]
    now = shown["now"]
    kind = plain(OutcomeKind, item.kind)
    xid = f"transaction {now['xid']}" if now["xid"] is not None else "its transaction (no xid)"
    status = xid_status_words(now["xid_status"])
    row = {True: "is there", False: "is not there", None: "could not be looked up"}[
        now["row_found"]
    ]
    writer = "still runs" if now["writer_alive"] else "has ended"
    sentences = [
        f"Known: the {kind} write of {subject} sent COMMIT and got no answer (opened {opened}). "
        f"Checked just now: {xid} is {status}; the row {row}; the writer {writer}."
    ]
    if now["error"]:
        sentences.append(f"The database could not be asked just now: {now['error']}.")
    elif now["settles_as"] != "unknown":
        settles = "written" if now["settles_as"] == "committed" else "not written"
        sentences.append(
            f"The evidence now says: {settles}. Checking again settles the item as that."
        )
    elif now["xid_status"] == UNKNOWN_TO_SERVER:
        sentences.append(
            f"Not known: whether it was written, since {NOT_KNOWN_HERE}. Waiting will not "
            "tell: you decide from the row as this server has it, with a reason."
        )
    elif now["xid_status"] == "in progress":
        sentences.append(
            "Not known: whether it will commit. Its transaction is still in progress, so it "
            "can still commit: nobody may decide yet; check again later."
        )
    else:
        sentences.append(
            "Not known: whether it was written. The transaction status and the row disagree, "
            "or the status is gone: you decide from the row, with a reason."
        )
    return sentences


def _look_up(delivery: dict[str, Any]) -> str:
    """Where to look an effect up, and by what: its receiver as its tool
    names it, and the key the receiver knows it by, sent as an
    Idempotency-Key or not (gather's "delivery")."""
    key, tool = delivery["idempotency_key"], delivery["tool"]
    where = delivery["receiver"] or (f"the receiver of {tool}" if tool else "the receiver")
    if delivery["tool_missing"]:
        return (
            f"look it up at {where}, by its key {key} ({delivery['tool_missing']}: where "
            f"{tool or 'its tool'} sends is not known here)"
        )
    if delivery["accepts_idempotency_key"] is False:
        return (
            f"look it up at {where}; {tool} gave it the key {key}, and sends no "
            "Idempotency-Key: its receiver keeps every copy it is sent"
        )
    return f"look it up at {where} by Idempotency-Key {key}"


def xid_status_words(status: str | None) -> str:
    """A transaction's status as pg_xact_status gave it, in an operator's words."""
    if status is None:
        return "gone (too old to tell, or never known)"
    if status == UNKNOWN_TO_SERVER:
        return f"{UNKNOWN_TO_SERVER} (lost with the WAL, or the server was restored)"
    return status


# -- evidence panels ----------------------------------------------------------------


def _moment(value: str | None) -> str:
    if not value:
        return "—"
    moment = timezone.localtime(dt.datetime.fromisoformat(value))
    return moment.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _yes(value: bool | None, none: str = "not known") -> str:
    return none if value is None else ("yes" if value else "no")


def _answer(item: OutcomeItem, delivery: dict[str, Any]) -> str:
    # gather() offers the action's error as the receiver's answer: for an
    # effect still unknown that is the runtime's account of the lost answer.
    answer = delivery["receiver_answer"]
    if item.action_id is not None and item.action.state == ActionState.UNKNOWN:
        # Why none came back is the first thing known: not said twice.
        return "none came back"
    return answer or "none recorded"


def panels(item: OutcomeItem, shown: dict[str, Any]) -> list[tuple[str, list[Field]]]:
    """The evidence, side by side, as labelled fields (never a raw dict):
    the boundary, what the runtime saw, the evidence now, the delivery."""
    result: list[tuple[str, list[Field]]] = []
    if boundary := shown.get("boundary"):
        result.append(
            (
                "The boundary (written before dispatch)",
                [
                    Field("did", "What it did", text=boundary.get("did") or boundary["identity"]),
                    Field("identity", "Action identity", text=boundary["identity"]),
                    Field("kind", "Tool", text=boundary["kind"]),
                    Field("class", "Class", text=boundary["effect_class"]),
                    Field("input_digest", "Input digest (SHA-256)", text=boundary["input_digest"]),
                    Field("epoch", "Lease epoch", text=str(boundary["epoch"])),
                    Field("at", "Dispatched at", text=_moment(boundary["dispatched_at"])),
                    Field("attempts", "Dispatches", text=str(boundary["attempts"])),
                    Field("state", "State now", text=boundary["state"].replace("_", " ")),
                ],
            )
        )
    elif item.checkpoint_id is not None:
        checkpoint = item.checkpoint
        result.append(
            (
                "The write",
                [
                    Field("number", "Checkpoint", text=str(checkpoint.number)),
                    Field("after", "After action", text=checkpoint.after_action.identity),
                    Field("epoch", "Lease epoch", text=str(checkpoint.epoch)),
                    Field("xid", "Transaction id (xid)", text=str(checkpoint.xid or "none")),
                    Field("at", "Attempted at", text=_moment(checkpoint.created_at.isoformat())),
                ],
            )
        )
    elif item.revision_number is not None:
        result.append(
            (
                "The write",
                [
                    Field("revision", "Answer revision", text=str(item.revision_number)),
                    Field("at", "Opened at", text=_moment(item.created_at.isoformat())),
                ],
            )
        )
    recorded = dict(shown["item"]["recorded"])
    delivery = shown.get("delivery")
    saw = []
    if delivery:
        # The summary is the first sentence of what is known; the identity
        # and the key are in the boundary and the delivery.
        for key in ("identity", "idempotency_key"):
            recorded.pop(key, None)
    else:
        saw.append(Field("summary", "Summary", text=said(item, item.summary)))
    result.append(("What the runtime saw", [*saw, *evidence_fields(recorded)]))
    if delivery:
        result.append(("The delivery", _delivery_fields(item, delivery)))
    if now := shown.get("now"):
        settles = {"committed": "written", "not_written": "not written"}.get(
            now["settles_as"], "cannot tell"
        )
        result.append(
            (
                "Now (checked when this page loaded)",
                [
                    Field("xid", "Transaction id (xid)", text=str(now["xid"] or "none")),
                    Field(
                        "xid_status",
                        "Its status",
                        text=xid_status_words(now["xid_status"]),
                    ),
                    Field("writer", "Writer still running", text=_yes(now["writer_alive"])),
                    Field("row", "Row found by identity (probe)", text=_yes(now["row_found"])),
                    Field("says", "The evidence says", text=settles),
                    *([Field("error", "Error", text=now["error"])] if now["error"] else []),
                ],
            )
        )
    return result


def _delivery_fields(item: OutcomeItem, delivery: dict[str, Any]) -> list[Field]:
    """Where an effect went: its tool, as its run's agent declares it
    here (or why it is not known here), the receiver the tool names, the
    key it was sent under and the receiver's answer."""
    fields = []
    if tool := delivery["tool"]:
        of = f"{tool}, of agent {delivery['agent']}"
        if delivery["tool_missing"]:
            of += f": not known here ({delivery['tool_missing']})"
        fields.append(Field("tool", "Tool", text=of))
    fields.append(Field("receiver", "Receiver", text=delivery["receiver"] or "not known"))
    accepts = delivery["accepts_idempotency_key"]
    key = delivery["idempotency_key"]
    if accepts:
        fields.append(Field("key", "Idempotency-Key sent", text=key))
    else:
        fields.append(Field("key", "Key the tool was given", text=key))
    if accepts is False:
        fields.append(Field("keyed", "Idempotency-Key sent", text="none: the tool sends none"))
    fields.append(Field("answer", "Receiver's answer", text=_answer(item, delivery)))
    return fields


def receipts(item: OutcomeItem, shown: dict[str, Any]) -> dict[str, list[dict[str, str]]]:
    rows = [
        {
            "step_key": receipt["step_key"],
            "did": receipt.get("did") or receipt["step_key"],
            "digest": receipt["result_digest"],
            "at": _moment(receipt["at"]),
            "after": receipt["after_item"],
        }
        for receipt in shown["receipts"]
    ]
    return {
        "before": [row for row in rows if not row["after"]],
        "after": [row for row in rows if row["after"]],
    }


def afterwards(item: OutcomeItem) -> list[dict[str, str]]:
    """What the run did after the item was opened: its timeline from then,
    the newest EVENTS_AFTER (how it ended, or the decision and what came
    of it, last), oldest first.  An event that only repeats the item's
    summary (said at the top) says what happened, not the summary again."""
    events = item.run.events.filter(created_at__gte=item.created_at)
    newest = list(events.order_by("-created_at", "-id")[:EVENTS_AFTER])
    return [
        {
            "at": timezone.localtime(event.created_at).strftime("%H:%M:%S.%f")[:-3],
            "what": plain(EventKind, event.kind),
            "detail": ""
            if item.summary and item.summary in event.message
            else said(item, event.message),
        }
        for event in reversed(newest)
    ]


def history(decisions: QuerySet[OperatorDecision]) -> list[OperatorDecision]:
    rows = list(decisions.select_related("user").order_by("created_at", "id"))
    for decision in rows:
        decision.after_label = plain(OutcomeState, decision.state_after)
    return rows


# -- runs no item holds ----------------------------------------------------------


@dataclass(frozen=True)
class Waiting:
    """A run that waits for an operator with no open item holding it, and
    the ids of its open items (each holds nothing)."""

    run: Run
    open_items: list[int]


def waiting_unheld(run_id: int | None) -> list[Waiting]:
    """Runs that wait for an operator with no open item holding them (a
    fact write known not written time after time, a receipt that does not
    verify...; an unknown checkpoint's item holds nothing): only a decision
    on the run itself lets them go on.  Oldest first, WAITING_SHOWN of them.  Not
    a drill's: it staged the wait on purpose (the drills page reports it)."""
    runs = Run.objects.waiting_unheld().filter(is_drill=False)
    if run_id is not None:
        runs = runs.filter(pk=run_id)
    shown = runs.only("status", "status_reason", "imported_at", "updated_at")
    page = list(shown.order_by("updated_at", "id")[:WAITING_SHOWN])
    items = OutcomeItem.objects.filter(run__in=page, state=OutcomeState.OPEN).order_by("id")
    open_items: dict[int, list[int]] = {}
    for run, item in items.values_list("run_id", "pk"):
        open_items.setdefault(run, []).append(item)
    return [Waiting(run, open_items.get(run.pk, [])) for run in page]

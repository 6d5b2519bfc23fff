"""Approval gates: a person approves an action before its boundary.

A tool declares that its calls need approval (Tool.needs_approval, for at
most Tool.approval_timeout), or an agent asks for it per call
(RunContext.step(..., needs_approval=True)).  Before the boundary of such
an action the run opens an approval item in the inbox with an Approval
row (one transaction, its alerts with it), showing the proposed input as a
person reads it, what the run has published so far and who may approve;
then it waits for an operator (NeedsOperator: its lease given up, no
thread, no connection).  The item's decision puts it back in the queue.

The choices, taken by a member of the `approvers` group (the
runs.approve_action permission, distinct from the operators'):

- approve: the proposed input is dispatched;
- approve with an edit: the edited input (valid for the tool's input
  schema) is dispatched, and is the boundary's input digest; both are kept;
- reject, with a reason: the step's result is a refusal ({"refused": why}),
  and the agent goes on without the action.

Not approved within the tool's time, the sweep rejects it as the system.

A decision here is an OperatorDecision, taken as runs/decisions.py takes
them (idempotent by request token, one winner, immutable), in the same
lock order: the run, then its item, then the approval.  The boundary of
a gated action is refused by the database unless its approval was
decided "approve" and its input digest is the one approved (a trigger on
runs_action, migration 0023): a crash anywhere between the approval and
the dispatch never sends what was not approved, and the boundary's
identity (unique per run and step) never sends it twice.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import difflib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

from django.contrib.auth import get_user_model
from django.db import DatabaseError, IntegrityError, transaction
from django.db.models.functions import Now
from django.utils import timezone

from runs.agent import Tool, ToolCall
from runs.decisions import (
    LOCK_WAIT,
    REASON_MAX,
    SYSTEM_TOKEN,
    Decided,
    DecisionRefused,
    Request,
    Who,
    _by_token,
    _deciding,
    _record,
    _storable,
    _tell,
)
from runs.models import (
    AnswerRevision,
    Approval,
    ApprovalState,
    DecisionChoice,
    OutcomeItem,
    OutcomeKind,
    OutcomeState,
    Run,
    action_identity,
    digest,
)
from runs.outcomes import NeedsOperator, open_item
from runs.progress import History
from runs.sql import waits_bounded
from runs.timeline import EventKind, timeline
from runs.words import APPROVAL_WAIT, declared_tool, human_duration

logger = logging.getLogger(__name__)

APPROVE = "runs.approve_action"
# The group migration 0023 makes, holding APPROVE (shown as who may approve).
APPROVERS = "approvers"
WAITING = APPROVAL_WAIT
CHOICES = [DecisionChoice.APPROVE, DecisionChoice.APPROVE_EDITED, DecisionChoice.REJECT]
# Who may approve, as an item shows them: the first few names.
NAMES_SHOWN = 20


# -- the gate, in the run ------------------------------------------------------------


class Stepping(Protocol):
    """What the gate needs of the runtime's Dispatcher (runs/dispatch.py)."""

    run: Run
    history: History

    def write_receipt(self) -> None: ...


@dataclass(frozen=True)
class Passed:
    """What a gated step goes on with: the tool and the input to dispatch
    (the approved one), or the refusal that is its result."""

    tool: Tool
    input: dict[str, Any]
    refusal: dict[str, str] | None = None


def gate(dispatcher: Stepping, step_key: str, tool: Tool, input: dict[str, Any]) -> Passed:
    """The approval of a gated step: opens it and waits (NeedsOperator) the
    first time, waits while it is pending, and then says what the step goes
    on with.  The approval is a fact of the run, like a receipt: a resumed
    run meets the same decision."""
    run_id = dispatcher.run.pk
    approval = (
        Approval.objects.select_related("decision").filter(run_id=run_id, step_key=step_key).first()
    )
    if approval is None:
        if dispatcher.history.get(step_key) is not None:
            # Dispatched before its tool needed approval: that boundary stands.
            return Passed(tool, input)
        _open(dispatcher, step_key, tool, input)
    if approval.proposed_digest != digest(input):
        raise NeedsOperator(
            f"identity {step_key} was used for other work (its approval was asked for "
            "another input)"
        )
    if approval.state == ApprovalState.PENDING:
        raise NeedsOperator(waiting_reason(approval), approval.item_id)
    decision = approval.decision
    assert decision is not None
    if approval.state == ApprovalState.REJECTED:
        said = refusal_words(approval)
        timeline.record(run_id, EventKind.ACTION_REFUSED, f"{step_key}: {said}")
        return Passed(tool, input, {"refused": said})
    told = {
        "decision": decision.pk,
        "by": decision.decided_by,
        "edited": approval.edited,
        "input": approval.sent,
    }

    def run(sent: dict[str, Any], call: ToolCall) -> dict[str, Any]:
        # The agent learns what was sent (an approver may have edited it),
        # in the step's result and so in its receipt.
        result = tool.run(sent, call)
        return {**result, "approval": told} if isinstance(result, dict) else result

    return Passed(dataclasses.replace(tool, run=run), approval.sent)


def gated_steps(run_id: int) -> set[str]:
    """The steps of a run an approval was asked for: each stays gated (an
    agent whose code changed and no longer asks meets the same decision;
    the database would refuse its boundary otherwise)."""
    return set(Approval.objects.filter(run_id=run_id).values_list("step_key", flat=True))


def _open(dispatcher: Stepping, step_key: str, tool: Tool, input: dict[str, Any]) -> NoReturn:
    """Opens the approval item and its Approval in one transaction (the
    item's alerts with them), and waits."""
    dispatcher.write_receipt()  # the last reads' receipts, before the run waits
    run_id = dispatcher.run.pk
    expires_at = timezone.now() + tool.approval_timeout
    within = human_duration(tool.approval_timeout.total_seconds())
    published = [
        {"number": number, "final": final, "content": content}
        for number, final, content in AnswerRevision.objects.filter(run_id=run_id)
        .order_by("number")
        .values_list("number", "is_final", "content")
    ]
    evidence = {
        "identity": action_identity(run_id, step_key),
        "tool": tool.name,
        "input": input,
        "input_digest": digest(input),
        "published": published,
        "approvers": who_may_approve(),
        "expires_at": expires_at.isoformat(),
        "within": within,
        "afterwards": "the run waits; approved, it sends the approved input once; rejected, "
        "the step is refused and the run goes on without it",
    }
    with transaction.atomic():
        item = open_item(
            run_id=run_id,
            kind=OutcomeKind.APPROVAL,
            subject=f"approval:run-{run_id}:{digest(step_key)[:24]}",
            summary=f"{tool.name} ({step_key}) needs approval within {within}",
            evidence=evidence,
        )
        approval, _ = Approval.objects.get_or_create(
            run_id=run_id,
            step_key=step_key,
            defaults={
                "item": item,
                "tool": tool.name,
                "proposed": input,
                "proposed_digest": digest(input),
                "approvers": APPROVERS,
                "expires_at": expires_at,
            },
        )
    raise NeedsOperator(waiting_reason(approval), approval.item_id)


def waiting_reason(approval: Approval) -> str:
    at = approval.expires_at.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"{WAITING} of {approval.tool} ({approval.step_key}) by the {approval.approvers} "
        f"group, until {at}"
    )


def refusal_words(approval: Approval) -> str:
    """Why a rejected approval refused its step, as the agent is told:
    "send_reply rejected by ana: wrong tone", "send_reply not approved
    within 2 h" (the system's reason)."""
    decision = approval.decision
    assert decision is not None
    if decision.user_id is None:
        return f"{approval.tool} {decision.reason}"
    return f"{approval.tool} rejected by {decision.decided_by}: {decision.reason}"


def who_may_approve() -> dict[str, Any]:
    users = (
        get_user_model()
        .objects.with_perm(APPROVE, include_superusers=False)
        .order_by("username")
        .values_list("username", flat=True)
    )
    names = list(users[: NAMES_SHOWN + 1])
    return {
        "group": APPROVERS,
        "users": names[:NAMES_SHOWN],
        "more": len(names) > NAMES_SHOWN,
    }


# -- deciding -------------------------------------------------------------------------


def decide_approval(
    item_id: int, request: Request, edited: Mapping[str, Any] | None = None
) -> Decided:
    """Approves (as proposed, or with `edited` as the input sent) or
    rejects an approval item, or finds the decision taken earlier with
    the same token.  DecisionRefused says why not.  One transaction, its
    lock waits bounded, in the lock order of runs/decisions.py."""
    try:
        with _deciding(f"item {item_id} or its run"):
            decided = _decided(item_id, request, edited)
    except IntegrityError:
        # The same token, committed by a concurrent submit: that one stands.
        if (earlier := _by_token(request, item_id=item_id)) is not None:
            return Decided(earlier, repeated=True)
        raise
    if decided.repeated:
        return decided
    _tell(decided.decision.run_id, decided.decision, f"the approval of item {item_id}")
    if decided.run_resumed:
        timeline.record(
            decided.decision.run_id,
            EventKind.RUN_REQUEUED,
            f"approval item {item_id} decided by {request.who.name}: continues",
        )
    return decided


def _decided(item_id: int, request: Request, edited: Mapping[str, Any] | None) -> Decided:
    if (earlier := _by_token(request, item_id=item_id)) is not None:
        return Decided(earlier, repeated=True)
    _check_approver(request)
    item = OutcomeItem.objects.select_related("run").filter(pk=item_id).first()
    if item is None or item.kind != OutcomeKind.APPROVAL:
        raise DecisionRefused(f"there is no approval item {item_id}")
    if item.run.is_imported:
        raise DecisionRefused(f"item {item_id} is an imported run's: read-only here")
    # The lock order (runs/decisions.py): the run, then the item, then
    # what it is about (the approval); each read again under its lock.
    run = Run.objects.locked(item.run_id)
    item = OutcomeItem.objects.select_for_update(of=("self",)).get(pk=item_id)
    approval = Approval.objects.select_for_update().get(item_id=item_id)
    if (earlier := _by_token(request, item_id=item_id)) is not None:
        return Decided(earlier, repeated=True)
    if approval.state != ApprovalState.PENDING or item.state != OutcomeState.OPEN:
        first = item.decisions.filter(state_after=OutcomeState.SETTLED).first()
        raise DecisionRefused(
            f"already decided by {first.decided_by}" if first else "already decided", first
        )
    assert run is not None
    if run.is_finished and request.choice != DecisionChoice.REJECT:
        raise DecisionRefused(
            f"run {run.pk} has ended ({run.status_reason or run.status}): nothing would be "
            "sent; it can only be rejected, for the record"
        )
    now = timezone.now()
    if request.who.user is not None and now >= approval.expires_at:
        raise DecisionRefused(
            f"the approval expired at {approval.expires_at.astimezone(dt.UTC):%H:%M:%S} UTC: "
            "it is refused as not approved in time"
        )
    sent = _sent(run, approval, request.choice, edited)
    shown = shown_for(approval, sent)
    decision = _record(run.pk, item, None, request, shown, "settled")
    state = ApprovalState.REJECTED if sent is None else ApprovalState.APPROVED
    Approval.objects.filter(pk=approval.pk, state=ApprovalState.PENDING).update(
        state=state,
        decision=decision,
        sent=sent,
        sent_digest="" if sent is None else digest(sent),
        decided_at=Now(),
    )
    OutcomeItem.objects.filter(pk=item.pk).update(
        state=OutcomeState.SETTLED,
        resolution=f"{decision.get_choice_display()} by {decision.decided_by}: {decision.reason}",
        resolved_at=now,
        evidence={**item.evidence, "decision": decision.pk},
    )
    resumed = Run.objects.resume_if_settled(
        run.pk, f"approval of {approval.step_key} decided by {request.who.name}: continues"
    )
    return Decided(decision, run_resumed=resumed)


def _check_approver(request: Request) -> None:
    """A person with the approve permission (an operator without it may
    not), with a reason for a rejection; or the system."""
    _storable("reason", request.reason)
    if request.choice not in CHOICES:
        raise DecisionRefused(
            f"{request.choice!r} is not a choice for an approval: "
            f"{', '.join(str(choice) for choice in CHOICES)}"
        )
    user = request.who.user
    if user is None:
        if not request.who.system:
            raise DecisionRefused("a decision is a person's or the system's")
        return
    if not user.has_perm(APPROVE):
        raise DecisionRefused(
            f"{user.get_username()} may not approve: the approver permission "
            f"({APPROVE}, the {APPROVERS} group)"
        )
    if request.choice == DecisionChoice.REJECT and not request.reason.strip():
        raise DecisionRefused("say why: a rejection needs a reason")
    if len(request.reason.strip().replace("\r\n", "\n")) > REASON_MAX:
        raise DecisionRefused(f"the reason is longer than {REASON_MAX} characters")
    if not request.reason.strip():
        # The record says why all the same: a person's decision always does.
        request.reason = (
            "approved with an edit"
            if request.choice == DecisionChoice.APPROVE_EDITED
            else "approved as proposed"
        )


def _sent(
    run: Run, approval: Approval, choice: str, edited: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """The input a choice sends: the proposed one, a valid edit of it, or
    None (rejected)."""
    if choice == DecisionChoice.REJECT:
        return None
    if choice == DecisionChoice.APPROVE:
        return approval.proposed
    if edited is None:
        raise DecisionRefused("approve with an edit: the edited input is missing")
    edit = dict(edited)
    declared = declared_tool(run, approval.tool)
    if declared.tool is None:
        raise DecisionRefused(f"the edit cannot be checked: {declared.missing}")
    if refusal := declared.tool.refusal(edit):
        raise DecisionRefused(f"the edit is refused: {refusal}")
    if digest(edit) == approval.proposed_digest:
        raise DecisionRefused("the edit changes nothing: approve it as proposed")
    return edit


def shown_for(approval: Approval, sent: dict[str, Any] | None) -> dict[str, Any]:
    """What a decision on `approval` records as shown: the item's evidence
    (the proposed input, what was published, who may approve) and, for an
    edit, the input sent and the difference."""
    shown: dict[str, Any] = {
        "approval": {
            "id": approval.pk,
            "item": approval.item_id,
            "run": approval.run_id,
            "step_key": approval.step_key,
            "tool": approval.tool,
            "expires_at": approval.expires_at.isoformat(),
        },
        "shown": approval.item.evidence,
        "proposed_digest": approval.proposed_digest,
    }
    if sent is not None and digest(sent) != approval.proposed_digest:
        shown["edit"] = {"input": sent, "input_digest": digest(sent)}
        shown["diff"] = input_diff(approval.proposed, sent)
    return shown


def input_diff(proposed: Mapping[str, Any], sent: Mapping[str, Any]) -> list[str]:
    """The edit as a unified diff of the two inputs, field by field."""
    return list(
        difflib.unified_diff(_lines(proposed), _lines(sent), "proposed", "sent", lineterm="", n=2)
    )


def _lines(input: Mapping[str, Any]) -> list[str]:
    lines = []
    for key in sorted(input, key=_reading_order):
        lines.extend(f"{key}: {line}" for line in _text(input[key]).splitlines() or [""])
    return lines


def _reading_order(key: str) -> tuple[int, str]:
    """An email's order: who it goes to, what it is about, the rest, the
    body last (a jsonb object keeps its keys in an order of its own)."""
    return ({"to": 0, "subject": 1, BODY: 3}.get(key, 2), key)


# -- expiry (the sweep) ----------------------------------------------------------------------


def expire_due() -> list[int]:
    """Rejects, as the system, each pending approval past its time ("not
    approved within 2 h"): the runs put back in the queue, to go on without
    the action.  Each in its own transaction (decide_approval); one that
    cannot have its locks is left to the next sweep."""
    resumed: list[int] = []
    try:
        with waits_bounded(LOCK_WAIT):
            due = list(
                Approval.objects.filter(
                    state=ApprovalState.PENDING,
                    expires_at__lte=Now(),
                    run__imported_at__isnull=True,
                )
                .order_by("expires_at")
                .values_list("item_id", "item__evidence__within")[:1000]
            )
    except DatabaseError as error:
        logger.warning("sweep: expired approvals not listed: %s", str(error).strip())
        return resumed
    for item_id, within in due:
        request = Request(
            choice=DecisionChoice.REJECT,
            who=Who(system="approval timeout"),
            token=f"{SYSTEM_TOKEN}item-{item_id}",
            reason=f"not approved within {within}",
        )
        try:
            decided = decide_approval(item_id, request)
        except DecisionRefused:
            continue  # decided first by a person, or its run ended
        except DatabaseError as error:
            logger.warning("sweep: approval item %s not expired: %s", item_id, error)
            continue
        if decided.run_resumed:
            resumed.append(decided.decision.run_id)
    return resumed


# -- shown to a person ---------------------------------------------------------------------


@dataclass(frozen=True)
class Rendered:
    """A proposed input as a person reads it: its short fields as headers
    (an email's To and Subject), its long text (the email's body) below."""

    headers: list[tuple[str, str]]
    body: str | None


# The field shown as the text below the headers, when an input has one.
BODY = "body"


def rendered(input: Mapping[str, Any]) -> Rendered:
    headers = [
        (key.replace("_", " ").capitalize(), _text(input[key]))
        for key in sorted(input, key=_reading_order)
        if key != BODY
    ]
    return Rendered(headers, _text(input[BODY]) if BODY in input else None)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def editable(tool: Tool | None) -> list[str]:
    """The fields of a tool's input an approver may edit: its string
    properties (an email's to, subject and body)."""
    if tool is None:
        return []
    properties = tool.input_schema.get("properties", {})
    return [name for name, spec in properties.items() if spec.get("type") == "string"]

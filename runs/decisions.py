"""Decisions on what the runtime cannot settle itself, by evidence or by an
operator: one code path for both.

An outcome item (runs/outcomes.py) stays open until a decision settles it.
The choices offered are those the evidence allows, gathered fresh each time
(`gather`, `offers`):

- an effect whose answer was lost (only its receiver knows):
  `confirmed_happened` (the action gets a receipt that says so; it is never
  sent again), `resend_same_identity` and `confirmed_not_happened` (each
  authorises one more dispatch under the original identity and
  Idempotency-Key: the only way an effect is ever dispatched twice, and the
  database counts these decisions, migration 0008); `resend_same_identity`
  only for a tool that sends the identity as an idempotency key, as the
  run's agent installed here declares it;
- a database write whose COMMIT got no answer: `check_again`, and only when
  the evidence cannot tell (no transaction status any more, or contradicting
  the probe), `written` or `not_written`, as the probe by identity allows;
- the run itself: `resume` (back to the queue, from its receipts) when no
  item holds it, under the installed version of its agent if that
  changed, `abandon` (it ends; everything it wrote stays readable); only
  `abandon` when its agent is not installed here.

A decision is a row nobody can change (OperatorDecision): who, why, the
reference, the evidence shown and its SHA-256, the item's state before and
after.  It is idempotent by its request token, and two decisions on one item
cannot both settle it: the item row is locked, the second sees the first.
When the last item a waiting run is held by is settled, the run goes back to
the queue in the same transaction.

What a person may choose is checked under the locks, on the item, its run
and its action as they are then: a choice the state no longer allows (a
resend on a run abandoned meanwhile, an item settled meanwhile) is refused
and says why.  Sending an effect again, or saying it did not happen, waits
while the dispatch may still be in flight (`in_flight_until`).

Lock order, on every path: the run row first (Run.objects.locked), then
its outcome items, then what they are about (the action, the
checkpoint).  A decision, a run decision, the sweep's settlements and the
owner's wait (`resume_if_settled_meanwhile`, after the owner's finish,
which locks the run alone) all take them so; the other way round, a
decision and an owner that has just begun to wait deadlock.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import DatabaseError, IntegrityError, transaction
from django.db.models.functions import Now
from django.utils import timezone
from psycopg.types.json import Jsonb

from runs import lifecycle, registry
from runs.models import (
    AUTHORISING,
    TERMINAL_STATUSES,
    UNSTORABLE,
    Action,
    ActionState,
    Checkpoint,
    CheckpointOutcome,
    DecisionChoice,
    HoldWait,
    OperatorDecision,
    OutcomeItem,
    OutcomeKind,
    OutcomeState,
    Receipt,
    Run,
    RunStatus,
    action_identity,
    digest,
)
from runs.outcomes import UNKNOWN_TO_SERVER, Settlement, settle, written, written_by
from runs.sql import CommitUnanswered, lock_refused, server_cursor, waits_bounded
from runs.timeline import EventKind, timeline
from runs.words import Declared, declared_tool, did, receiver

logger = logging.getLogger(__name__)

OPERATE = "runs.operate_run"
REFERENCE_MAX = OperatorDecision._meta.get_field("reference").max_length
# A reason is read on every page the decision is shown on, and in the
# status of the run it resumed or ended: a paragraph, not a pasted log
# (the evidence is kept with the decision).
REASON_MAX = 4000
# The longest a decision, a person's or the sweep's, waits for a lock (a
# PostgreSQL lock_timeout); the sweep's other steps too (runs/sweep.py).
# Nothing of Rundesk's holds a waiting run or an item longer: a wait beyond
# it is a stranger's lock, and the decision is refused, not left hanging.
LOCK_WAIT = "1s"
# The request tokens of the system's own decisions (`system:item-N`).
SYSTEM_TOKEN = "system:"  # noqa: S105 (a prefix, no secret)


class DecisionRefused(Exception):
    """The decision cannot be taken; says why, and names the decision that
    settled the item first, if one did."""

    def __init__(self, message: str, decision: OperatorDecision | None = None) -> None:
        super().__init__(message)
        self.decision = decision


@dataclass(frozen=True)
class Offer:
    choice: DecisionChoice
    does: str  # what it will do, in an operator's words

    @property
    def label(self) -> str:
        return self.choice.label


# -- the evidence -----------------------------------------------------------------


def check(item: OutcomeItem) -> Settlement:
    """The evidence now: the write's transaction status, whether its writer
    still runs, and the probe by identity (no waiting)."""
    asked = CommitUnanswered(item.subject, item.xid, written_by(item), "asked again")
    return settle(asked, lambda: written(item), patience=0)


def gather(item: OutcomeItem) -> dict[str, Any]:
    """What an operator is shown about an item, fresh: what the runtime
    recorded, the action's boundary, the evidence now, the run's receipts,
    what the run did afterwards.  JSON, so it can be kept with a decision."""
    run = item.run
    shown: dict[str, Any] = {
        "item": {
            "id": item.pk,
            "kind": item.kind,
            "subject": item.subject,
            "summary": item.summary,
            "opened_at": item.created_at.isoformat(),
            "state": item.state,
            "recorded": item.evidence,
        },
        "run": {"id": run.pk, "status": run.status, "status_reason": run.status_reason},
    }
    if item.action_id is not None:
        action = item.action
        shown["boundary"] = {
            "identity": action_identity(run.pk, action.step_key),
            "did": did(action, run),
            "kind": action.kind,
            "effect_class": action.effect_class,
            "input_digest": action.input_digest,
            "epoch": action.epoch,
            "attempts": action.attempts,
            "dispatched_at": action.dispatched_at.isoformat(),
            "state": action.state,
            "error": action.error,
        }
    if item.kind == OutcomeKind.EFFECT:
        until = in_flight_until(item)
        declared = _declared(item)
        shown["delivery"] = {
            "agent": run.agent,
            "tool": item.action.kind if item.action_id else "",
            # Not known here (None): its agent is not installed; why, said.
            "accepts_idempotency_key": declared.tool.accepts_idempotency_key
            if declared.tool
            else None,
            "tool_missing": declared.missing,
            "idempotency_key": item.evidence.get("idempotency_key", ""),
            # Where to look it up: the only one who knows.
            "receiver": receiver(item.action, declared) if item.action_id else "",
            "receiver_answer": item.action.error if item.action_id else "",
            "in_flight_until": until.isoformat() if until else None,
        }
    elif item.kind == OutcomeKind.APPROVAL:
        # What it asks is its evidence (runs/approvals.py): no write of
        # unknown outcome to ask the database about.
        shown["approval"] = item.evidence
    elif run.is_imported:
        # Its xid and writer's backend are another installation's: asking
        # this database about them would answer about something else.
        shown["now"] = {
            "xid": item.xid,
            "xid_status": None,
            "writer_alive": None,
            "row_found": None,
            "error": f"not asked: {_imported(run)}",
            "settles_as": "unknown",
        }
    else:
        settlement = check(item)
        last = settlement.evidence["checks"][-1]
        shown["now"] = {
            "xid": settlement.evidence["xid"],
            "xid_status": last.get("xid_status"),
            "writer_alive": last.get("backend_alive"),
            "row_found": last.get("row_found"),
            "error": last.get("error"),
            "settles_as": settlement.outcome,
        }
    receipts = (
        Receipt.objects.filter(run=run).select_related("action").order_by("created_at", "action_id")
    )
    shown["receipts"] = [
        {
            "step_key": receipt.step_key,
            "did": did(receipt.action, run),
            "result_digest": receipt.result_digest,
            "at": receipt.created_at.isoformat(),
            "after_item": receipt.created_at > item.created_at,
        }
        for receipt in receipts
    ]
    shown["afterwards"] = item.evidence.get("afterwards", "")
    return shown


def _declared(item: OutcomeItem) -> Declared:
    """The tool of an effect item's action, as its run's agent declares it
    here now: the one that would send it again."""
    if item.action_id is None:
        return Declared(None, f"{item.subject} names no action")
    return declared_tool(item.run, item.action.kind)


def call_timeout(run: Run, kind: str) -> float:
    """How long a call of the tool `kind` of `run`'s agent may last: the
    timeout its tool declares (its own I/O gives up by then).  A tool not
    known here (its agent is not installed) is given the longest of the
    runtime's own."""
    declared = declared_tool(run, kind)
    if declared.tool is not None:
        return declared.tool.timeout
    return max(settings.RUNDESK_DELIVERY_TIMEOUT, settings.RUNDESK_MODEL_TIMEOUT)


def in_flight_until(item: OutcomeItem) -> dt.datetime | None:
    """Until when the dispatch an effect item is about may still be in
    flight, if that may still be the case: its owner lost the run mid-call
    (a later owner opened the item: the one that dispatched never saw its
    call end).  That call started before its lease ran out and lasts at
    most the tool's timeout: the boundary's time, plus the lease, plus the
    timeout.  None when it cannot be in flight any more (or never could:
    the owner that dispatched it saw the answer lost)."""
    if item.kind != OutcomeKind.EFFECT or item.action_id is None:
        return None
    action = item.action
    if item.evidence.get("lease_epoch") == action.epoch:
        return None
    until = action.dispatched_at + dt.timedelta(
        seconds=call_timeout(item.run, action.kind) + settings.RUNDESK_LEASE_SECONDS
    )
    return until if until > timezone.now() else None


def offered_from(until: dt.datetime) -> str:
    """When sending again is offered, in an operator's words."""
    at = until.astimezone(dt.UTC).strftime("%H:%M:%S UTC")
    return f"offered from {at}, when the previous owner's call can no longer be in flight"


def offers(item: OutcomeItem, shown: dict[str, Any]) -> list[Offer]:
    """The choices the evidence in `shown` (gather) allows for `item`, in
    the state `item`, its run and its action are in."""
    if item.state != OutcomeState.OPEN or item.run.is_imported:
        return []
    if item.kind == OutcomeKind.APPROVAL:
        return []  # approvers decide it, through runs/approvals.py
    if item.kind == OutcomeKind.EFFECT:
        return _effect_offers(item, shown)
    now = shown["now"]
    choices = [
        Offer(
            DecisionChoice.CHECK_AGAIN,
            "Asks the database again (transaction status, then the row by its identity); "
            "settles the item if the evidence now can.",
        )
    ]
    # Only where the evidence cannot tell: the transaction's status is gone
    # (or was never known, or this server does not know the transaction:
    # lost with the WAL, or a restore), or contradicts the probe (committed,
    # and no row: an aborted one settles itself, a row found then is
    # another's).  While the transaction is still in flight nobody may
    # decide: it can still commit.
    gone = now["xid_status"] in (None, UNKNOWN_TO_SERVER) and not now["writer_alive"]
    contradicts = (now["xid_status"], now["row_found"]) == ("committed", False)
    if (gone or contradicts) and now["error"] is None:
        if now["row_found"]:
            choices.append(
                Offer(
                    DecisionChoice.WRITTEN,
                    "The row is there: it is adopted as written; the run goes on from it.",
                )
            )
        else:
            choices.append(
                Offer(
                    DecisionChoice.NOT_WRITTEN,
                    "The row is not there: it is known not written; the run writes it "
                    "again when it goes on (a read is dispatched again under its identity).",
                )
            )
    return choices


def _effect_offers(item: OutcomeItem, shown: dict[str, Any]) -> list[Offer]:
    """Sending again, or saying it did not happen, only once the previous
    owner's call can no longer be in flight: the receiver may get it yet.
    Sending again when nobody knows ("send again under the same identity")
    only where the tool hands the action's identity to its receiver as an
    idempotency key (Tool.accepts_idempotency_key): a receiver that keeps
    one copy per key makes it safe; any other would keep two.  Asked of the
    tool as installed now (it is the one that would send it), never of the
    evidence a client sent back."""
    ended = item.run.is_finished
    happened = Offer(
        DecisionChoice.CONFIRMED_HAPPENED,
        "The receiver has it: nothing is sent again. The action is recorded as completed, "
        "confirmed by you, with your reference" + ("." if ended else "; the run goes on past it."),
    )
    if in_flight_until(item) is not None:
        return [happened]
    if ended:
        # Nothing will send it again: what the receiver says is recorded.
        return [
            happened,
            Offer(
                DecisionChoice.CONFIRMED_NOT_HAPPENED,
                "The receiver does not have it. Recorded so; nothing is sent: the run has ended.",
            ),
        ]
    declared = _declared(item)
    if declared.tool is None:
        return [
            happened,
            Offer(
                DecisionChoice.CONFIRMED_NOT_HAPPENED,
                "The receiver does not have it. Recorded so: when the run goes on it sends it "
                f"again, once, as a new attempt under the same identity; but {declared.missing}, "
                "and nothing else runs it.",
            ),
        ]
    if not declared.tool.accepts_idempotency_key:
        return [
            happened,
            Offer(
                DecisionChoice.CONFIRMED_NOT_HAPPENED,
                "Sends it again, once, as a new attempt under the same identity: the receiver "
                f"told you it does not have it. {declared.tool.name} sends no idempotency key, so "
                "its receiver cannot tell a second copy from the first: it is never sent again "
                "on a guess.",
            ),
        ]
    # Both choices below send it again, the same way: what differs is what
    # the operator says they know, recorded with the decision.  Said plainly,
    # so that nobody picks one believing the other sends nothing.
    key = shown["delivery"]["idempotency_key"]
    return [
        happened,
        Offer(
            DecisionChoice.RESEND_SAME_IDENTITY,
            f"Sends it again, once, under the same Idempotency-Key {key}: for when you "
            "cannot tell, and the receiver keeps one copy per key. Records that you did "
            "not know.",
        ),
        Offer(
            DecisionChoice.CONFIRMED_NOT_HAPPENED,
            "Sends it again, once, under the same Idempotency-Key, as “send again” does. "
            "Records that the receiver told you it does not have it.",
        ),
    ]


@dataclass(frozen=True)
class AgentHere:
    """A run's agent as installed here now: its version (None: none is
    installed under its name, `missing` says why), and whether that
    version changed from the run's without declaring it continues it
    (Agent.continues: the executor then leaves the run to an operator)."""

    version: str | None
    missing: str = ""
    changed: bool = False


def agent_here(run: Run) -> AgentHere:
    try:
        declared = registry.agent_class(run.agent)
    except registry.NotInstalled as error:
        return AgentHere(None, str(error))
    return AgentHere(declared.version, changed=not declared.can_continue(run.agent_version))


def run_offers(run: Run) -> list[Offer]:
    """Resume or abandon, for a run that waits for an operator.  A run whose
    agent is not installed here can only be abandoned: nothing else's code
    ever runs it.  Resuming a run whose agent's version changed continues
    it under the installed version, and says so."""
    if run.status != RunStatus.NEEDS_OPERATOR or run.is_imported:
        return []
    here = agent_here(run)
    if here.version is None:
        return [
            Offer(
                DecisionChoice.ABANDON,
                f"The run ends: {here.missing}, and nothing else runs it. Its receipts, "
                "answers and evidence stay readable; nothing is sent.",
            )
        ]
    choices = [
        Offer(
            DecisionChoice.ABANDON,
            "The run ends. Its receipts, answers and evidence stay readable; nothing is sent.",
        )
    ]
    if not run.outcome_items.holding_runs().exists():
        goes_on = "it continues from its receipts, executing nothing that completed."
        if here.changed:
            goes_on = (
                f"it continues under version {here.version} (it started under "
                f"{run.agent_version}): its code changed. It continues from its receipts, "
                "executing nothing that completed."
            )
        choices.insert(0, Offer(DecisionChoice.RESUME, f"Back to the queue: {goes_on}"))
    return choices


def run_refusal(run: Run, choice: str) -> str:
    """Why `choice` cannot be taken on `run` as it is now ("": it can), as
    decide_run says it under the run's lock; a bulk job's dry run asks the
    same without one (runs/bulk.py)."""
    if run.is_imported:
        return f"run {run.pk} cannot be decided: {_imported(run)}"
    offered = {offer.choice for offer in run_offers(run)}
    if choice not in offered:
        return (
            f"{choice} is not offered for run {run.pk} ({run.get_status_display()}): "
            f"{', '.join(sorted(offered)) or 'nothing is'} offered"
        )
    return ""


# -- deciding ---------------------------------------------------------------------


@dataclass
class Who:
    """A person (a user with the operator permission) or the system."""

    user: AbstractBaseUser | None = None
    system: str = ""

    @property
    def name(self) -> str:
        return self.user.get_username() if self.user is not None else f"system: {self.system}"


@dataclass
class Request:
    choice: str
    who: Who
    token: str
    reason: str = ""
    reference: str = ""
    shown: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Decided:
    """What a call to decide / decide_run did: the decision that stands for
    its request (when `repeated`, the one taken earlier with the same token:
    this call changed nothing), and whether this call put the run back in
    the queue."""

    decision: OperatorDecision
    repeated: bool = False
    run_resumed: bool = False


def decide(item_id: int, request: Request) -> Decided:
    """Takes a decision on an open item, or finds the one taken earlier
    with the same token.  DecisionRefused says why not.  One transaction,
    what it reads included, its lock waits bounded."""
    try:
        with _deciding(f"item {item_id} or its run"):
            item, decided = _decided(item_id, request)
    except IntegrityError:
        # The same token, committed by a concurrent submit: that one stands.
        if (earlier := _by_token(request, item_id=item_id)) is not None:
            return Decided(earlier, repeated=True)
        raise
    if decided.repeated:
        return decided
    _tell(item.run_id, decided.decision, item.subject)
    if decided.run_resumed:
        timeline.record(
            item.run_id,
            EventKind.RUN_REQUEUED,
            f"{item.subject} settled by {request.who.name}: continues from its receipts",
        )
    return decided


def _decided(item_id: int, request: Request) -> tuple[OutcomeItem | None, Decided]:
    """decide(), inside its transaction: the item (None for a repeat) and
    the decision."""
    if (earlier := _by_token(request, item_id=item_id)) is not None:
        return None, Decided(earlier, repeated=True)
    _check_person(request)
    item = (
        OutcomeItem.objects.select_related("run", "action", "checkpoint").filter(pk=item_id).first()
    )
    if item is None:
        raise DecisionRefused(f"there is no outcome item {item_id}")
    if item.run.is_imported:
        raise DecisionRefused(f"item {item_id} cannot be decided: {_imported(item.run)}")
    shown = request.shown or gather(item)
    # The lock order (module docstring): the run, then the item; both read
    # again under their locks, what the item is about with them.
    run = Run.objects.locked(item.run_id)
    item = (
        OutcomeItem.objects.select_for_update(of=("self",))
        .select_related("action", "checkpoint")
        .get(pk=item_id)
    )
    item.run = run
    if (earlier := _by_token(request, item_id=item_id)) is not None:
        return None, Decided(earlier, repeated=True)
    if item.state != OutcomeState.OPEN:
        first = item.decisions.filter(state_after=OutcomeState.SETTLED).first()
        if first is None:
            raise DecisionRefused(f"already settled: {item.resolution}")
        # Its choice and reason are said with the decision that stands.
        raise DecisionRefused(f"already settled by {first.decided_by}", first)
    if request.who.user is not None:
        check_offered(item, shown, request.choice)
    settlement = check(item) if request.choice == DecisionChoice.CHECK_AGAIN else None
    outcome = _outcome(item, request.choice, settlement)
    decision = _record(item.run_id, item, item.action_id, request, shown, outcome)
    if outcome is not None:
        _apply(item, decision, outcome)
    resumed = outcome is not None and Run.objects.resume_if_settled(
        item.run_id, f"{item.subject} settled by {request.who.name}: continues"
    )
    return item, Decided(decision, run_resumed=resumed)


def check_offered(item: OutcomeItem, shown: dict[str, Any], choice: str) -> None:
    """Refuses a person's choice the evidence, or the state of the item,
    its run and its action (read under their locks), does not allow now:
    a run that ended since the evidence was gathered changes what each
    choice does (nothing is sent any more)."""
    run = item.run
    seen = shown.get("run", {}).get("status")
    if seen is not None and seen not in TERMINAL_STATUSES and run.is_finished:
        raise DecisionRefused(
            f"run {run.pk} is {run.get_status_display().lower()}: it ended while this was "
            f"decided ({run.status_reason}); nothing was decided: look at the item again"
        )
    offered = {offer.choice for offer in offers(item, shown)}
    if choice in offered:
        return
    if choice in AUTHORISING and (until := in_flight_until(item)) is not None:
        raise DecisionRefused(
            f"{choice} is not offered yet: {offered_from(until)} (dispatched at "
            f"{item.action.dispatched_at.astimezone(dt.UTC):%H:%M:%S} UTC, by an owner "
            "that lost the run during the call)"
        )
    raise DecisionRefused(
        f"{choice} is not offered for this item now (run {run.pk} is "
        f"{run.get_status_display().lower()}): the evidence allows "
        f"{', '.join(sorted(offered)) or 'nothing'}"
    )


def decide_run(run_id: int, request: Request) -> Decided:
    """`resume` or `abandon` a run that waits for an operator: one
    transaction, what it reads included, its lock waits bounded."""
    with _deciding(f"run {run_id}"):
        if (earlier := _by_token(request, run_id=run_id)) is not None:
            return Decided(earlier, repeated=True)
        _check_person(request)
        run = Run.objects.filter(pk=run_id).first()
        if run is None:
            raise DecisionRefused(f"there is no run {run_id}")
        if run.is_imported:
            raise DecisionRefused(f"run {run_id} cannot be decided: {_imported(run)}")
        # The lock order (module docstring): the run first; what is
        # offered is read under its lock.
        run = Run.objects.locked(run_id)
        if (earlier := _by_token(request, run_id=run_id)) is not None:
            return Decided(earlier, repeated=True)
        if why := run_refusal(run, request.choice):
            raise DecisionRefused(why)
        here = agent_here(run)
        shown = request.shown or {
            "run": {"id": run.pk, "status": run.status},
            "agent": {"name": run.agent, "version": run.agent_version, "installed": here.version},
        }
        if request.choice == DecisionChoice.RESUME:
            under = f" under version {here.version}" if here.changed else ""
            # The rule every resume follows: no open item holds the run.
            changed = Run.objects.resume_if_settled(
                run_id, f"resumed by {request.who.name}{under}: {request.reason}"
            )
            if changed and here.changed:
                # What the executor checks before it runs the agent
                # (executor.installed_agent): the run is now this version's.
                Run.objects.filter(pk=run_id).update(agent_version=here.version)
            after = RunStatus.QUEUED
        else:
            changed = lifecycle.cancel(
                run_id,
                request.who.name,
                f"abandoned by {request.who.name}: {request.reason}",
                [RunStatus.NEEDS_OPERATOR],
            )
            after = RunStatus.CANCELLED
        if not changed:
            raise DecisionRefused(f"run {run_id} changed meanwhile: nothing was decided")
        # A run resumed or abandoned while it waited on a hold waits on it no
        # more: the hold's release must not send it on later (runs/holds.py).
        HoldWait.objects.filter(run_id=run_id, until__isnull=True).update(until=Now())
        decision = _record(run_id, None, None, request, shown, after, before=run.status)
    _tell(run_id, decision, f"run {run_id}")
    return Decided(decision, run_resumed=after == RunStatus.QUEUED)


def resume_if_settled_meanwhile(run_id: int, item_id: int) -> bool:
    """A run that has just started waiting for `item_id`: if a decision
    settled the item while the run was still running (it could not resume
    a run that was not waiting yet), the run goes back to the queue now."""
    with transaction.atomic():
        # The lock order (module docstring): the run, then the item.
        Run.objects.locked(run_id)
        item = OutcomeItem.objects.select_for_update().filter(pk=item_id).first()
        why = f"{item.subject if item else 'its item'} was settled while it stopped: continues"
        resumed = (
            item is not None
            and item.state != OutcomeState.OPEN
            and Run.objects.resume_if_settled(run_id, why)
        )
    if resumed:
        timeline.record(run_id, EventKind.RUN_REQUEUED, why)
    return resumed


def settle_by_evidence(item: OutcomeItem, settlement: Settlement) -> Decided | None:
    """The sweep's settlement of an item, as a system decision (the same
    path as an operator's).  None if another decision settled it first."""
    choice = (
        DecisionChoice.WRITTEN if settlement.outcome == "committed" else DecisionChoice.NOT_WRITTEN
    )
    request = Request(
        choice=choice,
        who=Who(system="evidence (pg_xact_status, probe by identity)"),
        token=f"{SYSTEM_TOKEN}item-{item.pk}",
        reason=settlement.describe(),
        shown={"item": {"id": item.pk, "subject": item.subject}, "evidence": settlement.evidence},
    )
    try:
        return decide(item.pk, request)
    except DecisionRefused:
        return None


@contextmanager
def _deciding(what: str) -> Iterator[None]:
    """A decision's transaction, its lock waits bounded (LOCK_WAIT): a lock
    a stranger holds on `what` refuses the decision instead of holding the
    operator's request until it is released."""
    try:
        with waits_bounded(LOCK_WAIT):
            yield
    except DatabaseError as error:
        if lock_refused(error):
            raise DecisionRefused(
                f"{what} is locked by another session (see the lock pages): nothing was "
                "decided; try again once it is free"
            ) from error
        raise


def _imported(run: Run) -> str:
    return (
        f"it was imported from {run.origin_installation} (run {run.origin_run_id} there) and "
        "is read-only here; decide it where it runs"
    )


def _check_person(request: Request) -> None:
    _storable("reason", request.reason)
    _storable("reference", request.reference)
    user = request.who.user
    if user is None:
        if not request.who.system:
            raise DecisionRefused("a decision is a person's or the system's")
        return
    if not user.has_perm(OPERATE):
        raise DecisionRefused(f"{user.get_username()} may not decide: the operator permission")
    if not request.reason.strip():
        raise DecisionRefused("say why: a reason is required")
    # As a browser's maxlength counts: a line break is one character.
    if len(request.reason.strip().replace("\r\n", "\n")) > REASON_MAX:
        raise DecisionRefused(f"the reason is longer than {REASON_MAX} characters")
    if len(request.reference) > REFERENCE_MAX:
        raise DecisionRefused(f"the reference is longer than {REFERENCE_MAX} characters")


def _storable(name: str, text: str) -> None:
    """Refuses text no row can hold: a NUL, or a lone surrogate (what a
    command line passes for bytes that are no UTF-8)."""
    if UNSTORABLE.search(text):
        raise DecisionRefused(f"the {name} holds a character no text can: NUL or a lone surrogate")


def _by_token(request: Request, **about: int) -> OperatorDecision | None:
    """The decision taken earlier with this request's token, if any.  A
    person's token may not be one of the system's (`system:item-N`): taken
    first, it would stop the sweep from ever settling that item."""
    _storable("token", request.token)
    if request.who.user is not None and request.token.startswith(SYSTEM_TOKEN):
        raise DecisionRefused(f"request tokens that start with {SYSTEM_TOKEN!r} are the system's")
    earlier = OperatorDecision.objects.filter(request_token=request.token).first()
    if earlier is None:
        return None
    item_id, run_id = about.get("item_id"), about.get("run_id")
    if (item_id is not None and earlier.item_id != item_id) or (
        run_id is not None and (earlier.run_id != run_id or earlier.item_id is not None)
    ):
        raise DecisionRefused("this request token was used for another decision")
    # A repeat is the same request: the same choice, by the same person.
    if earlier.choice != request.choice or earlier.decided_by != request.who.name:
        raise DecisionRefused("this request token was used for another choice", earlier)
    return earlier


def _outcome(
    item: OutcomeItem, choice: str, settlement: Settlement | None
) -> Settlement | str | None:
    """What a decision settles the item as: "committed"/"not_written" for
    a write, the effect choice for an effect; None when it stays open (a
    check that still cannot tell)."""
    if choice == DecisionChoice.CHECK_AGAIN:
        assert settlement is not None
        return None if settlement.outcome == "unknown" else settlement
    if choice == DecisionChoice.WRITTEN:
        return "committed"
    if choice == DecisionChoice.NOT_WRITTEN:
        return "not_written"
    return choice


def _record(
    run_id: int,
    item: OutcomeItem | None,
    action_id: int | None,
    request: Request,
    shown: dict[str, Any],
    outcome: object,
    *,
    before: str = OutcomeState.OPEN,
) -> OperatorDecision:
    after = (
        outcome
        if item is None
        else (OutcomeState.OPEN if outcome is None else OutcomeState.SETTLED)
    )
    snapshot = json.loads(json.dumps(shown, default=str))
    return OperatorDecision.objects.create(
        run_id=run_id,
        item=item,
        action_id=action_id,
        user=request.who.user,
        decided_by=request.who.name,
        choice=request.choice,
        reason=request.reason.strip(),
        reference=request.reference.strip(),
        evidence=snapshot,
        evidence_digest=digest(snapshot),
        state_before=before,
        state_after=str(after),
        request_token=request.token,
    )


def _apply(item: OutcomeItem, decision: OperatorDecision, outcome: Settlement | str) -> None:
    """What the decision settles, written in its transaction."""
    result = outcome.outcome if isinstance(outcome, Settlement) else outcome
    if result == DecisionChoice.CONFIRMED_HAPPENED:
        _confirm_effect(item, decision)
    elif result in (DecisionChoice.RESEND_SAME_IDENTITY, DecisionChoice.CONFIRMED_NOT_HAPPENED):
        afterwards = (
            "the run had ended: not sent again"
            if item.run.is_finished
            else "dispatch once more under the same identity"
        )
        Action.objects.filter(pk=item.action_id, state=ActionState.UNKNOWN).update(
            state=ActionState.FAILED,
            error=f"{decision.get_choice_display()} ({decision.decided_by}): {afterwards}",
        )
    elif item.checkpoint_id is not None:
        Checkpoint.objects.filter(pk=item.checkpoint_id, outcome=CheckpointOutcome.UNKNOWN).update(
            outcome=CheckpointOutcome.SETTLED_COMMITTED
            if result == "committed"
            else CheckpointOutcome.SETTLED_NOT_WRITTEN,
            resolved_at=timezone.now(),
            resolution=f"{decision.decided_by}: {decision.reason}",
        )
    OutcomeItem.objects.filter(pk=item.pk).update(
        state=OutcomeState.SETTLED,
        resolution=f"{decision.get_choice_display()} by {decision.decided_by}: {decision.reason}",
        resolved_at=timezone.now(),
        evidence={**item.evidence, "decision": decision.pk},
    )


def _confirm_effect(item: OutcomeItem, decision: OperatorDecision) -> None:
    """The effect's receipt, confirmed by an operator with the receiver's
    reference: its action is completed, under its original identity."""
    result = {
        "confirmed_by": decision.decided_by,
        "reference": decision.reference,
        "reason": decision.reason,
        "decision": decision.pk,
    }
    with server_cursor() as cursor:
        cursor.execute(
            """WITH completed AS (
                   UPDATE runs_action SET state = 'completed', finished_at = now()
                   WHERE id = %(action)s AND state = 'unknown'
                   RETURNING id, run_id, step_key, epoch)
               INSERT INTO runs_receipt (action_id, run_id, step_key, result, result_digest,
                   epoch, xid, created_at)
               SELECT id, run_id, step_key, %(result)s, %(digest)s, epoch, rundesk_xid(false),
                   now()
               FROM completed""",
            {"action": item.action_id, "result": Jsonb(result), "digest": digest(result)},
        )
        if cursor.rowcount != 1:
            raise DecisionRefused(f"the action of {item.subject} is no longer unknown")


def _tell(run_id: int, decision: OperatorDecision, about: str) -> None:
    timeline.record(
        run_id,
        EventKind.DECISION,
        f"{decision.decided_by}: {decision.get_choice_display()} on {about}"
        + (f" ({decision.reason})" if decision.reason else ""),
        decision=decision.pk,
        state_after=decision.state_after,
    )


@dataclass
class Settled:
    settled: int = 0
    runs_resumed: list[int] = field(default_factory=list)


def settle_open_items() -> Settled:
    """Asks again about open checkpoint, receipt and publication items (an
    orphaned transaction may have ended since); what the evidence settles
    becomes a system decision.  Effects are never settled here: only their
    receiver knows.  An imported run's items are another installation's
    transactions: never asked about here.  Each item, and their list, in a
    transaction that waits for a lock at most LOCK_WAIT: an item someone
    holds is asked about again next time, and holds up no other."""
    swept = Settled()
    try:
        with waits_bounded(LOCK_WAIT):
            items = list(
                OutcomeItem.objects.local()
                .filter(
                    state=OutcomeState.OPEN,
                    kind__in=[
                        OutcomeKind.CHECKPOINT,
                        OutcomeKind.RECEIPT,
                        OutcomeKind.PUBLICATION,
                    ],
                )
                .select_related("checkpoint")
            )
    except DatabaseError as error:
        logger.warning("sweep: open items not listed: %s", str(error).strip())
        return swept
    for item in items:
        try:
            with waits_bounded(LOCK_WAIT):
                settlement = check(item)
                decided = (
                    None
                    if settlement.outcome == "unknown"
                    else settle_by_evidence(item, settlement)
                )
        except DatabaseError as error:
            logger.warning("sweep: item %s not settled: %s", item.pk, str(error).strip())
            continue
        except Exception:
            # One item that cannot be asked about holds up no other.
            logger.exception("sweep: item %s not settled", item.pk)
            continue
        if decided is not None and decided.decision.state_after == OutcomeState.SETTLED:
            swept.settled += 1
            if decided.run_resumed:
                swept.runs_resumed.append(item.run_id)
    return swept

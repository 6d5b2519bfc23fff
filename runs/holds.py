"""Tool holds: an operator stops a tool (of one agent, or of every agent),
or every effect of one agent, before it is dispatched again, and lets it
go on later.

The check is the boundary itself: the boundary's statement (runs/leases.py,
`record_boundaries` and `redispatch_boundary`) writes no action a hold
matches (HOLDING over ACTIVE_HOLDS, read in the statement's own snapshot),
and says which hold stopped it (Held).  The run then waits (`wait`: status
needs_operator, lease given up, no thread, no connection) with a HoldWait
row, in the transaction that locks the hold FOR SHARE: a release either
commits first, and the run goes back to the queue at once instead of
waiting, or waits for the run's wait to commit, and then finds it.

Adding a hold (`add`) takes the actions table in SHARE mode for its short
transaction: every boundary statement in progress has committed before,
and each one after it starts (its snapshot is taken once it has the
table's lock) sees the hold.  So a boundary is either stopped by the hold,
or committed before it, and the hold lists those without a receipt then
(`Hold.in_flight`): they were in flight, and went on.

Releasing a hold (`release`) puts every run that waits on it back in the
queue in one transaction (lifecycle.RESUME, each handed to a worker after
the commit, runs/handover.py); each dispatches its action once: its
boundary is written then, under the identity the action had all along.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.contrib.auth.base_user import AbstractBaseUser
from django.db import DatabaseError, IntegrityError, transaction
from django.db.models import (
    Count,
    DurationField,
    ExpressionWrapper,
    F,
    Max,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    Sum,
    Value,
)
from django.db.models.functions import Coalesce, Greatest, Least, Now

from runs import lifecycle, registry
from runs.agent import EFFECT
from runs.decisions import OPERATE
from runs.leases import Held
from runs.models import (
    HOLDING_KINDS,
    UNSTORABLE,
    Action,
    ActionState,
    Hold,
    HoldWait,
    Run,
    RunStatus,
)
from runs.sql import lock_refused, server_cursor, waits_bounded
from runs.timeline import EventKind, timeline

# How long adding or releasing a hold waits for a lock a stranger holds
# (the actions table, a run's row) before it is refused, saying so: short,
# since every boundary queues behind a LOCK TABLE that waits.
LOCK_WAIT = "500ms"
REASON_MAX = 2000


class HoldRefused(Exception):
    """A hold not added or not released, and why, in words for the operator."""


# -- words -----------------------------------------------------------------------


def scope_words(tool: str, agent: str) -> str:
    """What a hold stops: "send_email of support", "send_email of every
    agent", "every effect of support"."""
    if not tool:
        return f"every effect of {agent}"
    return f"{tool} of {agent or 'every agent'}"


def held_words(tool: str, hold: Hold) -> str:
    """Why a run waits: "held: send_email by alice: the helpdesk is down"."""
    return f"{who_held_words(tool, hold.added_by)}: {hold.reason}"


def who_held_words(tool: str, by: str) -> str:
    """What a run's timeline names its wait by: "held: send_email by alice"."""
    return f"held: {tool} by {by}"


def released_words(hold: Hold) -> str:
    return f"hold {hold.pk} released by {hold.released_by}: {hold.release_reason}"


def added_words(hold: Hold) -> str:
    flying = len(hold.in_flight)
    went = (
        "1 dispatch already in flight goes"
        if flying == 1
        else f"{flying} dispatches already in flight go"
    )
    return f"Hold {hold.pk} added: {scope_words(hold.tool, hold.agent)} is held. {went} on."


def released_count_words(released: Released) -> str:
    count = len(released.resumed)
    runs = "1 run" if count == 1 else f"{count} runs"
    return f"Hold {released.hold.pk} released: {runs} back in the queue."


def hold_wait_words(held: str, lasted: str, ended_by: str) -> str:
    """A run's wait at a held boundary, as its timeline labels it: "held:
    send_email by alice: 12 s, ended by the release of bob" (`lasted` as
    runs.words.human_duration says it)."""
    return f"{held}: {lasted}, ended by {ended_by or 'its end'}"


def hold_waiting_words(held: str, since: str) -> str:
    return f"{held}: since {since}, still waiting"


# -- adding and releasing ----------------------------------------------------------


@dataclass(frozen=True)
class Scope:
    """What an operator asks to hold: a tool (of `agent`, or of every agent
    when it is ""), or every effect of `agent` (tool "")."""

    tool: str
    agent: str

    def check(self) -> None:
        """HoldRefused for a scope nothing installed here declares: a
        typing error would hold nothing, silently."""
        agents = registry.installed()
        if self.agent and self.agent not in agents:
            raise HoldRefused(
                f"no agent {self.agent!r} is installed here (installed: {', '.join(agents)})"
            )
        if not self.tool:
            if not self.agent:
                raise HoldRefused("name a tool, or the agent whose every effect is held")
            return
        declaring = [a for a in ([self.agent] if self.agent else agents) if self.tool in _tools(a)]
        if not declaring:
            where = f"agent {self.agent}" if self.agent else "no installed agent"
            raise HoldRefused(f"{where} declares no tool {self.tool!r}")


def _tools(agent: str) -> set[str]:
    return {tool.name for tool in registry.installed()[agent].tools}


def _person(user: AbstractBaseUser) -> str:
    """The name of `user`, who must have the operator permission."""
    if not user.has_perm(OPERATE):
        raise HoldRefused(f"{user.get_username()} may not hold or release: the operator permission")
    return user.get_username()


def add(scope: Scope, *, user: AbstractBaseUser, reason: str) -> Hold:
    """Adds a hold: from its commit, no boundary it matches is written.
    The boundaries committed before it that have no receipt yet are listed
    on it as in flight (they go on).  HoldRefused says why not."""
    by = _person(user)
    scope.check()
    reason = _said("reason", reason)
    try:
        with waits_bounded(LOCK_WAIT):
            with server_cursor() as cursor:
                # Waits for every boundary statement in progress, and holds
                # back the next ones until this commits (module docstring).
                cursor.execute("LOCK TABLE runs_action IN SHARE MODE")
            if existing := Hold.objects.active().filter(tool=scope.tool, agent=scope.agent).first():
                raise HoldRefused(
                    f"{scope_words(scope.tool, scope.agent)} is already held (hold {existing.pk} "
                    f"by {existing.added_by})"
                )
            hold = Hold.objects.create(
                tool=scope.tool, agent=scope.agent, reason=reason, added_by=by
            )
            hold.in_flight = in_flight(scope)
            hold.save(update_fields=["in_flight"])
    except IntegrityError as error:  # another operator's, committed meanwhile
        raise HoldRefused(f"{scope_words(scope.tool, scope.agent)} is already held") from error
    except DatabaseError as error:
        if lock_refused(error):
            raise HoldRefused(
                "actions are being written by a session that holds them long (see the lock "
                "pages): no hold was added; try again"
            ) from error
        raise
    return hold


def in_flight(scope: Scope) -> list[dict[str, Any]]:
    """The dispatches `scope` matches that have a boundary and no receipt
    now: in flight (a read whose receipt waits for its run's next write
    counts: until then it is not completed)."""
    actions = Action.objects.filter(state=ActionState.DISPATCHED, run__imported_at__isnull=True)
    actions = actions.filter(kind=scope.tool) if scope.tool else actions.filter(effect_class=EFFECT)
    if scope.agent:
        actions = actions.filter(run__agent=scope.agent)
    return [
        {"action": pk, "run": run_id, "step_key": step_key, "tool": kind, "epoch": epoch}
        for pk, run_id, step_key, kind, epoch in actions.order_by("id").values_list(
            "pk", "run_id", "step_key", "kind", "epoch"
        )
    ]


@dataclass(frozen=True)
class Released:
    hold: Hold
    resumed: list[int] = field(default_factory=list)  # runs back in the queue


def release(hold_id: int, *, user: AbstractBaseUser, reason: str) -> Released:
    """Releases a hold: every run that waits on it goes back to the queue
    in this transaction, each handed to a worker after the commit.
    HoldRefused says why not (no such hold, released already)."""
    by = _person(user)
    reason = _said("reason", reason)
    try:
        with waits_bounded(LOCK_WAIT):
            changed = Hold.objects.filter(pk=hold_id, released_at__isnull=True).update(
                released_at=Now(), released_by=by, release_reason=reason
            )
            hold = Hold.objects.filter(pk=hold_id).first()
            if hold is None:
                raise HoldRefused(f"there is no hold {hold_id}")
            if not changed:
                raise HoldRefused(
                    f"hold {hold_id} was released already, by {hold.released_by} at "
                    f"{hold.released_at:%Y-%m-%d %H:%M:%S} UTC"
                )
            waiting = list(
                HoldWait.objects.filter(hold=hold, until__isnull=True).values_list(
                    "run_id", flat=True
                )
            )
            why = released_words(hold)
            resumed = [run_id for run_id in waiting if lifecycle.resume(run_id, why, HOLDING_KINDS)]
            # A run that ended while it waited (cancelled, abandoned) waited
            # until its end (a cancel's clock is its transaction's: never
            # before the wait began).
            ended = Run.objects.filter(pk=OuterRef("run_id")).values("finished_at")
            HoldWait.objects.filter(hold=hold, until__isnull=True).update(
                until=Greatest(F("since"), Least(Coalesce(Subquery(ended), Now()), Now()))
            )
    except DatabaseError as error:
        if lock_refused(error):
            raise HoldRefused(
                f"hold {hold_id} or a run waiting on it is locked by another session: nothing "
                "was released; try again"
            ) from error
        raise
    for run_id in resumed:
        timeline.record(
            run_id, EventKind.RUN_REQUEUED, why, hold=hold.pk, released_by=hold.released_by
        )
    return Released(hold, resumed)


def _said(name: str, text: str) -> str:
    text = text.strip()
    if not text:
        raise HoldRefused(f"say why: a {name} is required")
    if len(text) > REASON_MAX:
        raise HoldRefused(f"the {name} is longer than {REASON_MAX} characters")
    if UNSTORABLE.search(text):
        raise HoldRefused(f"the {name} holds a character no text can: NUL or a lone surrogate")
    return text


# -- a run at a held boundary -------------------------------------------------------


@dataclass(frozen=True)
class Waited:
    """How a run stopped by a hold ended its ownership: `status`
    needs_operator (or cancelled, a cancel asked meanwhile), with the
    reason its row says and the words its timeline names the wait by."""

    status: RunStatus
    reason: str
    named: str


def wait(run_id: int, held: Held, finish: Callable[[RunStatus, str], RunStatus]) -> Waited | None:
    """The run stopped by `held` waits on its hold: `finish` (its owner's
    Lease.finish) ends the ownership as needs_operator, and its HoldWait
    row is written, in one transaction with the hold locked FOR SHARE.
    None when the hold was released meanwhile (the run is to go on at
    once)."""
    with transaction.atomic():
        with server_cursor() as cursor:
            # FOR SHARE: runs stopped by one hold wait on it side by side;
            # its release (an UPDATE) waits for them, or they for it.
            cursor.execute(
                "SELECT id FROM runs_hold WHERE id = %s AND released_at IS NULL FOR SHARE",
                [held.hold_id],
            )
            if cursor.fetchone() is None:
                return None
        hold = Hold.objects.get(pk=held.hold_id)
        reason = held_words(held.tool, hold)
        ended = finish(RunStatus.NEEDS_OPERATOR, reason)
        if ended == RunStatus.NEEDS_OPERATOR:
            # An operator who resumed the run while it was held (it came
            # back here) ended its earlier wait.
            HoldWait.objects.filter(run_id=run_id, until__isnull=True).update(until=Now())
            HoldWait.objects.create(hold=hold, run_id=run_id, step_key=held.step_key)
    return Waited(ended, reason, who_held_words(held.tool, hold.added_by))


# -- what operators see ---------------------------------------------------------------


@dataclass(frozen=True)
class Audit:
    """A hold's figures: the runs waiting on it now, the runs that waited on
    it in all, and how long they waited (together, and the longest; a wait
    that goes on counts until `now`)."""

    hold: Hold
    waiting: int
    waited: int
    seconds: float
    longest: float

    @property
    def scope(self) -> str:
        return scope_words(self.hold.tool, self.hold.agent)


def audited(holds: QuerySet[Hold], now: dt.datetime) -> list[Audit]:
    """Each of `holds` with its figures, from its HoldWait rows."""
    lasted = ExpressionWrapper(
        Coalesce(F("waits__until"), Value(now)) - F("waits__since"),
        output_field=DurationField(),
    )
    rows = holds.annotate(
        # A run cancelled while it waited waits no more (its wait ends at
        # the release, as its end).
        n_waiting=Count(
            "waits",
            filter=Q(waits__until__isnull=True, waits__run__status=RunStatus.NEEDS_OPERATOR),
        ),
        n_waited=Count("waits__run", distinct=True),
        total=Sum(lasted),
        longest=Max(lasted),
    )
    return [
        Audit(
            hold,
            hold.n_waiting,
            hold.n_waited,
            hold.total.total_seconds() if hold.total else 0.0,
            hold.longest.total_seconds() if hold.longest else 0.0,
        )
        for hold in rows
    ]


# Released holds listed on the holds page and by `holds list`: the newest this many.
RELEASED_SHOWN = 50


def listing(now: dt.datetime) -> tuple[list[Audit], list[Audit]]:
    """The active holds (newest first) and the newest released ones."""
    active = audited(Hold.objects.active(), now)
    newest = Hold.objects.released().order_by("-released_at", "-id")[:RELEASED_SHOWN]
    released = audited(Hold.objects.filter(pk__in=newest).order_by("-released_at", "-id"), now)
    return active, released


def waiting_on(hold_ids: list[int]) -> dict[int, list[HoldWait]]:
    """The open waits of each hold, oldest first, with their runs."""
    waits: dict[int, list[HoldWait]] = {}
    rows = HoldWait.objects.filter(
        hold_id__in=hold_ids, until__isnull=True, run__status=RunStatus.NEEDS_OPERATOR
    )
    for wait in rows.select_related("run").order_by("since", "id"):
        waits.setdefault(wait.hold_id, []).append(wait)
    return waits


@dataclass(frozen=True)
class Waiting:
    """An active hold with runs waiting on it: the oldest WAITS_SHOWN of
    them, and how many in all (audit.waiting)."""

    audit: Audit
    waits: list[HoldWait]

    @property
    def said(self) -> str:
        count = self.audit.waiting
        runs = "1 run waits" if count == 1 else f"{count} runs wait"
        return f"{runs} on it"


# The runs listed under a hold that they wait on: the oldest this many.
WAITS_SHOWN = 20


def waiting(now: dt.datetime) -> list[Waiting]:
    """The active holds runs wait on, the oldest first, each with its runs:
    how the inbox and "Needs you" group them."""
    audits = [
        a for a in audited(Hold.objects.active().order_by("added_at", "id"), now) if a.waiting
    ]
    waits = waiting_on([audit.hold.pk for audit in audits])
    return [Waiting(audit, waits.get(audit.hold.pk, [])[:WAITS_SHOWN]) for audit in audits]


def open_wait(run: Run) -> HoldWait | None:
    """The hold a run waits on now, if it waits on one."""
    if run.status != RunStatus.NEEDS_OPERATOR:
        return None
    return HoldWait.objects.filter(run=run, until__isnull=True).select_related("hold").first()


def waits_on_words(wait: HoldWait) -> str:
    """What a held run's page says of its wait."""
    hold = wait.hold
    return (
        f"Waits at {wait.step_key} on hold {hold.pk} ({scope_words(hold.tool, hold.agent)}, "
        f"held by {hold.added_by}): releasing the hold sends it on; resuming it here brings "
        "it back to the same hold."
    )


def as_json(audit: Audit) -> dict[str, Any]:
    hold = audit.hold
    return {
        "id": hold.pk,
        "tool": hold.tool or None,
        "agent": hold.agent or None,
        "holds": audit.scope,
        "reason": hold.reason,
        "added_by": hold.added_by,
        "added_at": hold.added_at.isoformat(),
        "in_flight": hold.in_flight,
        "released_by": hold.released_by or None,
        "released_at": hold.released_at.isoformat() if hold.released_at else None,
        "release_reason": hold.release_reason or None,
        "runs_waiting": audit.waiting,
        "runs_waited": audit.waited,
        "waited_seconds": round(audit.seconds, 3),
        "longest_wait_seconds": round(audit.longest, 3),
    }

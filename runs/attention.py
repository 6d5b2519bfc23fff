"""What needs an operator now: the lines of the "Needs you" page, and the
choices that let a run waiting for an operator go on.

Each line is something a person must act on (a run waiting for an
operator, a run whose owner stopped renewing its lease, an open item of a
run that has not ended, an alert that cannot reach the operators, a bundle
export that failed, a drill scenario that failed), oldest first, so the
longest wait is read first.  Drills' runs and items are left out, as the
inbox leaves them out: a drill staged them on purpose (the drills page
reports it); a drill scenario that failed is a line of its own."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Generic, TypeVar

from django.db.models import Exists, OuterRef

from evidence.models import BundleExport
from runs import holds
from runs.decisions import Offer, gather, offers
from runs.inbox import Blocks, blocks, items_listed, what
from runs.models import (
    Alert,
    Drill,
    DrillResult,
    DrillState,
    DrillVerdict,
    HoldWait,
    OutcomeItem,
    Run,
    RunStatus,
)

# Lines shown per section: the oldest this many (the section says how many
# there are in all).
SHOWN = 50


T = TypeVar("T")


@dataclass(frozen=True)
class Section(Generic[T]):
    lines: list[T]  # the oldest SHOWN
    total: int


@dataclass(frozen=True)
class WaitingRun:
    """A run that waits for an operator, since when, and the open items
    that hold it (none: only a decision on the run lets it go on)."""

    run: Run
    since: dt.datetime
    items: list[int]


@dataclass(frozen=True)
class LeaseLost:
    """A running run whose owner stopped renewing its lease."""

    run: Run
    expired_at: dt.datetime


@dataclass(frozen=True)
class ItemLine:
    item: OutcomeItem
    what: str
    blocks: Blocks


@dataclass(frozen=True)
class DrillFailures:
    drill: Drill
    failed: list[DrillResult]


@dataclass(frozen=True)
class Attention:
    now: dt.datetime
    waiting: Section[WaitingRun]
    lease_lost: Section[LeaseLost]
    items: Section[ItemLine]
    alerts: Section[Alert]
    exports: Section[BundleExport]
    drill: DrillFailures | None
    held: list[holds.Waiting]  # active holds runs wait on

    @property
    def nothing(self) -> bool:
        """Nothing needs anyone."""
        sections = [self.waiting, self.lease_lost, self.items, self.alerts, self.exports]
        return (
            all(section.total == 0 for section in sections) and self.drill is None and not self.held
        )


def needing_you(now: dt.datetime) -> Attention:
    """Everything that needs an operator at `now`."""
    # A run waiting on a hold is said under its hold (`held`), not one by one.
    waiting_runs = (
        Run.objects.local()
        .filter(status=RunStatus.NEEDS_OPERATOR, is_drill=False)
        .exclude(Exists(HoldWait.objects.filter(run=OuterRef("pk"), until__isnull=True)))
    )
    waiting_page = list(
        waiting_runs.only(
            "status", "status_reason", "question", "updated_at", "imported_at"
        ).order_by("updated_at", "id")[:SHOWN]
    )
    holding: dict[int, list[int]] = {}
    for run_id, item_id in (
        OutcomeItem.objects.holding_runs()
        .filter(run__in=waiting_page)
        .order_by("created_at", "id")
        .values_list("run_id", "pk")
    ):
        holding.setdefault(run_id, []).append(item_id)

    lost = Run.objects.abandoned().filter(is_drill=False)
    lost_page = list(
        lost.only(
            "status", "question", "lease_owner", "lease_epoch", "lease_expires_at", "imported_at"
        ).order_by("lease_expires_at", "id")[:SHOWN]
    )

    items = OutcomeItem.objects.in_inbox().needing_someone()
    item_page = list(items_listed(items).order_by("created_at", "id")[:SHOWN])

    alerts = Alert.objects.failing().filter(item__run__is_drill=False)
    exports = BundleExport.objects.failing(now).filter(run__is_drill=False)

    return Attention(
        now=now,
        waiting=Section(
            [WaitingRun(run, run.updated_at, holding.get(run.pk, [])) for run in waiting_page],
            waiting_runs.count(),
        ),
        lease_lost=Section(
            [LeaseLost(run, run.lease_expires_at) for run in lost_page], lost.count()
        ),
        items=Section(
            [ItemLine(item, what(item), blocks(item)) for item in item_page], items.count()
        ),
        alerts=Section(list(alerts.select_related("item")[:SHOWN]), alerts.count()),
        exports=Section(list(exports[:SHOWN]), exports.count()),
        drill=_drill_failures(),
        held=holds.waiting(now),
    )


def _drill_failures() -> DrillFailures | None:
    """The last finished drill's failed scenarios, or None when it passed
    (or none has run).  A drill that stopped early is a failure too."""
    drill = Drill.objects.filter(state=DrillState.DONE).first()
    if drill is None:
        return None
    failed = list(drill.results.filter(verdict=DrillVerdict.FAILED).order_by("scenario"))
    if not failed and not drill.error:
        return None
    return DrillFailures(drill, failed)


# -- what lets a waiting run go on ---------------------------------------------------


@dataclass(frozen=True)
class ItemChoices:
    """An open item that holds a run, and what its page offers (asked of
    the evidence now, as the item page asks it)."""

    item: OutcomeItem
    what: str
    offers: list[Offer]


# The items of one run offered at the top of its page: the first this many.
UNBLOCKING_SHOWN = 10


def unblocking(run: Run) -> list[ItemChoices]:
    """The open items holding a run that waits for an operator, each with
    the choices its page offers; [] for any other run."""
    if run.status != RunStatus.NEEDS_OPERATOR or run.is_imported:
        return []
    held = items_listed(run.outcome_items.holding_runs()).order_by("created_at", "id")
    return [
        ItemChoices(item, what(item), offers(item, gather(item)))
        for item in held[:UNBLOCKING_SHOWN]
    ]

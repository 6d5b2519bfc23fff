"""What the fleet is doing now, for the overview: runs waiting and why,
open items by age, alerts failing, lease owners and their runs in flight,
capture gaps and lock incidents.  Each is read from a partial index or a
counter table, over the few rows in that state, never a scan of the runs
(what happened over time is in runs/summaries.py).

Drills' runs and items are left out, as the inbox and "Needs you" leave
them out; imported runs too (nothing here executes them)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from django.conf import settings
from django.db import connection
from django.db.models import Count, Max, Sum

from evidence.models import CaptureGapHour, LockIncident
from runs.models import HOLDING_KINDS, Alert, OutcomeState, Run, RunStatus

# The ages an open item is counted in, by their upper bound.
AGES = (
    ("under 5 minutes", dt.timedelta(minutes=5)),
    ("5 minutes to an hour", dt.timedelta(hours=1)),
    ("an hour to a day", dt.timedelta(days=1)),
    ("over a day", None),
)
# A waiting run that no open item holds: only a decision on the run lets it go on.
NO_ITEM = ""
# The reason of a run that waits at a held boundary (runs/holds.py: an open
# HoldWait, no item).
HOLD = "hold"


@dataclass(frozen=True)
class Waiting:
    """Runs waiting for an operator for one reason: the kind of the oldest
    open item that holds them (NO_ITEM: none holds it)."""

    reason: str
    runs: int
    oldest: dt.datetime


def waiting(now: dt.datetime) -> list[Waiting]:
    """Runs that wait for an operator, grouped by what holds them: any kind
    of item that holds a run (HOLDING_KINDS, and whatever kinds are added
    to it) is a reason of its own, and so is a tool hold (HOLD).  Served
    by run_status_listing_idx (the waiting runs only) and, per run, outcome
    items and hold waits by run."""
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT coalesce((SELECT kind FROM runs_outcomeitem i
                                WHERE i.run_id = r.id AND i.state = %s AND i.kind = ANY(%s)
                                ORDER BY i.created_at, i.id LIMIT 1),
                               (SELECT %s FROM runs_holdwait w
                                WHERE w.run_id = r.id AND w.until IS NULL LIMIT 1),
                               %s) AS reason,
                      count(*), min(r.updated_at)
               FROM runs_run r
               WHERE r.status = %s AND NOT r.is_drill AND r.imported_at IS NULL
               GROUP BY reason ORDER BY count(*) DESC, reason""",
            [OutcomeState.OPEN, list(HOLDING_KINDS), HOLD, NO_ITEM, RunStatus.NEEDS_OPERATOR],
        )
        return [Waiting(reason, runs, oldest) for reason, runs, oldest in cursor.fetchall()]


@dataclass(frozen=True)
class ItemAges:
    kind: str
    by_age: list[int]  # one count per AGES

    @property
    def total(self) -> int:
        return sum(self.by_age)


def open_items(now: dt.datetime) -> list[ItemAges]:
    """Open items of this installation's runs (the inbox's), by kind and
    age.  Served by outcome_open_idx."""
    ages = []
    for index, (_, bound) in enumerate(AGES):
        if bound is not None:
            ages.append(
                f"WHEN i.created_at > %(now)s - interval '{int(bound.total_seconds())} s'"
                f" THEN {index}"
            )
    with connection.cursor() as cursor:
        cursor.execute(
            f"""SELECT i.kind, CASE {" ".join(ages)} ELSE {len(AGES) - 1} END AS age, count(*)
                FROM runs_outcomeitem i JOIN runs_run r ON r.id = i.run_id
                WHERE i.state = %(open)s AND NOT r.is_drill AND r.imported_at IS NULL
                GROUP BY i.kind, age""",
            {"now": now, "open": OutcomeState.OPEN},
        )
        kinds: dict[str, list[int]] = {}
        for kind, age, n in cursor.fetchall():
            kinds.setdefault(kind, [0] * len(AGES))[age] = n
    return [ItemAges(kind, counts) for kind, counts in sorted(kinds.items())]


@dataclass(frozen=True)
class Owner:
    """A process (an executor or a Celery worker) that holds leases now:
    its runs in flight, its last renewal, and whether it is alive (a lease
    of its still valid)."""

    name: str
    runs: int
    renewed_at: dt.datetime
    alive: bool


def owners(now: dt.datetime) -> list[Owner]:
    """The owners of running runs.  An owner renews its leases every
    RUNDESK_LEASE_SECONDS / 3 in one statement: its last renewal is its
    latest expiry less the lease's length.  Served by run_running_lease_idx."""
    lease = dt.timedelta(seconds=settings.RUNDESK_LEASE_SECONDS)
    rows = (
        Run.objects.local()
        .filter(status=RunStatus.RUNNING, is_drill=False)
        .values("lease_owner")
        .annotate(runs=Count("*"), latest=Max("lease_expires_at"))
        .order_by("lease_owner")
    )
    return [
        Owner(row["lease_owner"], row["runs"], row["latest"] - lease, row["latest"] > now)
        for row in rows
    ]


def in_state() -> dict[str, int]:
    """Runs queued, running and waiting now (of this installation, drills
    left out).  Served by run_status_listing_idx, one status at a time."""
    active = [RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.NEEDS_OPERATOR]
    counts = dict.fromkeys(active, 0)
    for status in active:
        counts[status] = Run.objects.local().filter(status=status, is_drill=False).count()
    return counts


def alerts_failing() -> dict[str, int]:
    """Alerts whose last attempt failed, by channel.  Served by alert_due_idx."""
    rows = Alert.objects.failing().values("channel").annotate(n=Count("*")).order_by("channel")
    return {row["channel"]: row["n"] for row in rows}


def gaps_by_reason(since: dt.datetime) -> dict[str, int]:
    """Capture gaps since `since`, by reason, from the hourly counters."""
    rows = (
        CaptureGapHour.objects.filter(hour__gte=since)
        .values("reason")
        .annotate(n=Sum("count"))
        .order_by("-n", "reason")
    )
    return {row["reason"]: row["n"] for row in rows}


def lock_incidents(since: dt.datetime) -> dict[str, int]:
    """Lock incidents that started since `since`, by source.  Served by
    incident_time_idx."""
    rows = (
        LockIncident.objects.filter(started_at__gte=since)
        .values("source")
        .annotate(n=Count("*"))
        .order_by("source")
    )
    return {row["source"]: row["n"] for row in rows}

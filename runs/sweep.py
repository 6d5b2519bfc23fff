"""The sweep: what keeps a run from stalling when nobody drives it.

One home for it, run by an executor every RUNDESK_SWEEP_SECONDS, busy or
idle, when it takes the turn (`take_turn`: the installation's executors
sweep once or twice an interval between them, not each of them every
interval), and by Celery beat (runs.tasks.sweep) where only Celery workers
run:

- a running run whose cancel was asked and whose owner died ends as
  cancelled;
- a running run whose owner stopped renewing its lease goes back to the
  queue, to be resumed from its receipts;
- unknown outcomes are asked about again (runs/outcomes.py); what the
  evidence settles is a system decision (runs/decisions.py), and settling
  the last item a waiting run was held by puts it back in the queue;
- approvals not given within their tool's time are rejected as the system
  (runs/approvals.py), and their runs go on without the action;
- a checkpoint left unknown, with no item, by an owner that stopped while
  it asked the evidence is settled by its xid;
- with `redeliver_after`, queued runs of this process's kind nobody took for
  that long are handed out again: the backstop for a hand-over lost after
  the commit that made the run runnable (runs/handover.py);
- due alerts are sent (runs/alerts.py), after the settlements: an item
  evidence settled meanwhile is not announced;
- the overview's summaries are rolled up from their cursors
  (runs/summaries.py).

Every run it makes runnable again (requeued, resumed) is handed to a Celery
worker when its transaction commits (runs/lifecycle.py).

Each step is fenced like a claim, so a sweep racing an executor, another
sweep or an old owner that wakes up changes each run once.  Each waits for
a lock at most decisions.LOCK_WAIT (a row or a table a stranger holds): a
step that cannot have its lock is left to the next sweep, and the others go
on, so the executor that runs the sweep is never held up by it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from django.conf import settings
from django.db import DatabaseError

from runs import alerts, approvals, decisions, lifecycle, summaries
from runs.models import Run
from runs.outcomes import settle_left_checkpoints
from runs.sql import changes_rows_waits_bounded, waits_bounded
from runs.timeline import EventKind, timeline

logger = logging.getLogger(__name__)


# An executor whose sweep is due sweeps only if nobody swept for half an
# interval (the server's clock, the same for every host): alone, it sweeps
# every interval, as it did; with N executors the installation sweeps once
# or twice an interval, where it swept N times (each sweep asks about every
# open item again).  While any executor runs, no interval and a half passes
# without a sweep: the one that swept last is due again an interval later,
# and takes the turn unless another swept since.  Two executors due at once:
# the upsert of one waits for the other's row lock, then finds it taken.
# Celery beat takes the turn `always` (its sweep also hands out runs again,
# which an executor's does not): executors due just after leave theirs.
# A turn dated ahead of the server's clock (a clock set back, a failover
# to a server behind) is taken too: it would stop every executor's sweep
# until the clock caught up.  The row says when anyone last swept:
# /metrics shows it.
TAKE_TURN_SQL = """INSERT INTO runs_sweepturn AS turn (id, started_at, taken_by)
    VALUES (1, statement_timestamp(), %(owner)s)
    ON CONFLICT (id) DO UPDATE SET started_at = excluded.started_at, taken_by = excluded.taken_by
    WHERE %(always)s
        OR turn.started_at <= excluded.started_at - make_interval(secs => %(gap)s)
        OR turn.started_at > excluded.started_at + make_interval(secs => %(gap)s)"""


def take_turn(owner: str, *, always: bool = False) -> bool:
    """Whether `owner`, its sweep due, sweeps now: nobody swept for half of
    RUNDESK_SWEEP_SECONDS, or `always` (taken, the turn is recorded).  The
    turn only ever saves a sweep, never stops one: a lock on its row held
    past decisions.LOCK_WAIT (a stranger's), or any database error, and
    the owner sweeps anyway, as every executor did before turns (its
    steps say what fails)."""
    params = {"owner": owner, "gap": settings.RUNDESK_SWEEP_SECONDS / 2, "always": always}
    try:
        return changes_rows_waits_bounded(TAKE_TURN_SQL, params, decisions.LOCK_WAIT) > 0
    except DatabaseError as error:
        logger.warning("sweep: its turn not taken, sweeping anyway: %s", str(error).strip())
        return True


@dataclass
class Swept:
    cancelled: list[int] = field(default_factory=list)
    requeued: list[int] = field(default_factory=list)
    settled: int = 0
    resumed: list[int] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)  # runs of those settled
    redelivered: list[int] = field(default_factory=list)
    alerted: list[int] = field(default_factory=list)  # alerts sent
    # Runs resumed because their approval expired (a system rejection).
    approvals_expired: list[int] = field(default_factory=list)
    rolled: int = 0  # ended runs added to the summaries


def sweep(*, redeliver_after: float | None = None) -> Swept:
    swept = Swept()
    swept.cancelled = _step("ending abandoned cancels", lifecycle.end_abandoned_cancels)
    for run_id in swept.cancelled:
        timeline.record(run_id, EventKind.RUN_CANCELLED, "cancelled: its owner had stopped")
    swept.requeued = _step("requeueing abandoned runs", lifecycle.requeue_abandoned)
    for run_id in swept.requeued:
        timeline.record(run_id, EventKind.RUN_REQUEUED, lifecycle.REQUEUE_WHY)
    settled = decisions.settle_open_items()
    swept.settled, swept.resumed = settled.settled, settled.runs_resumed
    swept.approvals_expired = approvals.expire_due()
    swept.checkpoints = _step("settling checkpoints left unknown", settle_left_checkpoints)
    if redeliver_after is not None:
        swept.redelivered = _step(
            "handing out queued runs again",
            lambda: Run.objects.waiting_in_queue(redeliver_after),
        )
    # Not a _step: no transaction may be open while an alert is sent.
    swept.alerted = alerts.deliver_due().sent
    # Last: the overview's summaries; a roll-up that fails is left to the next sweep.
    swept.rolled = sum(_step("rolling up the summaries", lambda: [summaries.roll_up().ended]))
    return swept


def _step(what: str, work: Callable[[], list[int]]) -> list[int]:
    """One step, its lock waits bounded: the runs it changed.  One that
    fails (a lock, the database gone) is logged and left to the next sweep;
    the others go on."""
    try:
        with waits_bounded(decisions.LOCK_WAIT):
            return work()
    except DatabaseError as error:
        logger.warning("sweep: %s left to the next sweep: %s", what, str(error).strip())
        return []

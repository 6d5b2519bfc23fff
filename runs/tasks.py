"""Celery tasks.  They take ids, not objects, and are idempotent: the lease
makes a redelivered task safe (a run another owner holds is not claimable).

With only Celery workers (no `manage.py executor`), two things keep a run
from stalling: `execute_run` retries while the run is active and its owner
may be dead (its lease is valid but no longer renewed: the broker handed the
task out again before it expired), and beat's `sweep` requeues what is left.
Beat runs the sweep itself (`SweepingScheduler`): sent as a task, it would
wait in the queue behind every run queued before it.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task
from celery.beat import PersistentScheduler, ScheduleEntry
from celery.signals import worker_process_shutdown, worker_shutdown
from django.conf import settings
from django.db import close_old_connections
from django.utils import timezone

from evidence.capture import capture
from runs import bulk, retention
from runs import sweep as sweeping
from runs.drills import report, run_drill
from runs.executor import Ending, claim_and_drive
from runs.handover import hand_over
from runs.leases import new_owner_name
from runs.models import Drill, Run
from runs.timeline import timeline

logger = logging.getLogger(__name__)

# How many times a task comes back for a run it could not claim: enough to
# outlast a dead owner's lease a few times over, never forever.
CLAIM_RETRIES = 10


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=CLAIM_RETRIES)
def execute_run(self: Any, run_id: int, seen_expiry: str | None = None) -> str:
    ending = claim_and_drive(run_id)
    if ending != Ending.NOT_CLAIMABLE:
        return ending.value
    retry = Run.objects.claim_retry(run_id, seen_expiry)
    if retry is None or self.request.retries >= CLAIM_RETRIES:
        return ending.value
    countdown, expiry = retry
    # Both args and kwargs: given kwargs alone, Celery 5.5 (pyproject allows
    # >=5.4) keeps the task's positional run_id too, and the retry fails with
    # "got multiple values for argument 'run_id'".
    raise self.retry(args=(run_id,), kwargs={"seen_expiry": expiry}, countdown=countdown)


@shared_task
def sweep() -> dict[str, int]:
    """Beat's sweep (runs/sweep.py), which hands out again the runs that
    waited in the queue too long.  It sweeps every interval, and says so
    (the installation's turn): executors due just after leave theirs."""
    sweeping.take_turn(f"beat {new_owner_name()}", always=True)
    swept = sweeping.sweep(redeliver_after=settings.RUNDESK_REDELIVER_SECONDS)
    # The runs it requeued or resumed were handed over as their
    # transactions committed (runs/lifecycle.py); those it hands out again
    # are of this process's kind only (a drill's lab, or the installation:
    # RUNDESK_DRILL_LAB), to its own queue.
    for i, run_id in enumerate(swept.redelivered):
        if failed := hand_over(execute_run, run_id):
            # The broker did not take it (each hand-over waits for it up to
            # its timeout and retries): the rest would wait as long.  They
            # are queued, and the sweep hands them out again later.
            logger.warning(
                "sweep: runs %s not handed to Celery (%s): handed out again in about %s s",
                swept.redelivered[i:],
                failed,
                settings.RUNDESK_REDELIVER_SECONDS,
            )
            break
    return {
        "cancelled": len(swept.cancelled),
        "requeued": len(swept.requeued),
        "settled": swept.settled,
        "resumed": len(swept.resumed),
        "redelivered": len(swept.redelivered),
    }


class SweepingScheduler(PersistentScheduler):
    """Celery beat (CELERY_BEAT_SCHEDULER), which runs the sweep in its own
    process instead of sending it.  A task would go into the queue of the
    runs, where workers (acks_late, prefetch 1) take one message at a time:
    a sweep would wait behind every run queued before it, and while it
    waited, a dead owner's cancelled run would stay running, a settled run
    would stay waiting, and one more sweep would pile up every interval.
    Other entries are sent as usual."""

    def apply_async(
        self, entry: ScheduleEntry, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> Any:
        if entry.task != sweep.name:
            return super().apply_async(entry, producer, advance, **kwargs)
        if advance:
            self.reserve(entry)
        # Beat lives for weeks: a connection the server closed meanwhile is
        # replaced, as Django does around each request.
        close_old_connections()
        try:
            sweep()
        finally:
            close_old_connections()
        return None


@worker_process_shutdown.connect  # a prefork pool's process
@worker_shutdown.connect  # the worker itself: its threads pool's runs ran in it
def _write_what_is_left(**kwargs: Any) -> None:
    """A worker process that stops writes its queued events, and turns the
    records capture could not save into `shutdown` gaps."""
    timeline.stop()
    capture.stop()


@shared_task
def drill(drill_id: int) -> str:
    """A drill started from the drills page (its results appear as they come).
    A drill this database does not hold (a message left on the broker by
    another database's installation) is said and left."""
    started = Drill.objects.filter(pk=drill_id).first()
    if started is None:
        logger.warning("no drill %s in this database: its task is left", drill_id)
        return f"no drill {drill_id} here"
    return str(report(run_drill(started)))


@shared_task(acks_late=True, reject_on_worker_lost=True)
def bulk_job(job_id: int) -> str:
    """Carries out a bulk job's runs (runs/bulk.py).  Idempotent: another
    delivery of it takes the items still pending, or finds the job ended."""
    return bulk.process(job_id)


@shared_task
def redeliver_bulk_jobs() -> int:
    """Beat's look for bulk jobs no worker moves (a worker died mid-job, or
    the task was lost): each is handed out again, and its pending items
    are carried on from where they stopped."""
    stalled = list(bulk.BulkJob.objects.stalled(timezone.now()).values_list("pk", flat=True))
    for job_id in stalled:
        if failed := hand_over(bulk_job, job_id):
            logger.warning("bulk job %s not handed out again (%s)", job_id, failed)
    return len(stalled)


@shared_task
def purge_runs() -> dict[str, Any]:
    """Beat's daily retention (runs/retention.py), when RUNDESK_PURGE_AFTER
    is set: the runs ended longer ago go, each bundle written first into
    RUNDESK_PURGE_BUNDLE_DIR when that is set.  Idempotent: a second run
    finds nothing more to remove."""
    if settings.RUNDESK_PURGE_AFTER is None:
        return {"off": "RUNDESK_PURGE_AFTER is not set: nothing is removed"}
    purged = retention.purge(
        settings.RUNDESK_PURGE_AFTER, bundle_to=settings.RUNDESK_PURGE_BUNDLE_DIR
    )
    for refused in purged.refused:
        logger.warning("purge: run %s kept: %s", refused.run_id, refused.why)
    if purged.stopped:
        logger.warning("purge: stopped early: %s", purged.stopped)
    summary = purged.json()
    del summary["run_ids"]  # a day's worth of ids is no task result
    return summary

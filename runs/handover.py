"""Handing work to the Celery workers once its rows are committed.

A run that becomes runnable (runs/lifecycle.py: every transition into
`queued`) is handed over after its transaction commits, whatever made it
runnable and wherever: an executor, a Celery worker, beat's sweep, a page,
a command.  Every deployment runs at least one Celery worker (it also runs
the bundle exports and the drills); where executors run too, the first to
claim the run drives it and the task finds it not claimable (tasks are
idempotent by run id, claims skip locked rows).  A hand-over lost with a
broker that did not answer, or a process that died after the commit, is
made good by the sweep's redelivery (runs/sweep.py): the run's `queued_at`
is the durable record, written with the transition.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery import current_app
from django.conf import settings

logger = logging.getLogger(__name__)

EXECUTE_RUN = "runs.tasks.execute_run"
# The installation's queue as the settings name it (dashboard/settings.py:
# CELERY_TASK_DEFAULT_QUEUE), which a drill's lab makes RUNDESK_DRILL_QUEUE
# for itself.
INSTALLATION_QUEUE = "celery"


def hand_over(task: Any, *args: Any) -> str:
    """Sends `task` to the workers, its rows already committed: "" once the
    broker took it, else why not.  Whatever the broker's client raises is
    said, never raised: what was recorded stays, and its caller says what
    happens to it."""
    return _sent(lambda: task.delay(*args))


def queue_of(is_drill: bool) -> str:
    """The queue whose workers may drive a run of this kind: a drill's runs
    only its lab's (RUNDESK_DRILL_LAB), the installation's only its own.
    Outside a lab the installation's queue is the app's default one, as its
    workers were started with it (a deployment, or a benchmark's workers on
    a queue of their own, may name another than the settings')."""
    if is_drill:
        return settings.RUNDESK_DRILL_QUEUE
    return INSTALLATION_QUEUE if settings.RUNDESK_DRILL_LAB else current_app.conf.task_default_queue


def hand_over_run(run_id: int, is_drill: bool) -> str:
    """execute_run(run_id) on the queue of the run's kind, sent by name (no
    import of the tasks, which sit above everything that makes a run
    runnable): "" once the broker took it, else why not (logged)."""
    failed = _sent(
        lambda: current_app.send_task(EXECUTE_RUN, args=[run_id], queue=queue_of(is_drill))
    )
    if failed:
        logger.warning(
            "run %s is queued but was not handed to Celery (%s): the sweep hands it out "
            "again within %g s",
            run_id,
            failed,
            settings.RUNDESK_REDELIVER_SECONDS,
        )
    return failed


def _sent(send: Callable[[], object]) -> str:
    try:
        send()
    except Exception as error:  # kombu, redis, amqp: each raises its own
        return f"{type(error).__name__}: {error}"
    return ""

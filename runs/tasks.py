"""Celery tasks.  They take ids, not objects, and are idempotent: the lease
makes a redelivered task safe (a run another owner holds is not claimable)."""

from __future__ import annotations

from typing import Any

from celery import shared_task
from celery.signals import worker_process_shutdown

from evidence.capture import capture
from runs.executor import execute
from runs.timeline import timeline


@shared_task(acks_late=True, reject_on_worker_lost=True)
def execute_run(run_id: int) -> str:
    return execute(run_id)


@worker_process_shutdown.connect
def _write_what_is_left(**kwargs: Any) -> None:
    """A worker process that stops writes its queued events, and turns the
    copies capture could not save into `shutdown` gaps."""
    timeline.stop()
    capture.stop()

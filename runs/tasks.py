"""Celery tasks.  They take ids, not objects, and are idempotent: the lease
makes a redelivered task safe (a run another owner holds is not claimable)."""

from __future__ import annotations

from celery import shared_task

from runs.executor import execute


@shared_task(acks_late=True, reject_on_worker_lost=True)
def execute_run(run_id: int) -> str:
    return execute(run_id)

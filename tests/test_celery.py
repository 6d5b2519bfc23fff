"""The same execute(run_id) as a Celery task, with real worker processes.

Celery-only deployments recover by themselves: a task that meets a run whose
dead owner's lease is still valid retries until it expires, a task for a run
a live owner holds is dropped, and beat's sweep requeues a run whose worker
was killed (kombu's filesystem broker has no acks: the killed worker's task
is gone with it).

The workers look at the broker's folder every 50 ms (`polled_often`), and
are killed once what a test asserts is written: Celery notices a SIGTERM
only when its loop next wakes, 3 s later on this broker.
"""

from __future__ import annotations

import os
import threading

import pytest
from django.db import connection

from runs.executor import drive
from runs.leases import Lease
from runs.models import Action, AnswerRevision, Receipt, Run, RunEvent, RunStatus
from runs.submission import submit
from runs.timeline import EventKind
from tests.processes import Worker, enqueue, polled_often, wait_until

# The filesystem broker's fixture (tests/test_bundle_export_flow.py takes it from here).
from tests.processes import broker as broker

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

DOCS = ["northwind-clean-energy.md", "meridian-world-equity.md", "crestline-short-treasury.md"]


def status(run: Run) -> str:
    return Run.objects.values_list("status", flat=True).get(pk=run.pk)


def test_real_worker_executes_a_run_and_a_redelivered_task_changes_nothing(
    process_env, journal, tmp_path, broker
):
    run = submit(question="q", documents=["northwind-clean-energy.md"])
    # The same task twice: as after a redelivery (acks_late).
    enqueue(run.pk)
    enqueue(run.pk)
    worker = Worker(process_env, tmp_path / "worker.log", broker=polled_often())
    try:
        wait_until(lambda: status(run) == RunStatus.COMPLETED, 60, "run not completed", worker)
        # The second task is consumed too.
        wait_until(lambda: not any(broker.iterdir()), 60, "second task not consumed", worker)
        wait_until(lambda: "'not_claimable'" in worker.output(), 10, "no second task", worker)
    finally:
        worker.kill()
    output = worker.output()
    run.refresh_from_db()
    assert run.lease_epoch == 1  # claimed once
    assert sum(journal.counts().values()) == 4  # read, summarize, compose, deliver: once each
    assert "'completed'" in output and "'not_claimable'" in output


def test_a_worker_killed_mid_run_is_recovered_by_beat_with_no_executor(
    process_env, journal, tmp_path, broker
):
    env = {**process_env, "RUNDESK_SWEEP_SECONDS": "0.5"}
    run = submit(
        question="Compare these funds", documents=DOCS, faults=[{"point": "tool_delay", "ms": 200}]
    )
    enqueue(run.pk)
    a = Worker(env, tmp_path / "worker-a.log", broker=polled_often(), beat=True)
    b = None
    try:
        # Killed mid-run: running, at least one action completed, more to come.
        wait_until(
            lambda: status(run) == RunStatus.RUNNING and Receipt.objects.filter(run=run).exists(),
            40,
            "worker A did not start the run",
            a,
        )
        a.kill()
        completed_before = set(Receipt.objects.filter(run=run).values_list("step_key", flat=True))
        assert status(run) == RunStatus.RUNNING and "deliver" not in completed_before

        # Another worker with beat, and no `manage.py executor` anywhere.
        b = Worker(env, tmp_path / "worker-b.log", broker=polled_often(), beat=True)
        wait_until(lambda: status(run) == RunStatus.COMPLETED, 40, "run not recovered", b)
        # Its timeline says why it moved again (written off the main path).
        wait_until(
            lambda: (
                RunEvent.objects.filter(run=run, kind=EventKind.RUN_REQUEUED).exists()
                and RunEvent.objects.filter(run=run, kind=EventKind.RUN_COMPLETED).exists()
            ),
            10,
            "no run_requeued event",
            b,
        )
    finally:
        a.kill()
        if b is not None:
            b.kill()

    run.refresh_from_db()
    # A held epoch 1; the sweep requeued the run, B claimed it with epoch 2.
    assert run.lease_epoch == 2
    final = AnswerRevision.objects.get(run=run, is_final=True)
    # All three documents made it into the report: none was dropped on the way.
    assert final.epoch == 2 and "Not included" not in final.content
    # The report was delivered once, and it is the final answer.
    outbox = tmp_path / "outbox"
    reports = [p for p in outbox.iterdir() if not p.name.startswith(".")]
    assert len(reports) == 1 and reports[0].read_text() == final.content

    counts = journal.counts()
    identity = f"rundesk:run-{run.pk}:{{}}".format
    assert counts[identity("deliver")] == 1
    # Nothing completed before the kill was executed again: B reused its receipts.
    assert {key: counts[identity(key)] for key in completed_before} == dict.fromkeys(
        completed_before, 1
    )
    # Every step of the run ran; only a read in flight at the kill (no
    # receipt) may have run twice.
    steps = [f"{kind}:{i}" for i in range(len(DOCS)) for kind in ("read", "summarize")]
    assert set(counts) == {identity(key) for key in [*steps, "compose", "deliver"]}
    assert all(n in (1, 2) for n in counts.values())
    assert set(Action.objects.filter(run=run).values_list("state", flat=True)) == {"completed"}
    reused = RunEvent.objects.filter(run=run, kind=EventKind.ACTION_REUSED)
    assert reused.count() >= len(completed_before)


def test_a_task_redelivered_while_the_dead_owners_lease_is_still_valid_retries_until_it_expires(
    process_env, journal, tmp_path, broker, settings
):
    run = submit(question="q", documents=DOCS[:1])
    worker = Worker(process_env, tmp_path / "worker.log", broker=polled_often())
    try:
        worker.wait_ready()
        # An owner that claimed the run and died at once: its lease stays
        # valid for 2.5 s (the task comes within 0.1 s), and nobody renews it.
        settings.RUNDESK_LEASE_SECONDS = 2.5
        dead = Lease.claim(run.pk, "dead-owner")
        assert dead is not None and dead.epoch == 1
        expired_at = Run.objects.values_list("lease_expires_at", flat=True).get(pk=run.pk)
        enqueue(run.pk)
        wait_until(lambda: status(run) == RunStatus.COMPLETED, 30, "run not completed", worker)
        wait_until(lambda: "'completed'" in worker.output(), 10, "task not logged", worker)
    finally:
        worker.kill()
    output = worker.output()

    # The task came while the lease was valid, was not consumed as
    # not_claimable, but came back once the lease had expired.
    assert "Retry in" in output
    assert "'not_claimable'" not in output
    run.refresh_from_db()
    assert run.lease_epoch == 2 and not dead.held()
    # Nothing was dispatched while the dead owner's lease was valid.
    first = Action.objects.filter(run=run).order_by("dispatched_at").first()
    assert first is not None and first.dispatched_at >= expired_at
    assert AnswerRevision.objects.filter(run=run, is_final=True, epoch=2).exists()
    assert sorted(journal.counts().values()) == [1, 1, 1, 1]


def test_a_task_for_a_run_a_live_owner_holds_is_dropped_not_retried_forever(
    process_env, journal, tmp_path, broker, settings
):
    run = submit(question="q", documents=DOCS[:1])
    worker = Worker(process_env, tmp_path / "worker.log", broker=polled_often())
    # Renewed every 0.5 s: 1.5 s of slack for the renewing thread.
    settings.RUNDESK_LEASE_SECONDS = 2
    live = Lease.claim(run.pk, "live-owner")
    assert live is not None
    stop, lost = threading.Event(), threading.Event()

    def renew() -> None:
        try:
            while not stop.wait(0.5):
                if not live.renew():
                    lost.set()
                    return
        finally:
            connection.close()

    renewer = threading.Thread(target=renew, name="live-owner")
    renewer.start()
    try:
        worker.wait_ready()
        enqueue(run.pk)
        wait_until(lambda: "'not_claimable'" in worker.output(), 30, "task not dropped", worker)
        worker.kill()
        output = worker.output()

        # It looked again once the lease could have expired, saw it renewed,
        # and ended; it did not retry until CLAIM_RETRIES ran out.
        done = [line for line in output.splitlines() if "succeeded in" in line]
        assert len(done) == 1 and "'not_claimable'" in done[0]
        assert 1 <= output.count("Retry in") <= 2
        # The live owner still holds the run, and nothing ran in the worker.
        assert not lost.is_set()
        run.refresh_from_db()
        assert (run.status, run.lease_owner, run.lease_epoch) == ("running", "live-owner", 1)
        assert not journal.entries()
    finally:
        stop.set()
        renewer.join()
        worker.kill()

    # The live owner finishes the run through its lease (its heartbeat takes
    # over from the renewing thread).
    assert drive(live, threading.Event()) == RunStatus.COMPLETED
    run.refresh_from_db()
    assert (run.status, run.lease_epoch) == (RunStatus.COMPLETED, 1)
    assert AnswerRevision.objects.filter(run=run, is_final=True, epoch=1).exists()
    assert sorted(journal.counts().values()) == [1, 1, 1, 1]
    assert {e["pid"] for e in journal.entries()} == {os.getpid()}


def test_a_workers_log_lines_are_written_once_each(process_env, tmp_path, broker):
    """A run whose checkpoint loses its connection at COMMIT (the demo's
    row 2): the worker's pool discards the dead connection and says so,
    once, in the project's form; Celery's root handler does not repeat it."""
    run = submit(
        question="q",
        documents=DOCS[:2],
        faults=[{"point": "drop_connection_at_commit", "write": "checkpoint", "action": 2}],
    )
    enqueue(run.pk)
    worker = Worker(process_env, tmp_path / "worker.log", broker=polled_often())
    try:
        wait_until(lambda: status(run) == RunStatus.COMPLETED, 60, "run not completed", worker)
    finally:
        worker.kill()
    lines = [
        line for line in worker.output().splitlines() if "discarding closed connection" in line
    ]
    assert lines, worker.output()
    assert all(" WARNING psycopg.pool: discarding closed connection" in line for line in lines), (
        lines
    )

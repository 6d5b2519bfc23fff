"""No statement of the main path reads, writes or locks an evidence table,
directly or through a foreign key: a lock of any mode that anyone holds on
evidence, for any time, costs a run nothing.  What capture could not save
meanwhile is counted as gaps, never as saved.  Real concurrent sessions."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
from django.db import connection

from evidence.capture import capture
from evidence.models import CaptureGap, CaptureStats, EvidenceCopy, ModelCall
from evidence.records import record_model_call
from runs.background import GAP_INTERVAL
from runs.executor import claim_and_drive
from runs.harness import evidence_tables
from runs.leases import Lease
from runs.models import AnswerRevision, Run, RunStatus
from runs.submission import submit
from runs.timeline import EventKind, timeline
from tests.conftest import database_url
from tests.faultruns import DOCS, KEYS, events, executions, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@contextmanager
def another_session(*statements: str) -> Iterator[psycopg.Connection]:
    """Another session runs `statements` and keeps their locks, in an open
    transaction, until the block ends."""
    with psycopg.connect(database_url()) as other:
        other.execute("SET application_name = 'a stranger'")
        for statement in statements:
            other.execute(statement)
        yield other
        other.rollback()


def execute_within(run: Run, seconds: float) -> str:
    """Executes the run on another thread; fails the test if it does not end
    within `seconds` (a run held by a lock would wait forever)."""
    outcome: list[str] = []

    def work() -> None:
        try:
            outcome.append(claim_and_drive(run.pk))
        finally:
            connection.close()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"run {run.pk} did not end within {seconds} s: something waited on a lock"
    return outcome[0]


@pytest.mark.parametrize("mode", ["SHARE", "ACCESS EXCLUSIVE"])
def test_every_evidence_table_locked_for_the_whole_run_never_holds_it(journal, mode, settings):
    # The gaps as they stand, with no try again (tests/test_capture_retry.py
    # tries them again).
    settings.RUNDESK_CAPTURE_RETRY_QUEUE = 0
    tables = evidence_tables()
    assert "evidence_modelcall" in tables and len(tables) >= 8
    run = submit(question="Compare these funds", documents=DOCS)
    with another_session(f"LOCK TABLE {', '.join(tables)} IN {mode} MODE"):
        assert execute_within(run, 30) == RunStatus.COMPLETED
        # Committed content reads back while the lock is still held.
        final = AnswerRevision.objects.get(run=run, is_final=True)
        assert "northwind" in final.content.lower()
        assert capture.flush()
    assert capture.flush()  # the gaps are written once the tables are free
    # Each action ran once; nothing was given up for the sake of evidence.
    assert all(executions(journal, run, key) == 1 for key in KEYS)
    assert not events(run, EventKind.PHASE_CHANGED)
    # What capture could not save is a gap, never a save: 3 sources and 4
    # model records with their copies.
    assert not EvidenceCopy.objects.filter(run=run).exists()
    stats = CaptureStats.objects.get(run=run)
    assert (stats.captured, stats.lost) == (0, 7)
    assert sum(CaptureGap.objects.filter(run=run).values_list("count", flat=True)) == 7
    # The revision still says which model calls it used.
    assert len(final.model_call_actions) == 4


def test_a_stranger_holding_the_timeline_leaves_a_gap_and_holds_up_nothing(journal):
    run = submit(question="Compare these funds", documents=DOCS)
    with another_session("LOCK TABLE runs_runevent IN ACCESS EXCLUSIVE MODE"):
        assert execute_within(run, 30) == RunStatus.COMPLETED
        # The writer is not stuck behind the lock: what it could not write
        # is counted, and it is free for the next run's events.
        assert timeline.flush(timeout=5)
        # Its tries to write the count fail too, and keep the whole count.
        time.sleep(3 * GAP_INTERVAL)
    assert all(executions(journal, run, key) == 1 for key in KEYS)
    # Once the table is free, the run's timeline says what is missing, and why:
    # at least each action's dispatch and completion.
    wait_for(lambda: events(run, EventKind.EVENTS_LOST))
    (lost,) = run.events.filter(kind=EventKind.EVENTS_LOST)
    assert lost.data["reason"] == "lock_not_available"
    assert lost.data["count"] >= 2 * len(KEYS)


def test_a_delivery_never_waits_on_the_operators_decisions_someone_holds(journal):
    """An effect's first dispatch needs no decision: its boundary does not
    read the decisions table (migration 0013), so a lock on it holds
    nothing up.  Only a dispatch after the first reads it."""
    run = submit(question="Compare these funds", documents=DOCS)
    with another_session("LOCK TABLE runs_operatordecision IN ACCESS EXCLUSIVE MODE"):
        assert execute_within(run, 30) == RunStatus.COMPLETED
    assert all(executions(journal, run, key) == 1 for key in KEYS)


def test_publication_never_waits_on_a_model_record_someone_holds(journal):
    run = submit(question="q", documents=DOCS[:1])
    lease = Lease.claim(run.pk, "owner")
    call = lease.record_boundary(
        step_key="summarize:0", kind="model_call", effect_class="read", input={"m": 1}
    )
    lease.record_receipt(call, {"provider": "offline", "text": "summary"})
    record_model_call(run.pk, call, "offline", "a" * 64, "b" * 64, [])
    # The incident's door: a row lock on the model record (capture's own
    # FOR SHARE, a dashboard query, a DBA's UPDATE), held indefinitely.
    with another_session(
        f"SELECT 1 FROM evidence_modelcall WHERE run_id = {run.pk} FOR UPDATE",
        "SET lock_timeout = 0",
    ):
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '2s'")  # a wait would fail, not hang
        try:
            assert lease.publish_revision(1, "# Answer", is_final=True, model_call_actions=[call])
        finally:
            with connection.cursor() as cursor:
                cursor.execute("RESET lock_timeout")
        assert AnswerRevision.objects.get(run=run, number=1).model_call_actions == [call]
    assert ModelCall.objects.filter(run=run).count() == 1


def test_a_run_row_held_for_key_share_by_an_evidence_write_is_still_claimed():
    """An evidence row being written for a run holds the run row FOR KEY
    SHARE (its foreign-key check) until it commits: the claim, FOR NO KEY
    UPDATE, is not made to skip the run for it."""
    run = submit(question="q", documents=DOCS[:1])
    with another_session(
        # Django's foreign keys are deferred: checked (and the lock taken)
        # at once here, as at the COMMIT of a deferred one.
        "SET CONSTRAINTS ALL IMMEDIATE",
        f"INSERT INTO evidence_capturestats (run_id, captured, lost) VALUES ({run.pk}, 0, 0)",
    ) as other:
        held = other.execute(
            "SELECT mode FROM pg_locks WHERE locktype = 'tuple' OR (locktype = 'relation'"
            " AND relation = 'runs_run'::regclass AND pid = pg_backend_pid())"
        ).fetchall()
        assert held  # the run's table is locked by the foreign-key check
        lease = Lease.claim(run.pk, "owner")
        assert lease is not None and lease.epoch == 1
        lease.finish(RunStatus.FAILED, "test over")

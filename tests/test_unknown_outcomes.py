"""Facts whose COMMIT got no answer are settled by evidence, never guessed:
pg_xact_status() of the xid the write announced, then a probe by identity.
An effect whose answer was lost is always an item for an operator."""

from __future__ import annotations

import datetime as dt
import threading
from dataclasses import replace

import psycopg
import pytest
from django.db import connection

from runs.agent import ToolCall
from runs.agents.research import ResearchAgent
from runs.agents.tools import DELIVER_REPORT, MODEL_CALL, READ_DOCUMENT
from runs.decisions import settle_open_items
from runs.executor import claim_and_drive
from runs.models import (
    ActionState,
    AnswerRevision,
    OutcomeItem,
    OutcomeKind,
    OutcomeState,
    Receipt,
    Run,
    RunStatus,
)
from runs.outcomes import find_orphan, settle, xact_status
from runs.sql import Backend, CommitUnanswered
from runs.submission import submit
from runs.timeline import EventKind
from tests.faultruns import KEYS, dispatched, events, executions, run_with, wait_for
from tests.receivers import LocalServer, status

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("short_settle")]


def drop(write: str, action: int, outcome: str, **extra: object) -> list[dict]:
    fault = {"point": "drop_connection_at_commit", "write": write, "action": action}
    return [{**fault, "outcome": outcome, **extra}]


# -- receipts ----------------------------------------------------------------------


def test_unanswered_receipt_that_committed_is_adopted_and_the_read_ran_once(journal):
    run, outcome = run_with(drop("receipt", 3, "committed"))

    receipt = Receipt.objects.get(run=run, step_key="read:1")
    assert xact_status(receipt.xid) == "committed"
    assert receipt.verifies(receipt.action)
    assert "committed: xid" in events(run, EventKind.OUTCOME_SETTLED)[0]
    assert outcome == RunStatus.COMPLETED
    for step_key in KEYS:
        assert executions(journal, run, step_key) == 1, step_key


def test_unanswered_receipt_that_aborted_is_written_again_not_the_read(journal):
    run, outcome = run_with(drop("receipt", 3, "aborted"))

    # Settled by pg_xact_status (aborted) while the writer's backend still
    # ran, or by the probe once it was gone: either way, known not written.
    assert "not_written" in events(run, EventKind.OUTCOME_SETTLED)[0]
    # Known not written, so writing the receipt again is not blind; the read
    # itself was not executed again.
    receipt = Receipt.objects.get(run=run, step_key="read:1")
    assert receipt.verifies(receipt.action) and xact_status(receipt.xid) == "committed"
    assert executions(journal, run, "read:1") == 1
    assert outcome == RunStatus.COMPLETED
    assert AnswerRevision.objects.filter(run=run, is_final=True).exists()


def test_unanswered_receipt_still_in_flight_waits_for_an_operator_then_settles(journal):
    run, outcome = run_with(drop("receipt", 3, "late", stall_ms=4000))

    assert outcome == RunStatus.NEEDS_OPERATOR
    assert run.status_reason == "whether the receipt of read:1 committed is unknown"
    item = OutcomeItem.objects.get(run=run)
    assert (item.kind, item.state, item.action.step_key) == (
        OutcomeKind.RECEIPT,
        OutcomeState.OPEN,
        "read:1",
    )
    assert item.xid is not None and item.evidence["checks"][-1]["xid_status"] == "in progress"
    assert item.evidence["backend_pid"] and item.evidence["backend_start"]
    # Nothing after it was dispatched; what came before is readable.
    assert not dispatched(run, "summarize:1")
    assert Receipt.objects.filter(run=run, step_key="summarize:0").exists()
    assert AnswerRevision.objects.filter(run=run, number=1).exists()
    assert executions(journal, run, "read:1") == 1

    wait_for(lambda: xact_status(item.xid) == "committed")
    assert settle_open_items().settled == 1
    item.refresh_from_db()
    assert item.state == OutcomeState.SETTLED
    assert Receipt.objects.filter(run=run, step_key="read:1").exists()


def test_a_later_backend_that_reuses_the_writers_pid_is_not_taken_for_the_writer():
    """The sweep may ask hours later, when the writer's pid belongs to
    another backend: its open transaction is not the write's."""
    with psycopg.connect(**connection.get_connection_params()) as stranger:
        xid = stranger.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()[0]
        pid = stranger.info.backend_pid
        started = stranger.execute(
            "SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()"
        ).fetchone()[0]
        assert find_orphan(Backend(pid, started.isoformat())) == (True, xid)
        # The writer had this pid, started earlier, and is gone.
        writer = Backend(pid, (started - dt.timedelta(seconds=1)).isoformat())
        assert find_orphan(writer) == (False, None)
        settlement = settle(CommitUnanswered("receipt", None, writer, "lost"), lambda: False)
        assert settlement.outcome == "not_written" and settlement.evidence["xid"] is None
        # Evidence recorded before start times were kept names the pid alone.
        assert find_orphan(Backend(pid, None)) == (True, xid)


def test_a_write_whose_transaction_aborted_is_not_written_whoever_wrote_the_row_since():
    """An owner frozen while its write was cut wakes after another owner
    wrote the same receipt: the row is there, but it is not this write's,
    which aborted and wrote nothing.  Known not written, by its xid; the
    owner's retry is then fenced out.  Before, it was 'unknown': an item
    on a completed run that nothing settled, offering to adopt it."""
    with psycopg.connect(**connection.get_connection_params()) as writer:
        xid = writer.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()[0]
        backend = Backend(writer.info.backend_pid, None)
        writer.rollback()
    assert xact_status(xid) == "aborted"
    unanswered = CommitUnanswered("receipt of read:1", xid, backend, "cut")
    settlement = settle(unanswered, lambda: True, patience=0)
    assert settlement.outcome == "not_written"


# -- publications ------------------------------------------------------------------


def test_unanswered_publication_that_committed_is_adopted_not_published_twice(journal):
    run, outcome = run_with(drop("publication", 1, "committed"))

    draft = AnswerRevision.objects.get(run=run, number=1)
    assert xact_status(draft.xid) == "committed"
    assert outcome == RunStatus.COMPLETED
    assert events(run, EventKind.REVISION_PUBLISHED) == ["draft revision 1", "final revision 2"]


def test_unanswered_publication_that_aborted_is_published_again(journal):
    run, outcome = run_with(drop("publication", 1, "aborted"))

    assert "not_written" in events(run, EventKind.OUTCOME_SETTLED)[0]
    draft = AnswerRevision.objects.get(run=run, number=1)
    assert xact_status(draft.xid) == "committed"
    assert outcome == RunStatus.COMPLETED
    for step_key in KEYS:
        assert executions(journal, run, step_key) == 1, step_key


def test_unanswered_final_publication_still_in_flight_is_not_delivered(journal, _outbox):
    run, outcome = run_with(drop("publication", 7, "late", stall_ms=4000))

    assert outcome == RunStatus.NEEDS_OPERATOR
    item = OutcomeItem.objects.get(run=run)
    assert (item.kind, item.revision_number) == (OutcomeKind.PUBLICATION, 2)
    # The delivery, a protected effect that would send this answer, waits.
    assert not dispatched(run, "deliver")
    assert not _outbox.exists() or not any(_outbox.iterdir())
    assert AnswerRevision.objects.get(run=run, number=1).content.startswith("**Draft**")


# -- effects -----------------------------------------------------------------------


def test_delivery_whose_answer_is_lost_is_an_item_and_is_never_sent_again(journal, settings):
    with LocalServer(status(200)) as receiver:
        settings.RUNDESK_DELIVERY_URL = receiver.url
        run, outcome = run_with([{"point": "delivery_timeout"}])

        assert outcome == RunStatus.NEEDS_OPERATOR
        # The receiver has it; the runtime does not know that.
        assert len(receiver.requests) == 1
        headers, _ = receiver.requests[0]
        deliver = run.actions.get(step_key="deliver")
        assert headers["Idempotency-Key"] == deliver.idempotency_key
        assert deliver.state == ActionState.UNKNOWN
        item = OutcomeItem.objects.get(run=run)
        assert (item.kind, item.state, item.action_id) == (
            OutcomeKind.EFFECT,
            OutcomeState.OPEN,
            deliver.pk,
        )
        assert item.evidence["idempotency_key"] == deliver.idempotency_key
        assert settle_open_items().settled == 0  # only the receiver can settle an effect

        # Handed to an executor again, the run still does not send it.
        Run.objects.filter(pk=run.pk).update(status=RunStatus.QUEUED, finished_at=None)
        assert claim_and_drive(run.pk) == RunStatus.NEEDS_OPERATOR
        assert len(receiver.requests) == 1
        assert OutcomeItem.objects.filter(run=run).count() == 1


@pytest.mark.parametrize("held_for", [0.7, 1.5])
def test_an_effects_receipt_refused_for_its_moment_is_written_again(journal, monkeypatch, held_for):
    """The delivery went (its result in hand), then a stranger's lock made
    its receipt fail with a lock timeout: the database answered, so the
    receipt is known not written, and it is written again.  Left to the
    next owner, the delivery was unknown, and the run waited for an
    operator to find out what this owner had known."""
    released = []

    def delivered_then_locked(input: dict, call: ToolCall) -> dict:
        result = DELIVER_REPORT.run(input, call)
        stranger = psycopg.connect(**connection.get_connection_params())
        stranger.execute("LOCK TABLE runs_receipt IN SHARE MODE")
        timer = threading.Timer(held_for, stranger.close)
        timer.start()
        released.append(timer)
        with connection.cursor() as cursor:  # the executor's: its receipt comes next
            cursor.execute("SET lock_timeout = '200ms'")
        return result

    locked = replace(DELIVER_REPORT, run=delivered_then_locked)
    monkeypatch.setattr(ResearchAgent, "tools", (READ_DOCUMENT, MODEL_CALL, locked))
    run = submit(question="q", documents=["crestline-short-treasury.md"])
    try:
        assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    finally:
        for timer in released:
            timer.join()
        with connection.cursor() as cursor:
            cursor.execute("RESET lock_timeout")
    assert executions(journal, run, "deliver") == 1
    assert not OutcomeItem.objects.filter(run=run).exists()
    deliver_action = run.actions.get(step_key="deliver")
    assert Receipt.objects.filter(action=deliver_action).exists()

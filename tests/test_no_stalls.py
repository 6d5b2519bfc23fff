"""Nothing stalls a run: a waiting run whose items are settled continues,
every cancel ends, and what one run raises stays in that run."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
from django.db import DatabaseError, OperationalError, connection
from django.utils import timezone

from runs.decisions import DecisionRefused, Request, Who, decide
from runs.dispatch import MAX_READ_DISPATCHES
from runs.executor import Executor, claim_and_drive, drive
from runs.leases import Lease, LeaseLost
from runs.models import (
    Action,
    ActionState,
    AnswerRevision,
    OutcomeItem,
    OutcomeKind,
    OutcomeState,
    Run,
    RunStatus,
)
from runs.outcomes import open_item, xact_status
from runs.submission import submit
from runs.sweep import sweep
from runs.timeline import EventKind, timeline
from tests.conftest import database_url
from tests.faultruns import DOCS, KEYS, dispatched, events, executions, run_with, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

# A receipt whose COMMIT answer is lost while its transaction stalls for 2 s:
# its writer asks for SETTLE seconds, gives up (the receipt unknown, the run
# waiting), and the receipt commits 1.5 s after that.
LATE_RECEIPT = {
    "point": "drop_connection_at_commit",
    "write": "receipt",
    "action": 3,
    "outcome": "late",
    "stall_ms": 2000,
}
SETTLE = 0.5


def settled_by_evidence(item: OutcomeItem, choice: str, token: str = "") -> bool:
    """The system settles `item`; whether that put its run back in the queue."""
    request = Request(choice=choice, who=Who(system="test"), token=token or f"t-{item.pk}")
    return decide(item.pk, request).run_resumed


def expire(run: Run) -> None:
    Run.objects.filter(pk=run.pk).update(lease_expires_at=timezone.now() - dt.timedelta(seconds=1))


# -- a waiting run continues once the evidence settles its item ---------------------


def test_a_receipt_that_commits_late_ends_with_the_run_completed_and_each_read_once(
    journal, settings
):
    settings.RUNDESK_SETTLE_SECONDS = SETTLE
    run, outcome = run_with([LATE_RECEIPT])
    assert outcome == RunStatus.NEEDS_OPERATOR
    item = OutcomeItem.objects.get(run=run, state=OutcomeState.OPEN)

    wait_for(lambda: xact_status(item.xid) == "committed")
    swept = sweep()
    assert swept.settled == 1 and swept.resumed == [run.pk]
    run.refresh_from_db()
    assert run.status == RunStatus.QUEUED
    assert "settled" in run.status_reason
    timeline.flush()
    assert events(run, EventKind.RUN_REQUEUED)

    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    assert AnswerRevision.objects.filter(run=run, is_final=True).exists()
    assert all(executions(journal, run, key) == 1 for key in KEYS)


# What a stranger holds, in turn, while the sweep would settle an item.
HELD = {
    "item-row": "SELECT 1 FROM runs_outcomeitem WHERE id = {item} FOR KEY SHARE",
    "run-row": "SELECT 1 FROM runs_run WHERE id = {run} FOR SHARE",
    "items-table": "LOCK TABLE runs_outcomeitem IN ACCESS EXCLUSIVE MODE",
    "runs-table": "LOCK TABLE runs_run IN ACCESS EXCLUSIVE MODE",
}


def test_a_stranger_holding_what_the_sweep_locks_holds_up_no_sweep(journal, settings, monkeypatch):
    """The sweep runs on the executor's workers: a lock it waited for
    without end stopped them taking any run.  One run waits on a settled
    item; each lock in turn holds up a sweep, which settles nothing (and
    changes nothing: the next lock meets the same run).  Each of its steps
    waits for a lock at most LOCK_WAIT (1 s; a quarter here: a sweep meets
    up to seven locks a table holds)."""
    for module in ("runs.decisions", "runs.approvals"):  # approvals imports it
        monkeypatch.setattr(f"{module}.LOCK_WAIT", "250ms")
    settings.RUNDESK_SETTLE_SECONDS = SETTLE
    run, _ = run_with([LATE_RECEIPT])
    item = OutcomeItem.objects.get(run=run, state=OutcomeState.OPEN)
    wait_for(lambda: xact_status(item.xid) == "committed")
    for name, held in HELD.items():
        with psycopg.connect(database_url()) as stranger:
            stranger.execute(held.format(item=item.pk, run=run.pk))
            started = time.monotonic()
            assert sweep().settled == 0, name
            assert time.monotonic() - started < 5, name  # LOCK_WAIT a lock, at most
            stranger.rollback()
    assert sweep().resumed == [run.pk]  # the next sweep, once it is free


def test_a_sweep_without_a_database_does_what_it_can_and_raises_nothing(monkeypatch, caplog):
    """A step whose transaction cannot even begin (the database gone) is
    left to the next sweep: before, the sweep died of 'generator didn't
    yield' once a second for the whole outage."""

    @contextmanager
    def gone(timeout: str) -> Iterator[None]:
        raise OperationalError("connection refused")
        yield

    monkeypatch.setattr("runs.sweep.waits_bounded", gone)
    monkeypatch.setattr("runs.decisions.waits_bounded", gone)
    swept = sweep(redeliver_after=0)
    assert (swept.cancelled, swept.requeued, swept.redelivered, swept.settled) == ([], [], [], 0)
    assert "requeueing abandoned runs left to the next sweep" in caplog.text


def waiting_run() -> Run:
    """A run that waits for an operator, as its owner left it."""
    run = submit(question="q", documents=DOCS[:1])
    Lease.claim(run.pk, "owner").finish(RunStatus.NEEDS_OPERATOR, "waits for its items")
    return run


def test_a_run_held_by_two_items_goes_back_only_when_both_are_settled():
    run = waiting_run()
    first, second = (
        open_item(
            run_id=run.pk,
            kind=OutcomeKind.PUBLICATION,
            subject=f"publication:run-{run.pk}:revision-{n}",
            summary="unknown",
            evidence={},
            revision_number=n,
        )
        for n in (1, 2)
    )
    # A checkpoint item never holds a run (it went on): settling the
    # publications is what counts.
    open_item(run_id=run.pk, kind=OutcomeKind.CHECKPOINT, subject="cp", summary="", evidence={})
    assert settled_by_evidence(first, "not_written") is False
    run.refresh_from_db()
    assert run.status == RunStatus.NEEDS_OPERATOR
    assert settled_by_evidence(second, "not_written") is True
    with pytest.raises(DecisionRefused, match="already settled"):  # once
        settled_by_evidence(second, "written", token="another")
    run.refresh_from_db()
    assert run.status == RunStatus.QUEUED


def test_two_items_settled_at_the_same_moment_resume_the_run_once():
    run = waiting_run()
    items = [
        open_item(
            run_id=run.pk,
            kind=OutcomeKind.RECEIPT,
            subject=f"receipt:{n}",
            summary="unknown",
            evidence={},
        )
        for n in range(2)
    ]
    results: list[bool] = []
    barrier = threading.Barrier(2)

    def settle(item: OutcomeItem) -> None:
        try:
            barrier.wait()
            results.append(settled_by_evidence(item, "written"))
        finally:
            connection.close()

    threads = [threading.Thread(target=settle, args=(item,)) for item in items]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(results) == [False, True]
    run.refresh_from_db()
    assert run.status == RunStatus.QUEUED


# -- cancels that end ----------------------------------------------------------------


def test_a_cancel_of_a_run_whose_owner_died_ends_it_by_the_sweep():
    run = submit(question="q", documents=DOCS)
    dead = Lease.claim(run.pk, "dead-owner")
    assert run.request_cancel(by="alice")
    expire(run)
    assert sweep().cancelled == [run.pk]
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED
    assert run.status_reason == "cancelled by alice; its owner had stopped"
    assert run.finished_at is not None and run.lease_owner == ""
    with pytest.raises(LeaseLost):
        dead.record_boundary(
            step_key="read:0", kind="read_document", effect_class="read", input={"path": DOCS[0]}
        )
    assert sweep().cancelled == []


def test_a_cancel_of_a_run_whose_owner_died_ends_it_at_the_next_claim(journal):
    run = submit(question="q", documents=DOCS)
    Lease.claim(run.pk, "dead-owner")
    run.request_cancel(by="alice")
    expire(run)
    assert claim_and_drive(run.pk) == RunStatus.CANCELLED
    run.refresh_from_db()
    assert (run.status, run.status_reason) == (RunStatus.CANCELLED, "cancelled by alice")
    assert not Action.objects.filter(run=run).exists()
    assert sum(journal.counts().values()) == 0


def test_sigterm_while_a_cancel_is_pending_ends_the_run_instead_of_requeueing_it(journal):
    # The cancel arrives just before action 1, after the claim looked for
    # one; the executor is stopping too.
    run = submit(question="q", documents=DOCS, faults=[{"point": "cancel", "action": 1}])
    lease = Lease.claim(run.pk, "owner")
    stop = threading.Event()
    stop.set()
    assert drive(lease, stop) == RunStatus.CANCELLED
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED and run.finished_at is not None
    assert run.status_reason == "cancelled by the fault plan"
    assert not dispatched(run, "read:0")


def test_release_with_a_cancel_pending_ends_the_run():
    run = submit(question="q", documents=DOCS)
    lease = Lease.claim(run.pk, "owner")
    run.request_cancel(by="bob")
    assert lease.release() == RunStatus.CANCELLED
    run.refresh_from_db()
    assert (run.status, run.status_reason) == (RunStatus.CANCELLED, "cancelled by bob")
    assert not Run.objects.claimable().filter(pk=run.pk).exists()


def test_a_cancel_says_who_asked(journal):
    run = submit(question="q", documents=DOCS)
    assert run.request_cancel(by="carol")
    run.refresh_from_db()
    assert (run.status, run.cancel_requested_by, run.status_reason) == (
        RunStatus.CANCELLED,
        "carol",
        "cancelled by carol",
    )
    timeline.flush()
    assert "carol" in events(run, EventKind.CANCEL_REQUESTED)[0]


def test_a_cancelled_runs_open_items_stay_open_and_hold_nothing(journal, settings):
    settings.RUNDESK_SETTLE_SECONDS = SETTLE
    run, outcome = run_with([LATE_RECEIPT])
    assert outcome == RunStatus.NEEDS_OPERATOR
    assert run.request_cancel(by="dave")
    item = OutcomeItem.objects.get(run=run)
    assert item.state == OutcomeState.OPEN  # visible, unchanged by the cancel
    wait_for(lambda: xact_status(item.xid) == "committed")
    assert sweep().resumed == []  # settled, but a cancelled run waits for nothing
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED


# -- what one run raises stays in that run ------------------------------------------


def test_a_finish_fenced_out_stays_in_its_run_and_the_executor_goes_on(journal, monkeypatch):
    failing = submit(
        question="q", documents=DOCS[:1], faults=[{"point": "tool_error", "action": 1}]
    )
    later = submit(question="q", documents=DOCS[:1])
    finish = Lease.finish

    def taken_over_first(lease: Lease, status: RunStatus, reason: str = "", **kw) -> RunStatus:
        # Another owner takes the run between its last fenced write and
        # its finish.
        if lease.run_id == failing.pk:
            with psycopg.connect(database_url(), autocommit=True) as thief:
                thief.execute(
                    "UPDATE runs_run SET lease_owner = 'thief', lease_epoch = lease_epoch + 1"
                    " WHERE id = %s",
                    (failing.pk,),
                )
        return finish(lease, status, reason, **kw)

    monkeypatch.setattr(Lease, "finish", taken_over_first)
    results = Executor(concurrency=1).serve(once=True)
    assert results == [(failing.pk, "lease_lost"), (later.pk, RunStatus.COMPLETED)]
    failing.refresh_from_db()
    assert (failing.status, failing.lease_owner) == (RunStatus.RUNNING, "thief")


def test_an_effect_marked_unknown_always_has_its_item(journal, settings):
    """The action's unknown state and its outcome item are written together:
    if the item cannot be written, neither is the state."""
    with connection.cursor() as cursor:
        cursor.execute(
            """CREATE FUNCTION refuse_items() RETURNS trigger LANGUAGE plpgsql AS $$
               BEGIN RAISE EXCEPTION 'no items today'; END $$;
               CREATE TRIGGER refuse_items BEFORE INSERT ON runs_outcomeitem
               FOR EACH ROW EXECUTE FUNCTION refuse_items();"""
        )
    try:
        run = submit(question="q", documents=DOCS[:1], faults=[{"point": "delivery_timeout"}])
        with pytest.raises(Exception, match="no items today"):
            claim_and_drive(run.pk)
        deliver = Action.objects.get(run=run, step_key="deliver")
        assert deliver.state == ActionState.DISPATCHED  # not unknown without its item
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER refuse_items ON runs_outcomeitem")
            cursor.execute("DROP FUNCTION refuse_items()")
    # The next owner finds an effect with no receipt: unknown, with its item.
    expire(run)
    assert claim_and_drive(run.pk) == RunStatus.NEEDS_OPERATOR
    deliver.refresh_from_db()
    assert deliver.state == ActionState.UNKNOWN
    assert OutcomeItem.objects.get(run=run).action_id == deliver.pk
    assert executions(journal, run, "deliver") == 1


# -- races between an owner stopping, a cancel and a settlement ---------------------


def late_receipt_with(monkeypatch, at_finish) -> Run:
    """A run whose receipt COMMIT answer is lost; `at_finish(lease)` happens
    just before its owner writes that it waits for an operator."""
    finish = Lease.finish

    def first(lease: Lease, status: RunStatus, reason: str = "") -> RunStatus:
        if status == RunStatus.NEEDS_OPERATOR:
            at_finish(lease)
        return finish(lease, status, reason)

    monkeypatch.setattr(Lease, "finish", first)
    run, _ = run_with([LATE_RECEIPT])
    monkeypatch.setattr(Lease, "finish", finish)
    return run


def test_a_cancel_asked_while_the_owner_settles_ends_the_run(journal, settings, monkeypatch):
    settings.RUNDESK_SETTLE_SECONDS = SETTLE
    run = late_receipt_with(
        monkeypatch, lambda lease: Run.objects.get(pk=lease.run_id).request_cancel(by="alice")
    )
    assert (run.status, run.status_reason) == (RunStatus.CANCELLED, "cancelled by alice")
    assert run.finished_at is not None
    item = OutcomeItem.objects.get(run=run)
    assert item.state == OutcomeState.OPEN  # still unknown, still visible


def test_an_item_settled_before_its_owner_stops_still_resumes_the_run(
    journal, settings, monkeypatch
):
    settings.RUNDESK_SETTLE_SECONDS = SETTLE

    def settled_meanwhile(lease: Lease) -> None:
        item = OutcomeItem.objects.get(run_id=lease.run_id, state=OutcomeState.OPEN)
        wait_for(lambda: xact_status(item.xid) == "committed")
        assert sweep().settled == 1  # another executor's sweep, or beat's

    run = late_receipt_with(monkeypatch, settled_meanwhile)
    assert run.status == RunStatus.QUEUED
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    assert all(executions(journal, run, key) == 1 for key in KEYS)


@pytest.mark.parametrize("moved_to", [RunStatus.QUEUED, RunStatus.NEEDS_OPERATOR])
def test_a_cancel_is_never_lost_while_the_run_changes_state(moved_to):
    run = submit(question="q", documents=DOCS)
    Lease.claim(run.pk, "owner")
    asked: list[bool] = []
    with psycopg.connect(database_url()) as other:
        # The owner releases it, or starts waiting, as the cancel arrives.
        other.execute(
            "UPDATE runs_run SET status = %s, lease_owner = '', lease_expires_at = NULL"
            " WHERE id = %s",
            (moved_to, run.pk),
        )

        def cancel() -> None:
            try:
                asked.append(Run.objects.get(pk=run.pk).request_cancel(by="alice"))
            finally:
                connection.close()

        canceller = threading.Thread(target=cancel)
        canceller.start()
        wait_for(lambda: _waits_on_a_lock())
        other.commit()
    canceller.join(10)
    run.refresh_from_db()
    assert asked == [True]
    assert (run.status, run.status_reason) == (RunStatus.CANCELLED, "cancelled by alice")


def _waits_on_a_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND datname = current_database())"
        )
        return cursor.fetchone()[0]


# -- a read whose receipt the database refuses every time ----------------------------


def test_a_read_never_recorded_fails_after_its_dispatches_and_the_run_goes_on(journal):
    """The database refuses the first read's receipt every time (a stranger's
    trigger): each owner dies with the error, and the next sends the read
    again, until it has been sent MAX_READ_DISPATCHES times: then it fails,
    and the run completes without that document."""
    run = submit(question="q", documents=DOCS[:2])
    with connection.cursor() as cursor:
        cursor.execute(
            """CREATE FUNCTION test_refuse_receipt() RETURNS trigger LANGUAGE plpgsql AS $$
               BEGIN RAISE EXCEPTION 'a stranger refuses this receipt'; END $$;
               CREATE TRIGGER test_refuse_receipt BEFORE INSERT ON runs_receipt FOR EACH ROW
               WHEN (NEW.step_key = 'read:0') EXECUTE FUNCTION test_refuse_receipt();"""
        )
    try:
        for _ in range(MAX_READ_DISPATCHES):
            with pytest.raises(DatabaseError, match="a stranger refuses this receipt"):
                claim_and_drive(run.pk)
            expire(run)
        assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    finally:
        with connection.cursor() as cursor:
            cursor.execute(
                "DROP TRIGGER test_refuse_receipt ON runs_receipt;"
                "DROP FUNCTION test_refuse_receipt();"
            )

    read = Action.objects.get(run=run, step_key="read:0")
    assert (read.state, read.attempts) == (ActionState.FAILED, MAX_READ_DISPATCHES)
    assert journal.counts("read_document")[f"rundesk:run-{run.pk}:read:0"] == MAX_READ_DISPATCHES
    final = AnswerRevision.objects.get(run=run, is_final=True).content
    assert f"{DOCS[0]}: not included (read:0 failed: dispatched 10 times" in final
    assert "Funds compared: CSTB." in final  # the other document is in the report

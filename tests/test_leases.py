"""Ownership and fencing: one owner at a time, a stale owner writes nothing."""

from __future__ import annotations

import datetime as dt
import json
import threading

import psycopg
import pytest
from django.db import connection, transaction
from django.utils import timezone

from runs import lifecycle
from runs.executor import drive
from runs.leases import Lease, LeaseExpired, LeaseLost, PendingReceipt
from runs.models import (
    Action,
    ActionState,
    AnswerRevision,
    OutcomeItem,
    Receipt,
    Run,
    RunStatus,
    canonical_json,
)
from runs.renewal import renewals
from runs.sql import array_literal
from runs.submission import submit
from tests.conftest import database_url
from tests.faultruns import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

DOCS = ["northwind-clean-energy.md", "crestline-short-treasury.md"]


def expire(run: Run) -> None:
    Run.objects.filter(pk=run.pk).update(lease_expires_at=timezone.now() - dt.timedelta(seconds=1))


def in_thread(target, *args):
    """Runs target on its own thread (its own database connection)."""
    out: list = []

    def work():
        try:
            out.append(target(*args))
        finally:
            connection.close()

    thread = threading.Thread(target=work)
    thread.start()
    return thread, out


def slow_summary_under_way(owner: str):
    """A run whose second action (summarize:0) takes 1.5 s, driven by
    `owner` on its own thread, once that action is dispatched."""
    run = submit(
        question="q", documents=DOCS, faults=[{"point": "tool_delay", "action": 2, "ms": 1500}]
    )
    thread, out = in_thread(drive, Lease.claim(run.pk, owner), threading.Event())
    wait_for(lambda: Action.objects.filter(run=run, step_key="summarize:0").exists())
    return run, thread, out


def test_two_executors_race_for_one_run_and_exactly_one_owns_it():
    run = submit(question="q", documents=DOCS)
    barrier = threading.Barrier(8)

    def claim(i: int) -> Lease | None:
        barrier.wait()
        return Lease.claim(run.pk, f"executor-{i}")

    threads = [in_thread(claim, i) for i in range(8)]
    for thread, _ in threads:
        thread.join()
    leases = [out[0] for _, out in threads if out and out[0] is not None]
    assert len(leases) == 1
    run.refresh_from_db()
    assert (run.lease_owner, run.lease_epoch, run.status) == (leases[0].owner, 1, "running")


def test_concurrent_claim_next_takes_each_run_once():
    runs = {submit(question=f"q{i}", documents=DOCS).pk for i in range(6)}
    barrier = threading.Barrier(6)

    def claim(i: int) -> int | None:
        barrier.wait()
        lease = Lease.claim_next(f"executor-{i}")
        return lease.run_id if lease else None

    threads = [in_thread(claim, i) for i in range(6)]
    for thread, _ in threads:
        thread.join()
    claimed = [out[0] for _, out in threads]
    assert sorted(claimed) == sorted(runs)


def test_claim_oldest_takes_the_oldest_claimable_runs_in_one_statement_skipping_locked_ones():
    runs = [submit(question=f"q{i}", documents=DOCS).pk for i in range(5)]
    with psycopg.connect(database_url()) as other:
        # Another executor is claiming the oldest at this moment.
        other.execute("SELECT 1 FROM runs_run WHERE id = %s FOR NO KEY UPDATE", [runs[0]])
        taken = Lease.claim_oldest("executor", 3)
        assert [lease.run_id for lease in taken] == runs[1:4]
        assert {lease.epoch for lease in taken} == {1}
        other.rollback()
    assert [lease.run_id for lease in Lease.claim_oldest("executor", 3)] == [runs[0], runs[4]]
    assert Lease.claim_oldest("executor", 3) == []
    assert set(Run.objects.filter(pk__in=runs).values_list("lease_owner", flat=True)) == {
        "executor"
    }


def test_stale_epoch_write_changes_nothing():
    run = submit(question="q", documents=DOCS)
    stale = Lease.claim(run.pk, "old-owner")
    expire(run)
    current = Lease.claim(run.pk, "new-owner")
    assert current is not None and current.epoch == 2
    action_id = current.record_boundary(
        step_key="read:0", kind="read_document", effect_class="read", input={"path": DOCS[0]}
    )
    call_id = current.record_boundary(
        step_key="summarize:0", kind="model_call", effect_class="read", input={"m": 1}
    )

    with pytest.raises(LeaseLost):
        stale.record_boundary(
            step_key="read:1", kind="read_document", effect_class="read", input={"path": DOCS[1]}
        )
    with pytest.raises(LeaseLost):
        stale.record_receipt(action_id, {"text": "stale"})
    with pytest.raises(LeaseLost):
        stale.record_action_state(action_id, ActionState.FAILED, "stale")
    with pytest.raises(LeaseLost):
        stale.publish_revision(1, "stale answer", is_final=True, model_call_actions=[call_id])
    with pytest.raises(LeaseLost):
        stale.finish(RunStatus.COMPLETED)
    assert stale.renew() is False
    assert stale.release() is None

    assert list(Action.objects.filter(run=run).values_list("step_key", "state", "epoch")) == [
        ("read:0", "dispatched", 2),
        ("summarize:0", "dispatched", 2),
    ]
    assert not Receipt.objects.exists() and not AnswerRevision.objects.exists()
    run.refresh_from_db()
    assert (run.status, run.lease_epoch, run.lease_owner) == ("running", 2, current.owner)


def test_past_its_lease_expiry_an_owner_writes_its_receipts_but_starts_nothing():
    # Nobody has claimed the run: what completed is a fact, and the claim
    # that comes next sees it.  New work waits for a live lease.
    run = submit(question="q", documents=DOCS)
    lease = Lease.claim(run.pk, "owner")
    effect = lease.record_boundary(
        step_key="deliver", kind="deliver_report", effect_class="effect", input={"to": "x"}
    )
    read = lease.record_boundary(
        step_key="read:0", kind="read_document", effect_class="read", input={"path": DOCS[0]}
    )
    expire(run)
    lease.record_receipt(effect, {"delivered": True})
    with pytest.raises(LeaseExpired):
        lease.record_boundary(
            step_key="read:1",
            kind="read_document",
            effect_class="read",
            input={"path": DOCS[1]},
            receipts=[PendingReceipt(read, {"text": "x"})],
        )
    assert sorted(Receipt.objects.filter(run=run).values_list("step_key", flat=True)) == [
        "deliver",
        "read:0",
    ]
    assert not Action.objects.filter(run=run, step_key="read:1").exists()
    assert lease.finish(RunStatus.COMPLETED) == RunStatus.COMPLETED


def test_an_action_that_completes_after_the_lease_expired_is_not_sent_again(journal, settings):
    # The second action (summarize:0) is slow, and the lease expires
    # meanwhile (no heartbeat comes in time); nobody claims the run.  Its
    # receipt is written before the draft's publication, which is refused,
    # and the run is given back; the next owner takes the summary from the
    # receipt.
    settings.RUNDESK_LEASE_SECONDS = 60
    # The process's renewal thread, left beating by an earlier test's lease
    # (a shorter one), would renew this lease within its beat: start once it
    # has ended, so the next renewal is a third of this test's lease away.
    wait_for(lambda: renewals.idle, "the renewal thread of earlier leases to end")
    run, thread, out = slow_summary_under_way("first-owner")
    expire(run)
    thread.join()
    # Still its owner, it gave the run back: nothing waits for the sweep.
    assert out == ["released"]
    assert Run.objects.get(pk=run.pk).status == RunStatus.QUEUED
    assert Receipt.objects.filter(run=run, step_key="summarize:0").exists()
    assert not Action.objects.filter(run=run, step_key="read:1").exists()

    Run.objects.filter(pk=run.pk).update(faults=[])
    second = Lease.claim(run.pk, "second-owner")
    assert second is not None and drive(second, threading.Event()) == RunStatus.COMPLETED
    assert journal.counts()[f"rundesk:run-{run.pk}:summarize:0"] == 1
    assert not OutcomeItem.objects.filter(run=run).exists()


def test_stale_owner_dispatches_nothing_more_and_the_new_owner_completes(journal):
    # The second action (summarize:0) is slow: the lease is taken meanwhile.
    run, thread, out = slow_summary_under_way("old-owner")
    # Expired and taken in one transaction: a renewal of the old lease
    # (the process's renewal thread beats whenever an earlier test left it
    # to) waits for the run's row, then finds it taken.
    with transaction.atomic():
        expire(run)
        Run.objects.filter(pk=run.pk).update(faults=[])
        new = Lease.claim(run.pk, "new-owner")
    assert new is not None and new.epoch == 2
    thread.join()
    assert out == ["lease_lost"]
    # The stale owner's summary ran but its receipt was refused, and it
    # dispatched nothing after that.
    assert not Receipt.objects.filter(run=run, step_key="summarize:0").exists()
    assert not Action.objects.filter(run=run, step_key="read:1").exists()

    assert drive(new, threading.Event()) == RunStatus.COMPLETED
    counts = journal.counts()
    assert counts[f"rundesk:run-{run.pk}:read:0"] == 1  # its receipt was reused
    assert counts[f"rundesk:run-{run.pk}:summarize:0"] == 2  # a read: dispatched again
    assert counts[f"rundesk:run-{run.pk}:read:1"] == 1
    summary = Action.objects.get(run=run, step_key="summarize:0")
    assert (summary.epoch, summary.attempts, summary.state) == (2, 2, "completed")


def test_cancel_request_stops_new_dispatches_and_keeps_completed_facts(journal):
    run = submit(
        question="q", documents=DOCS, faults=[{"point": "tool_delay", "action": 2, "ms": 800}]
    )
    lease = Lease.claim(run.pk, "owner")
    thread, out = in_thread(drive, lease, threading.Event())
    wait_for(lambda: Action.objects.filter(run=run, step_key="summarize:0").exists())
    Run.objects.filter(pk=run.pk).update(cancel_requested_at=timezone.now())
    thread.join()
    assert out == [RunStatus.CANCELLED]
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED and run.finished_at is not None
    # The summary that was running completed: its receipt is a fact and stays.
    assert list(Receipt.objects.filter(run=run).values_list("step_key", flat=True)) == [
        "read:0",
        "summarize:0",
    ]
    # Nothing new: no draft publication, no further read.
    assert not AnswerRevision.objects.filter(run=run).exists()
    assert not Action.objects.filter(run=run, step_key="read:1").exists()
    assert set(journal.counts()) == {
        f"rundesk:run-{run.pk}:read:0",
        f"rundesk:run-{run.pk}:summarize:0",
    }


def test_a_claim_commits_asynchronously_and_only_its_own_transaction(monkeypatch, settings):
    """A claim's COMMIT need not wait for the WAL flush (the owner's first
    durable write flushes it); a caller's transaction around it, which may
    hold facts, stays synchronous, and nothing outlasts the claim."""

    def synchronous_commit() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SHOW synchronous_commit")
            return cursor.fetchone()[0]

    server_default = synchronous_commit()
    assert server_default != "off"
    runs = [submit(question=f"q{i}", documents=DOCS).pk for i in range(3)]
    # The asynchronous claim's own statement sets it, for its transaction.
    with transaction.atomic():
        ttl = dt.timedelta(seconds=settings.RUNDESK_LEASE_SECONDS)
        assert lifecycle.claim("owner", ttl, lab=False, run_id=runs[0], asynchronous=True)
        assert synchronous_commit() == "off"
        transaction.set_rollback(True)

    asked = []
    claim = lifecycle.claim
    monkeypatch.setattr(
        lifecycle, "claim", lambda *a, **k: asked.append(k["asynchronous"]) or claim(*a, **k)
    )
    assert Lease.claim(runs[0], "owner") is not None
    assert synchronous_commit() == server_default
    with transaction.atomic():
        assert Lease.claim(runs[1], "owner") is not None
        assert synchronous_commit() == server_default
    assert asked == [True, False]
    assert Lease.claim_oldest("owner", 5) != [] and asked[-1] is True
    assert set(Run.objects.filter(pk__in=runs).values_list("lease_owner", flat=True)) == {"owner"}


def test_the_arrays_of_a_step_write_reach_the_database_as_they_were():
    # array_literal (runs/sql.py) quotes each element itself: text the
    # array syntax means something by comes back unchanged.
    texts = ['a "quoted" word', "back\\slash", "{braces}, commas", "NULL", "", "é ✓ \u2028", " "]
    documents = [canonical_json({"text": text, "n": 1}) for text in texts]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT %s::text[], %s::jsonb[], %s::bigint[], %s::text[]",
            [
                array_literal(texts),
                array_literal(documents),
                array_literal([1, 2**40, -3]),
                array_literal([]),
            ],
        )
        back_texts, back_documents, ids, empty = cursor.fetchone()
    assert back_texts == texts
    # Django's connection gives jsonb back as its text.
    assert [json.loads(each) for each in back_documents] == [{"text": t, "n": 1} for t in texts]
    assert ids == [1, 2**40, -3]
    assert empty == []

"""One durable commit per read step (runs/dispatch.py): a read's receipt
goes with the run's next write -- the next boundary, or the finish -- in
one fenced statement; an effect's receipt does not wait.  The statement
tells a cancel (receipt written, boundary refused) from being fenced out
(nothing written); a merged write that never commits costs a read sent
again under its identity, never an effect.  Real runs, real PostgreSQL;
executions counted by the tool journal."""

from __future__ import annotations

import threading

import pytest
from django.db import DatabaseError, connection

from runs.agents.research import ResearchAgent
from runs.agents.tools import NOOP
from runs.dispatch import Dispatcher, Stopping
from runs.executor import claim_and_drive
from runs.faults import FaultPlan, inject_cancel, steal_lease
from runs.leases import CancelRequested, Lease, LeaseLost, PendingReceipt
from runs.models import (
    Action,
    ActionState,
    OutcomeItem,
    OutcomeKind,
    OutcomeState,
    Receipt,
    Run,
    RunStatus,
)
from runs.outcomes import NeedsOperator, xact_status
from runs.submission import submit
from runs.timeline import EventKind, timeline
from tests.faultruns import DOCS, KEYS, events, executions, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def xmin(table: str, where: str, value: object) -> str:
    """The transaction that wrote the row (as it is now)."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT xmin::text FROM {table} WHERE {where} = %s", [value])
        return cursor.fetchone()[0]


def claimed(documents: list[str] = DOCS) -> Dispatcher:
    run = submit(question="Compare", documents=documents)
    lease = Lease.claim(run.pk, "owner")
    assert lease is not None
    tools = [*ResearchAgent.tools, NOOP]
    return Dispatcher(lease, stop=threading.Event(), lease_lost=threading.Event(), tools=tools)


def noop(dispatcher: Dispatcher, i: int) -> dict:
    return dispatcher.step(f"noop:{i}", "noop", {"i": i})


def test_a_reads_receipt_commits_with_the_next_boundary(journal):
    dispatcher = claimed()
    noop(dispatcher, 0)
    first = Action.objects.get(step_key="noop:0")
    # The agent has the result; the receipt waits for the next write.
    assert first.state == ActionState.DISPATCHED and not Receipt.objects.exists()
    for i in range(1, 4):
        noop(dispatcher, i)
        receipt = Receipt.objects.get(step_key=f"noop:{i - 1}")
        # The boundary of step i, as written (its receipt is not written yet).
        assert xmin("runs_receipt", "action_id", receipt.action_id) == xmin(
            "runs_action", "step_key", f"noop:{i}"
        )
    assert dispatcher.finish(RunStatus.COMPLETED, "done") == RunStatus.COMPLETED
    last = Receipt.objects.get(step_key="noop:3")
    assert xmin("runs_receipt", "action_id", last.action_id) == xmin(
        "runs_run", "id", dispatcher.run.pk
    )
    assert Receipt.objects.count() == 4 and all(r.verifies(r.action) for r in Receipt.objects.all())
    assert all(executions(journal, dispatcher.run, f"noop:{i}") == 1 for i in range(4))


def test_an_effects_receipt_is_written_the_moment_it_answers(journal):
    dispatcher = claimed()
    noop(dispatcher, 0)
    dispatcher.step("deliver", "deliver_report", {"revision": 1, "content": "x"})
    # Its own commit: and the read before it rode with its boundary.
    assert set(Receipt.objects.values_list("step_key", flat=True)) == {"noop:0", "deliver"}


# The cut write commits (or is aborted) within a third of a second: the
# default patience is only waited in full if it never settles, so these keep
# it (on a loaded machine 1.5 s was once too short for the commit).
@pytest.mark.parametrize("answer", ["answered", "lost, but committed"])
def test_a_cancel_refuses_the_boundary_and_keeps_the_receipt(answer):
    dispatcher = claimed()
    noop(dispatcher, 0)
    inject_cancel(dispatcher.run.pk)
    if answer != "answered":  # settled by its xid, then the boundary alone says cancel
        cut = {"point": "drop_connection_at_commit", "write": "boundary", "action": 2}
        plan = [{**cut, "outcome": "committed"}]
        dispatcher.faults = FaultPlan.parse(plan, run_id=dispatcher.run.pk)
    with pytest.raises(CancelRequested):
        noop(dispatcher, 1)
    assert list(Receipt.objects.values_list("step_key", flat=True)) == ["noop:0"]
    assert not Action.objects.filter(step_key="noop:1").exists()


def test_fenced_out_the_merged_write_writes_nothing():
    dispatcher = claimed()
    noop(dispatcher, 0)
    steal_lease(dispatcher.run.pk)
    with pytest.raises(LeaseLost):
        noop(dispatcher, 1)
    assert not Receipt.objects.exists()
    assert list(Action.objects.values_list("step_key", "state")) == [("noop:0", "dispatched")]


def test_the_lease_refuses_a_receipt_it_cannot_write_with_the_boundary():
    dispatcher = claimed()
    lease = dispatcher.lease
    done = lease.record_boundary(step_key="a", kind="noop", effect_class="read", input={})
    lease.record_receipt(done, {"ok": True})
    # Already completed: the merged write is refused, and writes nothing.
    with pytest.raises(LeaseLost, match="boundary of b refused"):
        lease.record_boundary(
            step_key="b",
            kind="noop",
            effect_class="read",
            input={},
            receipts=[PendingReceipt(done, {"ok": True})],
        )
    assert not Action.objects.filter(step_key="b").exists()


def test_a_merged_write_that_never_commits_costs_a_read_sent_again(journal):
    # The owner dies after a read answered and before its receipt went with
    # anything: the next owner sends the read again, under its identity.
    dispatcher = claimed()
    dispatcher.step("read:0", "read_document", {"path": DOCS[0]})
    run = dispatcher.run
    steal_lease(run.pk)  # its lease expired and another took the run
    Run.objects.filter(pk=run.pk).update(status=RunStatus.QUEUED, lease_owner="")
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    assert executions(journal, run, "read:0") == 2
    assert all(executions(journal, run, key) == 1 for key in KEYS[1:])
    assert Receipt.objects.filter(run=run).count() == len(KEYS)


@pytest.mark.parametrize("outcome", ["committed", "aborted"])
def test_a_merged_write_whose_commit_got_no_answer_is_settled_as_the_receipt(journal, outcome):
    dispatcher = claimed()
    noop(dispatcher, 0)
    # The next boundary, which carries noop:0's receipt, loses its answer.
    cut = {"point": "drop_connection_at_commit", "write": "boundary", "action": 2}
    dispatcher.faults = FaultPlan.parse([{**cut, "outcome": outcome}], run_id=dispatcher.run.pk)
    noop(dispatcher, 1)
    assert dispatcher.finish(RunStatus.COMPLETED, "done") == RunStatus.COMPLETED

    timeline.flush()
    (settled,) = events(dispatcher.run, EventKind.OUTCOME_SETTLED)
    # Committed: adopted by its xid, boundary and all; aborted: known not
    # written, so written again (not blind), the read not sent again.
    assert ("committed: xid" if outcome == "committed" else "not_written") in settled
    assert list(Action.objects.order_by("pk").values_list("step_key", "attempts")) == [
        ("noop:0", 1),
        ("noop:1", 1),
    ]
    assert all(r.verifies(r.action) for r in Receipt.objects.all())
    assert Receipt.objects.count() == 2
    assert all(executions(journal, dispatcher.run, f"noop:{i}") == 1 for i in range(2))


def test_a_merged_write_the_database_refuses_leaves_the_receipt_to_go_alone():
    dispatcher = claimed()
    with pytest.raises(DatabaseError), dispatcher.receipt_kept():
        noop(dispatcher, 0)
        # jsonb refuses a NUL: the statement rolls back, receipt and all.
        dispatcher.step("noop:1", "noop", {"text": "\x00"})
    assert list(Receipt.objects.values_list("step_key", flat=True)) == ["noop:0"]
    assert not Action.objects.filter(step_key="noop:1").exists()


@pytest.mark.usefixtures("short_settle")
def test_a_last_receipt_whose_commit_stays_unknown_holds_the_run_for_an_operator():
    dispatcher = claimed()
    noop(dispatcher, 0)
    late = {"point": "drop_connection_at_commit", "write": "receipt", "action": 1}
    plan = [{**late, "outcome": "late", "stall_ms": 3000}]
    dispatcher.faults = FaultPlan.parse(plan, run_id=dispatcher.run.pk)
    # The executor stops: the receipt goes alone, and its answer is lost.
    with pytest.raises(NeedsOperator, match="receipt of noop:0"), dispatcher.receipt_kept():
        raise Stopping()
    item = OutcomeItem.objects.get(run=dispatcher.run)
    assert (item.kind, item.state) == (OutcomeKind.RECEIPT, OutcomeState.OPEN)
    wait_for(lambda: xact_status(item.xid) == "committed")

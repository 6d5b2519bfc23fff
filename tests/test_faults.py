"""The fault plan's points, in the real code path: a stolen lease, a cancel
request and a failed tool keep their handling."""

from __future__ import annotations

import pytest

from runs.executor import claim_and_drive
from runs.faults import FaultPlan, FaultPlanError
from runs.models import ActionState, AnswerRevision, Receipt, RunStatus
from runs.timeline import EventKind
from tests.faultruns import dispatched, events, executions, run_with

pytestmark = pytest.mark.django_db(transaction=True)


def test_stolen_lease_stops_the_owner_before_its_next_boundary(journal):
    run, outcome = run_with([{"point": "lease_stolen", "action": 3}])

    assert outcome == "lease_lost"
    # No further protected effect by the old owner; the run waits for its new one.
    assert not dispatched(run, "read:1")
    assert (run.status, run.lease_owner, run.lease_epoch) == ("running", "fault-plan:thief", 2)
    assert events(run, EventKind.WRITE_FENCED) == ["boundary of read:1 refused"]
    assert events(run, EventKind.LEASE_LOST) == ["epoch 1 stops here"]
    # What was committed stays readable.
    assert list(Receipt.objects.filter(run=run).values_list("step_key", flat=True)) == [
        "read:0",
        "summarize:0",
    ]
    assert AnswerRevision.objects.filter(run=run, number=1).exists()
    assert run.faults_fired == ["0:lease_stolen"]


def test_a_lease_stolen_at_a_boundary_carrying_a_receipt_says_the_read_goes_again(
    settings, journal
):
    """With no checkpoint after read:0 (the production cadence), its
    receipt rides with the next boundary: refused, both are lost, and the
    timeline says the read will be sent again."""
    settings.RUNDESK_CHECKPOINT_EVERY = 100
    run, outcome = run_with([{"point": "lease_stolen", "action": 2}])

    assert outcome == "lease_lost"
    assert events(run, EventKind.WRITE_FENCED) == [
        "boundary of summarize:0 refused, and the receipt of read:0 with it: the next owner "
        "reads it again"
    ]
    assert not Receipt.objects.filter(run=run).exists() and not dispatched(run, "summarize:0")


def test_cancel_before_an_action_dispatches_nothing_new_and_keeps_the_facts(journal):
    run, outcome = run_with([{"point": "cancel", "action": 3}])

    assert outcome == RunStatus.CANCELLED
    assert run.status == RunStatus.CANCELLED and run.cancel_requested_at is not None
    assert not dispatched(run, "read:1")
    assert Receipt.objects.filter(run=run).count() == 2
    assert AnswerRevision.objects.get(run=run, number=1).content.startswith("**Draft**")
    assert executions(journal, run, "read:0") == 1
    assert claim_and_drive(run.pk) == "not_claimable"


def test_failed_read_is_known_not_to_have_happened_and_the_other_reads_go_on(journal):
    run, outcome = run_with([{"point": "tool_error", "action": 3}])

    failed = run.actions.get(step_key="read:1")
    assert (failed.state, failed.error) == (
        ActionState.FAILED,
        "the tool failed (fault plan: tool_error)",
    )
    assert executions(journal, run, "read:1") == 0
    assert not dispatched(run, "summarize:1")
    assert outcome == RunStatus.COMPLETED
    assert executions(journal, run, "read:2") == 1
    final = AnswerRevision.objects.get(run=run, is_final=True).content
    assert "crestline-short-treasury.md: not included (read:1 failed" in final
    assert run.faults_fired == ["0:tool_error"]


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({"point": "tool_error"}, "tool_error needs 'action'"),
        ({"point": "lease_stolen", "action": 0}, "'action' must be an integer from 1 to"),
        ({"point": "lease_stolen", "action": True}, "'action' must be an integer from 1 to"),
        ({"point": "lease_stolen", "action": 10**20}, "'action' must be an integer from 1 to"),
        ({"point": "tool_delay", "ms": False}, "'ms' must be an integer from 0 to"),
        ({"point": ["cancel"]}, "'point' must be one of"),
        ({"point": {}}, "'point' must be one of"),
        (
            {"point": "drop_connection_at_commit", "action": 1, "write": ["receipt"]},
            "'write' must be one of",
        ),
        (
            {"point": "drop_connection_at_commit", "action": 1, "write": "event"},
            "'write' must be one of ['checkpoint', 'receipt', 'publication', 'boundary']",
        ),
        (
            {"point": "drop_connection_at_commit", "action": 1, "write": "receipt", "outcome": "x"},
            "'outcome' must be one of ['committed', 'aborted', 'late']",
        ),
        ({"point": "delivery_timeout", "step": 1}, "unknown keys ['step']"),
        ({"point": "explode"}, "'point' must be one of"),
    ],
)
def test_a_bad_fault_plan_says_what_is_wrong(plan, message):
    with pytest.raises(FaultPlanError, match=message.replace("[", r"\[").replace("]", r"\]")):
        FaultPlan.parse([plan])

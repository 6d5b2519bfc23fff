"""Checkpoints support execution without narrowing it: every row of the
decision table (docs/DESIGN.md), with its reverse checks.

1. previously committed content can still be read;
2. later independent work continues where the row says so;
3. the original action was executed exactly once (the tool journal);
4. unknown writes, cancellation and lease loss keep their handling.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict

import psycopg
import pytest
from django.db import IntegrityError, connection

from runs.agent import Disagreement
from runs.agents.research import ResearchAgent, ResearchState
from runs.decisions import settle_open_items
from runs.dispatch import Dispatcher
from runs.executor import claim_and_drive
from runs.faults import inject_cancel, steal_lease
from runs.leases import CancelRequested, Lease, LeaseLost
from runs.models import (
    AnswerRevision,
    Checkpoint,
    CheckpointOutcome,
    OutcomeItem,
    OutcomeKind,
    OutcomeState,
    Phase,
    Receipt,
    Run,
    RunStatus,
)
from runs.outcomes import NeedsOperator, xact_status
from runs.submission import submit
from runs.sweep import sweep
from runs.timeline import EventKind, timeline
from tests.faultruns import (
    DOCS,
    KEYS,
    dispatched,
    events,
    executions,
    run_with,
    wait_for,
    write_in_flight,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("short_settle")]


def saved(run: Run) -> list[Checkpoint]:
    return list(run.checkpoints.filter(state__isnull=False).order_by("number"))


def assert_completed_once_each(journal, run: Run) -> None:
    assert run.status == RunStatus.COMPLETED
    for step_key in KEYS:
        assert executions(journal, run, step_key) == 1, step_key


def test_a_checkpoint_follows_each_completed_action_in_its_own_transaction(journal):
    run, outcome = run_with([])

    assert outcome == RunStatus.COMPLETED
    checkpoints = saved(run)
    # After every read, summary and the composition; the delivery ends the run.
    assert [c.number for c in checkpoints] == [1, 2, 3, 4, 5, 6, 7]
    assert [c.after_action.step_key for c in checkpoints] == KEYS[:7]
    receipts = {r.step_key: r for r in Receipt.objects.filter(run=run)}
    for checkpoint in checkpoints:
        assert checkpoint.outcome == CheckpointOutcome.COMMITTED
        assert xact_status(checkpoint.xid) == "committed"
        # Its own transaction: never the one that wrote the receipt before it.
        assert checkpoint.xid != receipts[checkpoint.after_action.step_key].xid
    assert checkpoints[-1].state["position"] == len(DOCS)
    assert [path for path, _ in checkpoints[-1].state["summaries"]] == DOCS


def test_checkpoints_are_due_every_so_many_steps_or_seconds(journal, settings):
    settings.RUNDESK_CHECKPOINT_EVERY, settings.RUNDESK_CHECKPOINT_SECONDS = 3, 3600
    run, outcome = run_with([])
    assert outcome == RunStatus.COMPLETED
    # Due after steps 3 and 6; the agent saves after reads, summaries and
    # the composition only, so after 3 (read:1) and 6 (summarize:2).
    assert [(c.number, c.after_action.step_key) for c in saved(run)] == [
        (3, "read:1"),
        (6, "summarize:2"),
    ]

    settings.RUNDESK_CHECKPOINT_EVERY, settings.RUNDESK_CHECKPOINT_SECONDS = 1000, 0
    run, outcome = run_with([])
    assert [c.number for c in saved(run)] == [1, 2, 3, 4, 5, 6, 7]  # every time is due

    settings.RUNDESK_CHECKPOINT_SECONDS = 3600
    run, outcome = run_with([])
    assert outcome == RunStatus.COMPLETED and saved(run) == []
    assert_completed_once_each(journal, run)

    # Production's cadence: with steps of 300 ms, one every other step.
    settings.RUNDESK_CHECKPOINT_EVERY = 100
    settings.RUNDESK_CHECKPOINT_SECONDS = 0.5
    slow = [{"point": "tool_delay", "ms": 300}]
    run, outcome = run_with(slow)
    assert outcome == RunStatus.COMPLETED
    # 300 ms a step: due after the second step, then every other one.
    numbers = [c.number for c in saved(run)]
    assert numbers and all(b - a <= 3 for a, b in zip([0, *numbers], numbers, strict=False))


# -- row 1: failed before write, receipt verifies, lease held, no cancel ------------


def test_checkpoint_that_fails_before_write_is_handled_locally_and_research_goes_on(journal):
    run, outcome = run_with([{"point": "checkpoint_serialize_error", "action": 1}])

    failed = run.checkpoints.get(number=1)
    assert failed.outcome == CheckpointOutcome.FAILED_BEFORE_WRITE
    assert failed.state is None and "does not serialize" in failed.error
    assert failed.after_action.step_key == "read:0"
    # (1) what was committed before is readable.
    read = Receipt.objects.get(run=run, step_key="read:0")
    assert read.verifies(read.action)
    # (2) the next independent read was dispatched, through its own boundary,
    # and the run went on to its answer.
    assert outcome == RunStatus.COMPLETED
    assert dispatched(run, "read:1")
    assert AnswerRevision.objects.filter(run=run, is_final=True).exists()
    assert [c.number for c in saved(run)] == [2, 3, 4, 5, 6, 7]
    # (3) nothing ran twice.
    assert_completed_once_each(journal, run)
    # The failure narrowed nothing: the phase was never changed by it.
    assert events(run, EventKind.PHASE_CHANGED) == []
    assert run.phase_reason == ""
    assert "handled locally" in events(run, EventKind.CHECKPOINT_FAILED)[0]


def test_checkpoint_failure_never_moves_the_run_to_finalizing_even_when_every_save_fails(
    journal,
):
    plan = [{"point": "checkpoint_serialize_error", "action": k} for k in range(1, 8)]
    run, outcome = run_with(plan)

    assert outcome == RunStatus.COMPLETED
    assert saved(run) == []
    outcomes = set(run.checkpoints.values_list("outcome", flat=True))
    assert outcomes == {CheckpointOutcome.FAILED_BEFORE_WRITE}
    assert events(run, EventKind.PHASE_CHANGED) == []
    final = AnswerRevision.objects.get(run=run, is_final=True).content
    assert "Not included" not in final  # every document was read and compared
    assert_completed_once_each(journal, run)


def test_only_the_budget_moves_a_run_to_finalizing_and_says_why(journal):
    run = submit(question="q", documents=DOCS, action_budget=5)
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    run.refresh_from_db()
    assert run.phase_reason == "action budget of 5 exhausted"
    assert not dispatched(run, "read:1")
    assert "not read (action budget of 5 exhausted)" in (
        AnswerRevision.objects.get(run=run, is_final=True).content
    )


# -- row 2: COMMIT sent, no answer --------------------------------------------------


def test_unanswered_checkpoint_that_committed_is_adopted_by_its_xid(journal):
    plan = [
        {"point": "drop_connection_at_commit", "write": "checkpoint", "action": 1},
    ]
    run, outcome = run_with(plan)

    record = run.checkpoints.get(number=1, state__isnull=True)
    assert record.outcome == CheckpointOutcome.SETTLED_COMMITTED
    assert "status committed" in record.resolution
    written = run.checkpoints.get(number=1, state__isnull=False)
    assert written.xid == record.xid and xact_status(record.xid) == "committed"
    assert written.state["position"] == 0
    assert outcome == RunStatus.COMPLETED
    assert not OutcomeItem.objects.filter(run=run).exists()
    assert_completed_once_each(journal, run)
    assert "COMMIT sent, no answer" in events(run, EventKind.COMMIT_UNANSWERED)[0]


def test_unanswered_checkpoint_that_aborted_is_known_not_written_and_not_written_again(
    journal,
):
    plan = [
        {"point": "drop_connection_at_commit", "write": "checkpoint", "action": 1},
    ]
    plan[0]["outcome"] = "aborted"
    run, outcome = run_with(plan)

    record = run.checkpoints.get(number=1)
    assert record.outcome == CheckpointOutcome.SETTLED_NOT_WRITTEN
    assert xact_status(record.xid) == "aborted"
    assert not run.checkpoints.filter(number=1, state__isnull=False).exists()
    assert outcome == RunStatus.COMPLETED
    assert [c.number for c in saved(run)] == [2, 3, 4, 5, 6, 7]
    assert_completed_once_each(journal, run)


def test_checkpoint_still_in_flight_stays_unknown_until_its_xid_settles_it(journal):
    plan = [
        {
            "point": "drop_connection_at_commit",
            "write": "checkpoint",
            "action": 1,
            "outcome": "late",
            "stall_ms": 4000,
        }
    ]
    run, outcome = run_with(plan)

    record = run.checkpoints.get(number=1, state__isnull=True)
    item = OutcomeItem.objects.get(run=run)
    # Unknown is never treated as not written: an item waits, with evidence.
    assert record.outcome == CheckpointOutcome.UNKNOWN
    assert (item.kind, item.state, item.checkpoint_id) == (
        OutcomeKind.CHECKPOINT,
        OutcomeState.OPEN,
        record.pk,
    )
    assert item.xid == record.xid
    assert {check["xid_status"] for check in item.evidence["checks"]} == {"in progress"}
    assert item.evidence["lease_epoch"] == 1
    # The checkpoint is recovery: the run went on with independent work.
    assert outcome == RunStatus.COMPLETED
    assert_completed_once_each(journal, run)

    # The orphaned transaction ends; the sweep asks again and adopts it.
    wait_for(lambda: xact_status(record.xid) == "committed")
    assert settle_open_items().settled == 1
    record.refresh_from_db()
    item.refresh_from_db()
    assert record.outcome == CheckpointOutcome.SETTLED_COMMITTED
    assert item.state == OutcomeState.SETTLED and "committed" in item.resolution
    assert run.checkpoints.filter(number=1, state__isnull=False).count() == 1
    assert settle_open_items().settled == 0


# -- row 3: no trustworthy receipt, lease lost, cancelled ---------------------------

INVENT_RECEIPT = """
CREATE FUNCTION invent_receipt() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.step_key = 'read:0' THEN NEW.result_digest := repeat('0', 64); END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER invent_receipt BEFORE INSERT ON runs_receipt
    FOR EACH ROW EXECUTE FUNCTION invent_receipt();
"""


def test_a_receipt_that_does_not_verify_does_not_unlock_local_handling(journal):
    with connection.cursor() as cursor:
        cursor.execute(INVENT_RECEIPT)
    try:
        run, outcome = run_with([{"point": "checkpoint_serialize_error", "action": 1}])
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER invent_receipt ON runs_receipt")
            cursor.execute("DROP FUNCTION invent_receipt()")

    assert outcome == RunStatus.NEEDS_OPERATOR
    assert run.status_reason == (
        "checkpoint 1 failed: state does not serialize: Object of type object is not JSON "
        "serializable, and the receipt of read:0 does not verify: no local handling"
    )
    # No further protected effect: nothing else was dispatched or published.
    assert list(run.actions.values_list("step_key", flat=True)) == ["read:0"]
    assert not AnswerRevision.objects.filter(run=run).exists()
    assert executions(journal, run, "read:0") == 1
    assert "no local handling" in events(run, EventKind.NEEDS_OPERATOR)[0]


@pytest.fixture
def checkpoint_fails_after_read():
    """A leased run whose first read completed, and whose checkpoint after
    it will fail before writing (the fault plan's serialize error)."""
    run = submit(
        question="q", documents=DOCS, faults=[{"point": "checkpoint_serialize_error", "action": 1}]
    )
    lease = Lease.claim(run.pk, "owner")
    dispatcher = Dispatcher(lease, stop=threading.Event(), lease_lost=threading.Event())
    return run, lease, dispatcher


def test_a_missing_receipt_does_not_unlock_local_handling(checkpoint_fails_after_read):
    run, lease, dispatcher = checkpoint_fails_after_read
    action_id = lease.record_boundary(
        step_key="read:0", kind="read_document", effect_class="read", input={"path": DOCS[0]}
    )
    # The action is believed complete in memory, but no receipt was ever written.
    dispatcher.progress.steps, dispatcher.completed_now["read:0"] = 1, action_id

    with pytest.raises(NeedsOperator, match="the receipt of read:0 is missing: no local handling"):
        dispatcher.checkpoint("read:0", asdict(ResearchState()))
    assert run.checkpoints.get().outcome == CheckpointOutcome.FAILED_BEFORE_WRITE


def test_a_lost_lease_or_a_cancel_does_not_allow_local_handling(checkpoint_fails_after_read):
    run, _lease, dispatcher = checkpoint_fails_after_read
    dispatcher.step("read:0", "read_document", {"path": DOCS[0]})
    steal_lease(run.pk)

    with pytest.raises(LeaseLost, match="the lease is lost: no local handling"):
        dispatcher.checkpoint("read:0", asdict(ResearchState()))

    other = submit(
        question="q", documents=DOCS, faults=[{"point": "checkpoint_serialize_error", "action": 1}]
    )
    other_lease = Lease.claim(other.pk, "owner")
    other_dispatcher = Dispatcher(other_lease, stop=threading.Event(), lease_lost=threading.Event())
    other_dispatcher.step("read:0", "read_document", {"path": DOCS[0]})
    inject_cancel(other.pk)
    with pytest.raises(CancelRequested, match="the run is cancelled: no local handling"):
        other_dispatcher.checkpoint("read:0", asdict(ResearchState()))


# -- resuming ----------------------------------------------------------------------


def test_a_resumed_run_continues_from_the_newest_checkpoint_and_the_receipts_after_it(journal):
    run, outcome = run_with([{"point": "lease_stolen", "action": 5}])
    assert outcome == "lease_lost"
    assert [c.number for c in saved(run)] == [1, 2, 3, 4]

    Run.objects.filter(pk=run.pk).update(lease_expires_at="2000-01-01T00:00:00Z")
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    run.refresh_from_db()
    assert "continuing from checkpoint 4" in events(run, EventKind.CHECKPOINT_USED)[0]
    # Nothing before the checkpoint was stepped again, not even to reuse it.
    assert events(run, EventKind.ACTION_REUSED) == []
    assert_completed_once_each(journal, run)
    assert run.lease_epoch == 3  # the fault's thief held epoch 2


def test_resuming_from_a_checkpoint_after_a_read_counts_that_read_once(journal):
    # Budget 8 fits two documents exactly (2 actions each, plus compose and
    # deliver).  The checkpoint after read:1 (action 3) is the newest when
    # the lease is stolen; resuming must not count read:1 again and run out.
    run = submit(
        question="q",
        documents=DOCS[:2],
        action_budget=8,
        faults=[{"point": "lease_stolen", "action": 4}],
    )
    assert claim_and_drive(run.pk) == "lease_lost"
    assert saved(run)[-1].after_action.step_key == "read:1"
    Run.objects.filter(pk=run.pk).update(lease_expires_at="2000-01-01T00:00:00Z")

    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    run.refresh_from_db()
    assert run.phase_reason == ""  # the budget was never exhausted
    assert list(run.actions.values_list("step_key", flat=True)) == [
        "read:0",
        "summarize:0",
        "read:1",
        "summarize:1",
        "compose",
        "deliver",
    ]
    assert [c.number for c in saved(run)] == [1, 2, 3, 4, 5]
    assert "Not included" not in AnswerRevision.objects.get(run=run, is_final=True).content
    for step_key in ["read:0", "read:1", "summarize:1"]:
        assert executions(journal, run, step_key) == 1


def test_an_unanswered_checkpoint_with_the_lease_lost_is_not_handled_locally(journal):
    run = submit(
        question="q",
        documents=DOCS,
        faults=[{"point": "drop_connection_at_commit", "write": "checkpoint", "action": 1}],
    )
    lease = Lease.claim(run.pk, "owner")
    dispatcher = Dispatcher(lease, stop=threading.Event(), lease_lost=threading.Event())
    dispatcher.step("read:0", "read_document", {"path": DOCS[0]})
    raised: list[BaseException] = []

    def save() -> None:
        try:
            dispatcher.checkpoint("read:0", asdict(ResearchState()))
        except BaseException as error:
            raised.append(error)
        finally:
            connection.close()

    saver = threading.Thread(target=save)
    saver.start()
    # While the checkpoint is in flight (its connection about to be cut),
    # another owner takes the run.
    wait_for(write_in_flight)
    steal_lease(run.pk)
    saver.join()

    assert len(raised) == 1 and isinstance(raised[0], LeaseLost)
    assert "checkpoint 1 unanswered, and the lease is lost: no local handling" in str(raised[0])
    # The unknown outcome was still settled and recorded.
    assert run.checkpoints.get(state__isnull=True).outcome == CheckpointOutcome.SETTLED_COMMITTED


def test_a_checkpoint_that_disagrees_with_the_receipts_is_ignored(journal):
    run, outcome = run_with([{"point": "lease_stolen", "action": 5}])
    assert outcome == "lease_lost"
    newest = saved(run)[-1]
    # Only its outcome may change: a checkpoint cannot be rewritten...
    with pytest.raises(IntegrityError, match="cannot change, only its outcome"):
        Checkpoint.objects.filter(pk=newest.pk).update(state={"position": 99})
    # ...so the disagreement is made on the receipt's side of the check.
    state = ResearchState.load(newest.state)
    state.receipts["summarize:1"] = "f" * 64
    Checkpoint.objects.create(
        run=run,
        after_action=newest.after_action,
        number=newest.number + 1,
        epoch=newest.epoch,
        outcome=CheckpointOutcome.COMMITTED,
        state={**newest.state, "receipts": state.receipts},
    )
    Run.objects.filter(pk=run.pk).update(lease_expires_at="2000-01-01T00:00:00Z")
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    run.refresh_from_db()
    assert (
        "disagrees with the receipt of summarize:1" in events(run, EventKind.CHECKPOINT_IGNORED)[0]
    )
    # Rebuilt from the receipts: each earlier action was reused, none ran again.
    assert len(events(run, EventKind.ACTION_REUSED)) == 4
    assert_completed_once_each(journal, run)
    assert run.phase == Phase.DONE


def test_a_replay_that_returns_no_state_leaves_the_checkpoint_unused(journal, monkeypatch):
    # `return Disagreement` where a raise was meant: the run resumes from
    # its receipts, as a disagreement does, instead of failing.
    run, outcome = run_with([{"point": "lease_stolen", "action": 5}])
    assert outcome == "lease_lost"
    monkeypatch.setattr(ResearchAgent, "replay", lambda self, after, history: Disagreement)
    Run.objects.filter(pk=run.pk).update(lease_expires_at="2000-01-01T00:00:00Z")
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    run.refresh_from_db()
    assert (
        "replay gave type, not the agent's state" in (events(run, EventKind.CHECKPOINT_IGNORED)[0])
    )
    assert_completed_once_each(journal, run)


def test_a_stranger_holding_the_checkpoint_table_never_holds_the_answer(journal, settings):
    """A migration, a VACUUM FULL, a session left open on runs_checkpoint:
    each checkpoint fails before it writes, within its lock bound, and the
    run delivers.  The executor waited for as long as the lock lasted."""
    settings.RUNDESK_CHECKPOINT_SECONDS = 0  # one after every action
    run = submit(question="q", documents=DOCS[:2])
    with psycopg.connect(**connection.get_connection_params()) as stranger:
        stranger.execute("LOCK TABLE runs_checkpoint IN SHARE MODE")
        started = time.monotonic()
        assert claim_and_drive(run.pk) == RunStatus.COMPLETED
        took = time.monotonic() - started
    assert took < 5 and not Checkpoint.objects.filter(run=run).exists()
    assert executions(journal, run, "deliver") == 1
    timeline.flush()
    failed = events(run, EventKind.CHECKPOINT_FAILED)
    assert len(failed) >= 4 and all("lock timeout" in message for message in failed)
    with connection.cursor() as cursor:
        cursor.execute("SHOW lock_timeout")
        assert cursor.fetchone() == ("0",)  # the bound was the checkpoints' only


@pytest.mark.parametrize("ended", ["committed", "aborted"])
def test_a_checkpoint_left_unknown_by_an_owner_that_stopped_is_settled_by_its_xid(
    journal, settings, ended
):
    """The owner records the unknown row, then asks the evidence (for a
    late COMMIT, for seconds): killed meanwhile, it left the row unknown
    with no item, and nothing ever asked again."""
    settings.RUNDESK_CHECKPOINT_SECONDS = 0
    run = submit(question="q", documents=DOCS[:1])
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    saved = Checkpoint.objects.filter(run=run, state__isnull=False).order_by("number").first()
    xid = saved.xid
    if ended == "aborted":
        with psycopg.connect(**connection.get_connection_params()) as other:
            xid = int(other.execute("SELECT pg_current_xact_id()::text").fetchone()[0])
            other.rollback()
    left = Checkpoint.objects.create(
        run=run,
        after_action=saved.after_action,
        number=saved.number,
        epoch=saved.epoch,
        outcome=CheckpointOutcome.UNKNOWN,
        xid=xid,
        error="COMMIT sent, no answer: the owner was killed",
    )
    swept = sweep()
    left.refresh_from_db()
    assert swept.checkpoints == [run.pk] and left.resolved_at is not None
    assert left.outcome == (
        CheckpointOutcome.SETTLED_COMMITTED
        if ended == "committed"
        else CheckpointOutcome.SETTLED_NOT_WRITTEN
    )
    assert sweep().checkpoints == []

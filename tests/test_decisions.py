"""Operators settle what the runtime cannot, from evidence, and the run goes
on without executing anything twice: each choice end to end on real runs,
with a real local receiver; decisions are immutable, idempotent, and one
settles an item."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import FrozenInstanceError

import psycopg
import pytest
from django.contrib.auth.models import Group, Permission, User
from django.db import DatabaseError, IntegrityError, connection, transaction

from runs.agents.research import ResearchAgent
from runs.decisions import (
    Decided,
    DecisionRefused,
    Request,
    Who,
    decide,
    decide_run,
    gather,
    offers,
)
from runs.executor import claim_and_drive
from runs.models import (
    Action,
    ActionState,
    AnswerRevision,
    DecisionChoice,
    OperatorDecision,
    OutcomeItem,
    OutcomeKind,
    OutcomeState,
    Receipt,
    Run,
    RunStatus,
)
from runs.outcomes import xact_status
from runs.progress import History
from runs.submission import submit
from runs.timeline import EventKind, timeline
from tests.faultruns import DOCS, KEYS, events, executions, run_with, wait_for
from tests.receivers import LocalServer, status

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("short_settle")]


@pytest.fixture
def operator() -> User:
    user = User.objects.create_user("olga", password="x")
    group, _ = Group.objects.get_or_create(name="operators")
    group.permissions.add(Permission.objects.get(codename="operate_run"))
    user.groups.add(group)
    return User.objects.get(pk=user.pk)  # permissions are cached per instance


def asked(choice: str, user: User, **fields: str) -> Request:
    return Request(choice=choice, who=Who(user=user), token=uuid.uuid4().hex, **fields)


@pytest.fixture
def lost_delivery(settings, journal):
    """A run whose delivery reached a real receiver, but whose answer was lost."""
    with LocalServer(status(200)) as receiver:
        settings.RUNDESK_DELIVERY_URL = receiver.url
        run, outcome = run_with([{"point": "delivery_timeout"}])
        assert outcome == RunStatus.NEEDS_OPERATOR and len(receiver.requests) == 1
        yield run, OutcomeItem.objects.get(run=run, kind=OutcomeKind.EFFECT), receiver


def keys(receiver: LocalServer) -> list[str]:
    return [headers["Idempotency-Key"] for headers, _ in receiver.requests]


# -- effects ------------------------------------------------------------------------


def test_confirmed_happened_completes_the_run_without_sending_again(lost_delivery, operator):
    run, item, receiver = lost_delivery
    decided = decide(
        item.pk,
        asked(DecisionChoice.CONFIRMED_HAPPENED, operator, reason="in their log", reference="D-7"),
    )
    assert decided.run_resumed and decided.decision.state_after == OutcomeState.SETTLED
    receipt = Receipt.objects.get(action=item.action)
    assert receipt.verifies(receipt.action)
    assert receipt.result["confirmed_by"] == "olga" and receipt.result["reference"] == "D-7"

    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    assert len(receiver.requests) == 1  # never sent again
    assert AnswerRevision.objects.filter(run=run, is_final=True).exists()


def test_a_decision_made_while_an_owner_loads_the_run_puts_it_back_in_the_queue(
    lost_delivery, operator, monkeypatch
):
    """Its owner died while the run was about to wait (the run was queued
    again with its item open); the next owner read the action as unknown
    just before an operator's decision committed: the run waited, with
    nothing left to decide."""
    run, item, receiver = lost_delivery
    Run.objects.filter(pk=run.pk).update(status=RunStatus.QUEUED)
    loaded = History.of

    def decided_meanwhile(cls: type[History], of: Run) -> History:
        history = loaded(of)
        decide(item.pk, asked(DecisionChoice.RESEND_SAME_IDENTITY, operator, reason="not there"))
        return history

    monkeypatch.setattr(History, "of", classmethod(decided_meanwhile))
    assert claim_and_drive(run.pk) == "requeued"
    monkeypatch.undo()
    run.refresh_from_db()
    assert run.status == RunStatus.QUEUED and "was settled while it stopped" in run.status_reason
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    assert len(receiver.requests) == 2  # sent again once, as decided


def delivered_and_confirmed_after_a_failed_read(
    settings, operator: User, action_budget: int
) -> tuple[Run, LocalServer]:
    """A run whose read:0 failed and whose delivery's answer was lost, at
    the production checkpoint cadence (no checkpoint to resume from): an
    operator confirms the delivery happened, and the run is driven again."""
    settings.RUNDESK_CHECKPOINT_EVERY = 100
    with LocalServer(status(200)) as receiver:
        settings.RUNDESK_DELIVERY_URL = receiver.url
        run = submit(
            question="Compare these funds",
            documents=DOCS,
            action_budget=action_budget,
            faults=[{"point": "tool_error", "action": 1}, {"point": "delivery_timeout"}],
        )
        assert claim_and_drive(run.pk) == RunStatus.NEEDS_OPERATOR
        item = OutcomeItem.objects.get(run=run, kind=OutcomeKind.EFFECT)
        confirmed = asked(DecisionChoice.CONFIRMED_HAPPENED, operator, reason="in their log")
        decide(item.pk, confirmed)
        assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    return run, receiver


def test_a_read_that_failed_stays_failed_when_the_run_resumes(settings, journal, operator):
    """With no checkpoint to resume from, the run steps through its
    actions again: a failed read was read again, its summary changed the
    published draft, and the run ended failed after its report had been
    delivered and confirmed."""
    run, receiver = delivered_and_confirmed_after_a_failed_read(settings, operator, 40)
    assert len(receiver.requests) == 1
    # The fault failed read:0 before its tool ran: nothing read it, then or after.
    assert not journal.counts().get(f"rundesk:run-{run.pk}:read:0")
    final = AnswerRevision.objects.get(run=run, is_final=True).content
    assert "northwind-clean-energy.md: not included (read:0 failed" in final


def test_a_read_that_failed_before_research_ended_is_noted_alike_on_resume(
    settings, journal, operator
):
    """The budget ended research after read:0 had failed: resumed, the run
    said "not read" of it (research was over) where its report, already
    delivered, said "not included", and ended failed."""
    run, receiver = delivered_and_confirmed_after_a_failed_read(settings, operator, 6)
    assert len(receiver.requests) == 1
    final = AnswerRevision.objects.get(run=run, is_final=True).content
    assert f"{DOCS[0]}: not included (read:0 failed" in final
    assert f"{DOCS[2]}: not read (action budget of 6 exhausted)" in final


@pytest.mark.parametrize(
    "choice", [DecisionChoice.RESEND_SAME_IDENTITY, DecisionChoice.CONFIRMED_NOT_HAPPENED]
)
def test_an_authorised_resend_goes_once_more_under_the_same_key(
    lost_delivery, operator, journal, choice
):
    run, item, receiver = lost_delivery
    decide(item.pk, asked(choice, operator, reason="the receiver has no record of it"))
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    key = run.actions.get(step_key="deliver").idempotency_key
    assert keys(receiver) == [key, key]  # exactly one more, same key
    deliver = Action.objects.get(run=run, step_key="deliver")
    assert (deliver.state, deliver.attempts) == (ActionState.COMPLETED, 2)
    assert all(executions(journal, run, key) == 1 for key in KEYS[:-1])
    # The timeline says why it went again (it said "a read with no receipt").
    timeline.flush()
    assert events(run, EventKind.ACTION_REDISPATCHED) == [
        "deliver: sent again under its identity, as an operator decided (attempt 2)"
    ]


def test_the_database_counts_the_decisions_that_authorise_a_second_dispatch(
    lost_delivery, operator
):
    _, item, _ = lost_delivery
    deliver = item.action
    with pytest.raises(IntegrityError, match="action_effect_dispatched_once"), transaction.atomic():
        Action.objects.filter(pk=deliver.pk).update(attempts=2)
    decide(item.pk, asked(DecisionChoice.RESEND_SAME_IDENTITY, operator, reason="resend"))
    Action.objects.filter(pk=deliver.pk).update(attempts=2)  # one decision: one more
    with pytest.raises(IntegrityError, match="action_effect_dispatched_once"), transaction.atomic():
        Action.objects.filter(pk=deliver.pk).update(attempts=3)


def test_a_run_upgraded_while_it_waited_delivers_the_answer_it_published(
    lost_delivery, operator, monkeypatch
):
    """The code that writes the report changed while the run waited (a
    deploy): the final revision readers read stands, and is what the
    resent delivery carries.  The run ended failed ("exists with other
    content")."""
    run, item, receiver = lost_delivery
    published = AnswerRevision.objects.get(run=run, is_final=True)
    compose = ResearchAgent._compose
    monkeypatch.setattr(ResearchAgent, "_compose", lambda *a: compose(*a) + "\nWritten anew.\n")
    decide(item.pk, asked(DecisionChoice.CONFIRMED_NOT_HAPPENED, operator, reason="not there"))
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    assert [body for _, body in receiver.requests] == [published.content.encode()] * 2
    assert list(run.revisions.values_list("number", "content")) == [
        (1, run.revisions.get(number=1).content),
        (2, published.content),
    ]
    timeline.flush()
    assert events(run, EventKind.REVISION_KEPT) == [
        "revision 2 stands as published; this run now writes it otherwise"
    ]


def test_a_resent_delivery_whose_answer_is_lost_again_is_a_new_item(lost_delivery, operator):
    run, item, receiver = lost_delivery
    decide(item.pk, asked(DecisionChoice.CONFIRMED_NOT_HAPPENED, operator, reason="not there"))
    Run.objects.filter(pk=run.pk).update(faults=[{"point": "delivery_timeout"}], faults_fired=[])
    assert claim_and_drive(run.pk) == RunStatus.NEEDS_OPERATOR
    again = OutcomeItem.objects.get(run=run, state=OutcomeState.OPEN)
    assert again.pk != item.pk and again.subject.endswith("attempt-2")
    assert len(receiver.requests) == 2


# -- database writes whose evidence is gone -----------------------------------------


def unanswered_receipt(settle_as: str) -> tuple[Run, OutcomeItem]:
    """A receipt whose COMMIT answer was lost, whose transaction then ended
    (committed, or aborted), and whose transaction id is no longer known."""
    fault = {"point": "drop_connection_at_commit", "write": "receipt", "action": 3}
    killer = threading.Thread(target=_abort_the_orphan, daemon=True)
    if settle_as == "aborted":
        killer.start()
    run, outcome = run_with([{**fault, "outcome": "late", "stall_ms": 6000}])
    assert outcome == RunStatus.NEEDS_OPERATOR
    item = OutcomeItem.objects.get(run=run, kind=OutcomeKind.RECEIPT)
    if settle_as == "aborted":
        killer.join(30)
    wait_for(
        lambda: xact_status(item.xid) == ("aborted" if settle_as == "aborted" else "committed")
    )
    evidence = {k: v for k, v in item.evidence.items() if not k.startswith("backend")}
    # Items are records (a trigger): the evidence is removed behind its back.
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("ALTER TABLE runs_outcomeitem DISABLE TRIGGER USER")
        OutcomeItem.objects.filter(pk=item.pk).update(xid=None, evidence=evidence)
        cursor.execute("ALTER TABLE runs_outcomeitem ENABLE TRIGGER USER")
    item.refresh_from_db()
    return run, item


def _abort_the_orphan() -> None:
    """Once the item is open, ends the writer still in flight: it aborts."""
    try:
        wait_for(lambda: OutcomeItem.objects.filter(kind=OutcomeKind.RECEIPT).exists())
        item = OutcomeItem.objects.get(kind=OutcomeKind.RECEIPT)
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s, 5000)", [item.evidence["backend_pid"]])
    finally:
        connection.close()


def test_an_operator_adopts_a_receipt_whose_evidence_is_gone(journal, operator):
    run, item = unanswered_receipt("committed")
    shown = gather(item)
    assert (shown["now"]["xid_status"], shown["now"]["row_found"]) == (None, True)
    assert [o.choice for o in offers(item, shown)] == ["check_again", "written"]
    with pytest.raises(DecisionRefused, match="not offered"):
        decide(item.pk, asked(DecisionChoice.NOT_WRITTEN, operator, reason="guess"))
    decide(item.pk, asked(DecisionChoice.WRITTEN, operator, reason="the row is there"))
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    assert all(executions(journal, run, key) == 1 for key in KEYS)


def test_a_receipt_known_not_written_is_written_again_and_the_read_runs_at_most_once_more(
    journal, operator
):
    run, item = unanswered_receipt("aborted")
    assert [o.choice for o in offers(item, gather(item))] == ["check_again", "not_written"]
    decide(item.pk, asked(DecisionChoice.NOT_WRITTEN, operator, reason="no row, writer gone"))
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    assert executions(journal, run, "read:1") == 2  # dispatched again under its identity
    assert all(executions(journal, run, key) == 1 for key in KEYS if key != "read:1")


def test_check_again_settles_what_the_evidence_now_can(journal, operator):
    fault = {"point": "drop_connection_at_commit", "write": "receipt", "action": 3}
    run, _ = run_with([{**fault, "outcome": "late", "stall_ms": 3000}])
    item = OutcomeItem.objects.get(run=run)
    wait_for(lambda: xact_status(item.xid) == "committed")
    decided = decide(item.pk, asked(DecisionChoice.CHECK_AGAIN, operator, reason="look again"))
    assert decided.decision.state_after == OutcomeState.SETTLED and decided.run_resumed


# -- the decisions themselves ----------------------------------------------------------


def test_the_same_token_twice_is_one_decision_and_the_repeat_says_it_changed_nothing(
    lost_delivery, operator
):
    _, item, _ = lost_delivery
    request = asked(DecisionChoice.CONFIRMED_HAPPENED, operator, reason="in their log")
    first = decide(item.pk, request)
    again = decide(item.pk, request)
    assert first == Decided(first.decision, repeated=False, run_resumed=True)
    assert again == Decided(first.decision, repeated=True, run_resumed=False)
    assert OperatorDecision.objects.filter(item=item).count() == 1
    # What the call did is said by its result: the rows are left as they are.
    for decided in (first, again):
        assert not {"repeated", "run_resumed"} & set(vars(decided.decision))
    with pytest.raises(FrozenInstanceError):
        again.repeated = False  # type: ignore[misc]


def test_a_repeated_run_decision_is_the_first_one_and_says_it_changed_nothing(
    lost_delivery, operator
):
    run, _, _ = lost_delivery
    request = asked(DecisionChoice.ABANDON, operator, reason="customer withdrew")
    first = decide_run(run.pk, request)
    again = decide_run(run.pk, request)
    assert first == Decided(first.decision, repeated=False, run_resumed=False)
    assert again == Decided(first.decision, repeated=True, run_resumed=False)
    assert first.decision.state_after == RunStatus.CANCELLED
    assert not {"repeated", "run_resumed"} & set(vars(again.decision))


def test_the_same_token_with_another_choice_or_person_is_refused_and_names_what_stands(
    lost_delivery, operator
):
    """A token names one request: a repeat of it with another choice, or by
    another person, is not that request, and saying "already recorded"
    would tell them their decision was taken."""
    _, item, _ = lost_delivery
    first = decide(
        item.pk, asked(DecisionChoice.CONFIRMED_HAPPENED, operator, reason="seen")
    ).decision
    other = User.objects.create_user("omar")
    other.groups.add(Group.objects.get(name="operators"))
    for choice, user in [
        (DecisionChoice.CONFIRMED_NOT_HAPPENED, operator),
        (DecisionChoice.CONFIRMED_HAPPENED, other),
    ]:
        request = Request(choice=choice, who=Who(user=user), token=first.request_token, reason="x")
        with pytest.raises(DecisionRefused, match="token was used for another choice") as refused:
            decide(item.pk, request)
        assert refused.value.decision.pk == first.pk
    assert OperatorDecision.objects.filter(item=item).count() == 1


def test_two_operators_at_once_one_decision_settles_the_item(lost_delivery, operator):
    _, item, _ = lost_delivery
    other = User.objects.create_user("omar")
    other.groups.add(Group.objects.get(name="operators"))
    outcomes: list[object] = []
    barrier = threading.Barrier(2)

    def deciding(user: User, choice: str) -> None:
        try:
            barrier.wait()
            outcomes.append(decide(item.pk, asked(choice, user, reason="mine")))
        except DecisionRefused as refused:
            outcomes.append(refused)
        finally:
            connection.close()

    threads = [
        threading.Thread(target=deciding, args=(operator, DecisionChoice.CONFIRMED_HAPPENED)),
        threading.Thread(
            target=deciding,
            args=(User.objects.get(pk=other.pk), DecisionChoice.CONFIRMED_NOT_HAPPENED),
        ),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    decisions = [o.decision for o in outcomes if isinstance(o, Decided)]
    refused = [o for o in outcomes if isinstance(o, DecisionRefused)]
    assert len(decisions) == 1 and len(refused) == 1
    assert refused[0].decision.pk == decisions[0].pk  # the loser sees the winner
    assert OperatorDecision.objects.filter(item=item).count() == 1


def test_people_without_the_permission_or_a_reason_cannot_decide(lost_delivery, operator):
    _, item, _ = lost_delivery
    viewer = User.objects.create_user("vera")
    with pytest.raises(DecisionRefused, match="operator permission"):
        decide(item.pk, asked(DecisionChoice.CONFIRMED_HAPPENED, viewer, reason="x"))
    with pytest.raises(DecisionRefused, match="reason"):
        decide(item.pk, asked(DecisionChoice.CONFIRMED_HAPPENED, operator, reason="  "))
    assert not OperatorDecision.objects.exists()


def test_a_decision_cannot_be_changed_or_deleted(lost_delivery, operator):
    _, item, _ = lost_delivery
    decision = decide(
        item.pk, asked(DecisionChoice.CONFIRMED_HAPPENED, operator, reason="seen")
    ).decision
    for sql in (
        "UPDATE runs_operatordecision SET reason = 'rewritten' WHERE id = %s",
        "DELETE FROM runs_operatordecision WHERE id = %s",
    ):
        with (
            pytest.raises(DatabaseError, match="immutable"),
            transaction.atomic(),
            connection.cursor() as cursor,
        ):
            cursor.execute(sql, [decision.pk])
    decision.refresh_from_db()
    assert decision.reason == "seen" and len(decision.evidence_digest) == 64


def test_the_sweeps_settlements_are_system_decisions(journal):
    fault = {"point": "drop_connection_at_commit", "write": "receipt", "action": 3}
    run, _ = run_with([{**fault, "outcome": "late", "stall_ms": 3000}])
    item = OutcomeItem.objects.get(run=run)
    wait_for(lambda: xact_status(item.xid) == "committed")
    from runs.sweep import sweep

    assert sweep().resumed == [run.pk]
    decision = OperatorDecision.objects.get(item=item)
    assert decision.user is None and decision.decided_by.startswith("system: ")
    assert decision.choice == DecisionChoice.WRITTEN and decision.evidence["evidence"]["xid"]


def test_a_person_cannot_take_the_token_the_sweep_settles_an_item_with(journal, operator):
    fault = {"point": "drop_connection_at_commit", "write": "receipt", "action": 3}
    run, _ = run_with([{**fault, "outcome": "late", "stall_ms": 3000}])
    item = OutcomeItem.objects.get(run=run)
    taken = Request(
        choice=DecisionChoice.CHECK_AGAIN,
        who=Who(user=operator),
        token=f"system:item-{item.pk}",
        reason="mine first",
    )
    with pytest.raises(DecisionRefused, match="the system's"):
        decide(item.pk, taken)
    with pytest.raises(DecisionRefused, match="the system's"):
        decide_run(run.pk, taken)
    assert not OperatorDecision.objects.exists()
    wait_for(lambda: xact_status(item.xid) == "committed")
    from runs.sweep import sweep

    assert sweep().resumed == [run.pk]


# -- the run ------------------------------------------------------------------------


def test_a_decision_on_a_run_a_stranger_holds_is_refused_not_left_hanging(lost_delivery, operator):
    run, item, _ = lost_delivery
    with psycopg.connect(**connection.get_connection_params()) as stranger:
        stranger.execute("SELECT 1 FROM runs_run WHERE id = %s FOR SHARE", [run.pk])
        started = time.monotonic()
        with pytest.raises(DecisionRefused, match=f"item {item.pk} or its run is locked"):
            decide(item.pk, asked(DecisionChoice.CONFIRMED_HAPPENED, operator, reason="seen"))
        with pytest.raises(DecisionRefused, match=f"run {run.pk} is locked by another session"):
            decide_run(run.pk, asked(DecisionChoice.ABANDON, operator, reason="withdrawn"))
        stranger.rollback()
        # A table the decision reads, before it locks anything.
        stranger.execute("LOCK TABLE runs_receipt IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(DecisionRefused, match=f"item {item.pk} or its run is locked"):
            decide(item.pk, asked(DecisionChoice.CONFIRMED_HAPPENED, operator, reason="seen"))
        assert time.monotonic() - started < 15
    assert not OperatorDecision.objects.exists()
    decide(item.pk, asked(DecisionChoice.CONFIRMED_HAPPENED, operator, reason="seen"))


def test_an_ended_runs_effect_item_offers_no_send(lost_delivery, operator):
    run, item, receiver = lost_delivery
    decide_run(run.pk, asked(DecisionChoice.ABANDON, operator, reason="customer withdrew"))
    item.refresh_from_db()
    offered = [o.choice for o in offers(item, gather(item))]
    assert offered == ["confirmed_happened", "confirmed_not_happened"]
    with pytest.raises(DecisionRefused, match="not offered"):
        decide(item.pk, asked(DecisionChoice.RESEND_SAME_IDENTITY, operator, reason="again"))
    decide(item.pk, asked(DecisionChoice.CONFIRMED_NOT_HAPPENED, operator, reason="not there"))
    assert "the run had ended: not sent again" in Action.objects.get(pk=item.action_id).error
    assert claim_and_drive(run.pk) == "not_claimable" and len(receiver.requests) == 1


def test_abandon_ends_a_waiting_run_and_keeps_what_it_wrote(lost_delivery, operator):
    run, item, receiver = lost_delivery
    with pytest.raises(DecisionRefused, match="not offered"):  # an item holds it
        decide_run(run.pk, asked(DecisionChoice.RESUME, operator, reason="go"))
    decide_run(run.pk, asked(DecisionChoice.ABANDON, operator, reason="customer withdrew"))
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED
    assert run.status_reason == "abandoned by olga: customer withdrew"
    assert AnswerRevision.objects.filter(run=run, is_final=True).exists()
    assert OutcomeItem.objects.get(pk=item.pk).state == OutcomeState.OPEN
    assert claim_and_drive(run.pk) == "not_claimable" and len(receiver.requests) == 1

"""Facts stay facts: the database itself refuses to change receipts, answer
revisions and the timeline, and its constraints keep identities, effects,
final answers and ownership honest, whoever writes (the ORM or raw SQL)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from django.db import IntegrityError, connection, transaction
from django.db.utils import Error as DatabaseLibraryError

from runs.leases import Lease
from runs.models import (
    Action,
    ActionState,
    AnswerRevision,
    Receipt,
    Run,
    RunEvent,
    RunStatus,
    digest,
)
from runs.submission import submit
from runs.timeline import EventKind, timeline

# Transactional: the timeline writes the submission event on its own
# connection, after the run is committed.
pytestmark = pytest.mark.django_db(transaction=True)

DOCS = ["northwind-clean-energy.md", "crestline-short-treasury.md"]
RESULT = {"path": DOCS[0], "bytes": 42, "sha256": "ab" * 32, "text": "# Northwind"}


@dataclass
class Facts:
    run: Run
    lease: Lease
    read: Action
    deliver: Action
    receipt: Receipt
    final: AnswerRevision
    event: RunEvent


@pytest.fixture
def facts() -> Facts:
    """A run with a receipt, a final answer and a timeline, built through the
    real lease API."""
    run = submit(question="Which fund is cheapest?", documents=DOCS)
    lease = Lease.claim(run.pk, "owner")
    assert lease is not None
    read_id = lease.record_boundary(
        step_key="read:0", kind="read_document", effect_class="read", input={"path": DOCS[0]}
    )
    deliver_id = lease.record_boundary(
        step_key="deliver", kind="deliver_report", effect_class="effect", input={"content": "r"}
    )
    lease.record_receipt(read_id, RESULT)
    assert lease.publish_revision(1, "# Final answer\n", is_final=True) is True
    timeline.flush()
    return Facts(
        run=run,
        lease=lease,
        read=Action.objects.get(pk=read_id),
        deliver=Action.objects.get(pk=deliver_id),
        receipt=Receipt.objects.get(pk=read_id),
        final=AnswerRevision.objects.get(run=run, number=1),
        event=RunEvent.objects.get(run=run, kind=EventKind.SUBMITTED),
    )


def refused(statement) -> DatabaseLibraryError:
    """Runs `statement` in a savepoint and returns the database's refusal."""
    with pytest.raises(DatabaseLibraryError) as error, transaction.atomic():
        statement()
    return error.value


def raw(sql: str, *params: object) -> None:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


def assert_immutable_refusal(error: DatabaseLibraryError, op: str, table: str) -> None:
    """The trigger's refusal: SQLSTATE 23001 restrict_violation, which Django
    reports as an IntegrityError, naming the operation and the table."""
    assert isinstance(error, IntegrityError)
    assert error.__cause__.sqlstate == "23001"
    assert f"rundesk: {op} on {table} is refused" in str(error)


def receipt_row(receipt: Receipt) -> tuple:
    return (
        Receipt.objects.filter(pk=receipt.pk)
        .values_list(
            "action_id", "run_id", "step_key", "result", "result_digest", "epoch", "created_at"
        )
        .get()
    )


# -- the fixture built real facts -------------------------------------------------


def test_lease_api_writes_a_receipt_that_verifies_under_the_actions_identity(facts):
    assert facts.read.state == ActionState.COMPLETED
    assert (facts.receipt.run_id, facts.receipt.step_key) == (facts.run.pk, "read:0")
    assert facts.receipt.result == RESULT
    assert facts.receipt.result_digest == digest(RESULT)
    assert facts.receipt.epoch == facts.lease.epoch == 1
    assert facts.receipt.verifies(facts.read) is True


def test_receipt_does_not_verify_against_another_action(facts):
    assert facts.receipt.verifies(facts.deliver) is False


def test_receipt_does_not_verify_when_its_result_no_longer_matches_its_digest(facts):
    tampered = Receipt.objects.get(pk=facts.receipt.pk)
    tampered.result = {**RESULT, "text": "# Something else"}
    assert tampered.verifies(facts.read) is False


def test_receipt_does_not_verify_an_action_of_another_run_with_the_same_step_key(facts):
    other_run = submit(question="Another run", documents=DOCS)
    other_lease = Lease.claim(other_run.pk, "owner")
    other_id = other_lease.record_boundary(
        step_key="read:0", kind="read_document", effect_class="read", input={"path": DOCS[0]}
    )
    assert facts.receipt.verifies(Action.objects.get(pk=other_id)) is False


# -- receipts are immutable --------------------------------------------------------


def test_database_refuses_to_update_a_receipt_through_the_orm(facts):
    before = receipt_row(facts.receipt)

    error = refused(
        lambda: Receipt.objects.filter(pk=facts.receipt.pk).update(result={"text": "forged"})
    )

    assert_immutable_refusal(error, "UPDATE", "runs_receipt")
    assert receipt_row(facts.receipt) == before


def test_database_refuses_to_save_a_changed_receipt_instance(facts):
    before = receipt_row(facts.receipt)
    facts.receipt.result_digest = "0" * 64

    assert_immutable_refusal(refused(facts.receipt.save), "UPDATE", "runs_receipt")
    assert receipt_row(facts.receipt) == before


def test_database_refuses_to_update_a_receipt_through_raw_sql(facts):
    before = receipt_row(facts.receipt)

    error = refused(
        lambda: raw(
            "UPDATE runs_receipt SET epoch = epoch + 1, step_key = 'read:9' WHERE action_id = %s",
            facts.receipt.pk,
        )
    )

    assert_immutable_refusal(error, "UPDATE", "runs_receipt")
    assert receipt_row(facts.receipt) == before


def test_database_refuses_to_delete_a_receipt_through_the_orm(facts):
    before = receipt_row(facts.receipt)

    error = refused(lambda: Receipt.objects.filter(pk=facts.receipt.pk).delete())
    assert_immutable_refusal(error, "DELETE", "runs_receipt")
    assert_immutable_refusal(refused(facts.receipt.delete), "DELETE", "runs_receipt")

    assert receipt_row(facts.receipt) == before
    assert Receipt.objects.get(pk=facts.receipt.pk).verifies(facts.read)


def test_database_refuses_to_delete_a_receipt_through_raw_sql(facts):
    before = receipt_row(facts.receipt)

    error = refused(lambda: raw("DELETE FROM runs_receipt WHERE run_id = %s", facts.run.pk))

    assert_immutable_refusal(error, "DELETE", "runs_receipt")
    assert receipt_row(facts.receipt) == before


# -- answer revisions are immutable --------------------------------------------------


def revision_row(revision: AnswerRevision) -> tuple:
    return (
        AnswerRevision.objects.filter(pk=revision.pk)
        .values_list("number", "content", "content_digest", "is_final", "epoch", "committed_at")
        .get()
    )


def test_database_refuses_to_update_a_published_answer_revision(facts):
    before = revision_row(facts.final)

    orm = refused(
        lambda: AnswerRevision.objects.filter(pk=facts.final.pk).update(content="# Rewritten")
    )
    sql = refused(
        lambda: raw("UPDATE runs_answerrevision SET is_final = false WHERE id = %s", facts.final.pk)
    )

    assert_immutable_refusal(orm, "UPDATE", "runs_answerrevision")
    assert_immutable_refusal(sql, "UPDATE", "runs_answerrevision")
    assert revision_row(facts.final) == before


def test_database_refuses_to_delete_a_published_answer_revision(facts):
    before = revision_row(facts.final)

    orm = refused(lambda: AnswerRevision.objects.filter(run=facts.run).delete())
    sql = refused(lambda: raw("DELETE FROM runs_answerrevision WHERE id = %s", facts.final.pk))

    assert_immutable_refusal(orm, "DELETE", "runs_answerrevision")
    assert_immutable_refusal(sql, "DELETE", "runs_answerrevision")
    assert revision_row(facts.final) == before


# -- the timeline is append-only -----------------------------------------------------


def test_database_refuses_to_rewrite_a_timeline_event(facts):
    before = RunEvent.objects.filter(pk=facts.event.pk).values_list("kind", "message").get()

    orm = refused(
        lambda: RunEvent.objects.filter(pk=facts.event.pk).update(message="nothing happened")
    )
    sql = refused(
        lambda: raw("UPDATE runs_runevent SET kind = 'run_completed' WHERE id = %s", facts.event.pk)
    )

    assert_immutable_refusal(orm, "UPDATE", "runs_runevent")
    assert_immutable_refusal(sql, "UPDATE", "runs_runevent")
    after = RunEvent.objects.filter(pk=facts.event.pk).values_list("kind", "message").get()
    assert after == before == (EventKind.SUBMITTED, "2 documents")


def test_refused_change_leaves_the_transaction_usable_for_further_work(facts):
    refused(lambda: Receipt.objects.filter(pk=facts.receipt.pk).update(epoch=99))

    # Later work that does not depend on the refused change goes on.
    assert facts.lease.publish_revision(2, "# Appendix\n", is_final=False) is True
    assert list(AnswerRevision.objects.filter(run=facts.run).values_list("number", flat=True)) == [
        1,
        2,
    ]


# -- constraints ---------------------------------------------------------------------


def test_a_second_action_under_the_same_identity_is_refused(facts):
    duplicate = Action(
        run=facts.run,
        step_key="read:0",
        kind="read_document",
        effect_class="read",
        input={"path": DOCS[1]},
        input_digest=digest({"path": DOCS[1]}),
        epoch=facts.lease.epoch,
    )

    with pytest.raises(IntegrityError, match="action_identity_unique"), transaction.atomic():
        duplicate.save()

    # The lease API does not reuse the identity either: it reports it exists.
    assert (
        facts.lease.record_boundary(
            step_key="read:0", kind="read_document", effect_class="read", input={"path": DOCS[1]}
        )
        is None
    )
    [action] = Action.objects.filter(run=facts.run, step_key="read:0")
    assert action.input == {"path": DOCS[0]} and action.state == ActionState.COMPLETED


def test_the_same_step_key_in_another_run_is_another_identity(facts):
    other = submit(question="Another run", documents=DOCS)
    lease = Lease.claim(other.pk, "owner")
    assert (
        lease.record_boundary(
            step_key="read:0", kind="read_document", effect_class="read", input={"path": DOCS[0]}
        )
        is not None
    )


def test_an_effect_is_never_dispatched_a_second_time(facts):
    with pytest.raises(IntegrityError, match="action_effect_dispatched_once"), transaction.atomic():
        Action.objects.filter(pk=facts.deliver.pk).update(attempts=2)

    # A read may be dispatched again under its identity.
    Action.objects.filter(pk=facts.read.pk).update(attempts=2)
    attempts = dict(Action.objects.filter(run=facts.run).values_list("step_key", "attempts"))
    assert attempts == {"read:0": 2, "deliver": 1}


def test_an_effect_action_cannot_be_created_with_two_attempts(facts):
    with pytest.raises(IntegrityError, match="action_effect_dispatched_once"), transaction.atomic():
        Action.objects.create(
            run=facts.run,
            step_key="deliver:again",
            kind="deliver_report",
            effect_class="effect",
            input={},
            input_digest=digest({}),
            epoch=1,
            attempts=2,
        )
    assert not Action.objects.filter(step_key="deliver:again").exists()


def test_a_second_final_answer_for_a_run_is_refused(facts):
    with pytest.raises(IntegrityError, match="revision_one_final_per_run"), transaction.atomic():
        facts.lease.publish_revision(2, "# Another final answer\n", is_final=True)
    with pytest.raises(IntegrityError, match="revision_one_final_per_run"), transaction.atomic():
        AnswerRevision.objects.create(
            run=facts.run,
            number=3,
            content="# Yet another",
            content_digest=digest("# Yet another"),
            is_final=True,
            epoch=1,
        )

    finals = AnswerRevision.objects.filter(run=facts.run, is_final=True)
    assert list(finals.values_list("number", "content")) == [(1, "# Final answer\n")]


def test_republishing_a_revision_with_other_content_is_refused(facts):
    assert facts.lease.publish_revision(1, "# Final answer\n", is_final=True) is False
    with pytest.raises(ValueError, match="exists with other content"):
        facts.lease.publish_revision(1, "# A different answer\n", is_final=True)
    assert revision_row(facts.final)[1] == "# Final answer\n"


def test_a_running_run_without_an_owner_is_refused(facts):
    with pytest.raises(IntegrityError, match="run_running_has_owner"), transaction.atomic():
        Run.objects.filter(pk=facts.run.pk).update(lease_owner="")
    with pytest.raises(IntegrityError, match="run_running_has_owner"), transaction.atomic():
        Run.objects.filter(pk=facts.run.pk).update(lease_expires_at=None)

    facts.run.refresh_from_db()
    assert (facts.run.status, facts.run.lease_owner) == (RunStatus.RUNNING, "owner")
    assert facts.run.lease_expires_at is not None


# -- submitting a run ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"question": "   ", "documents": DOCS}, "the question is empty"),
        ({"question": "", "documents": DOCS}, "the question is empty"),
        ({"question": "q", "documents": []}, "at least one document"),
        ({"question": "q", "documents": DOCS, "faults": [{"point": "nope"}]}, "'point' must be"),
        ({"question": "q", "documents": DOCS, "faults": {"point": "tool_delay"}}, "JSON list"),
        (
            {"question": "q", "documents": DOCS, "faults": [{"point": "tool_delay", "ms": -1}]},
            "'ms' must be",
        ),
        (
            {"question": "q", "documents": DOCS, "faults": [{"point": "tool_delay", "x": 1}]},
            "unknown keys",
        ),
        ({"question": "q", "documents": DOCS, "action_budget": 0}, "budget must be at least 1"),
        ({"question": "q", "documents": DOCS, "action_budget": 2**31}, "at most 2147483647"),
        ({"question": "q\x00", "documents": DOCS}, "NUL or a lone surrogate"),
        ({"question": "q\udc80", "documents": DOCS}, "NUL or a lone surrogate"),
        # The column would cut a longer path short: the run would read another file.
        ({"question": "q", "documents": ["a/" * 250 + "b"]}, "501 characters; at most 500"),
        ({"question": "q", "documents": [DOCS[0], " "]}, "document 2 is not a path"),
        ({"question": "q", "documents": ["a\x00b"]}, "document 1 is not a path"),
        ({"question": "q", "documents": ["a.md\n# Injected"]}, "document 1 is not a path"),
        ({"question": "q", "documents": [7]}, r"input\.documents\[0\]: 7 is not of type 'string'"),
    ],
    ids=[
        "blank-question",
        "empty-question",
        "no-documents",
        "unknown-fault-point",
        "faults-not-a-list",
        "negative-delay",
        "unknown-fault-key",
        "zero-budget",
        "budget-beyond-its-column",
        "nul-in-question",
        "surrogate-in-question",
        "path-longer-than-its-column",
        "blank-path",
        "nul-in-path",
        "newline-in-path",
        "path-not-text",
    ],
)
def test_submit_rejects_bad_input_and_creates_no_run(fields, message):
    with pytest.raises(ValueError, match=message):
        submit(**fields)
    assert not Run.objects.exists()
    assert not RunEvent.objects.exists()


def test_submit_queues_a_run_with_a_submitted_event():
    run = submit(
        question="  Which fund is cheapest?  ",
        documents=DOCS,
        faults=[{"point": "tool_delay", "ms": 10}],
    )

    run.refresh_from_db()
    assert (run.question, run.documents, run.status) == (
        "Which fund is cheapest?",
        DOCS,
        RunStatus.QUEUED,
    )
    assert run.faults == [{"point": "tool_delay", "ms": 10}]
    timeline.flush()
    assert list(run.events.values_list("kind", "message")) == [(EventKind.SUBMITTED, "2 documents")]

"""A run goes from queued to completed: receipts, revisions, delivery."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, transaction

from runs.executor import Executor, claim_and_drive
from runs.models import Action, AnswerRevision, Phase, Receipt, Run, RunStatus
from runs.submission import submit
from runs.timeline import EventKind
from tests.receivers import LocalServer, status

pytestmark = pytest.mark.django_db(transaction=True)

DOCS = ["northwind-clean-energy.md", "crestline-short-treasury.md", "meridian-world-equity.md"]


def test_run_goes_from_queued_to_completed_with_receipts_and_revisions(journal, _outbox):
    run = submit(question="Which fund is cheapest?", documents=DOCS)
    assert run.status == RunStatus.QUEUED

    assert claim_and_drive(run.pk) == RunStatus.COMPLETED

    run.refresh_from_db()
    assert (run.status, run.phase, run.lease_owner) == (RunStatus.COMPLETED, Phase.DONE, "")
    assert run.finished_at is not None
    keys = list(run.actions.values_list("step_key", flat=True))
    assert keys == [
        "read:0",
        "summarize:0",
        "read:1",
        "summarize:1",
        "read:2",
        "summarize:2",
        "compose",
        "deliver",
    ]
    assert not Action.objects.filter(run=run).exclude(state="completed").exists()
    assert Receipt.objects.filter(run=run).count() == len(keys)
    for action in run.actions.select_related("receipt"):
        assert action.receipt.verifies(action)
    revisions = list(AnswerRevision.objects.filter(run=run))
    assert [(r.number, r.is_final) for r in revisions] == [(1, False), (2, True)]
    assert revisions[0].content.startswith("**Draft** — 1 of 3")
    assert revisions[1].committed_at >= revisions[0].committed_at
    # Each document was read once, for real.
    assert sorted(journal.counts("read_document").values()) == [1, 1, 1]
    # The report was delivered once, to the outbox, under the action's key.
    delivered = list(_outbox.iterdir())
    key = run.actions.get(step_key="deliver").idempotency_key
    assert [p.name for p in delivered] == [key.replace(":", "%3A") + ".md"]
    assert delivered[0].read_text() == revisions[1].content
    kinds = list(run.events.values_list("kind", flat=True))
    assert kinds[0] == EventKind.SUBMITTED and kinds[-1] == EventKind.RUN_COMPLETED
    assert kinds.count(EventKind.ACTION_DISPATCHED) == len(keys)


def test_final_report_puts_the_funds_side_by_side():
    run = submit(question="Compare fees and risks", documents=DOCS)
    claim_and_drive(run.pk)
    final = AnswerRevision.objects.get(run=run, is_final=True).content
    assert "| | NWCE | CSTB | MWEI |" in final
    assert "| Expense ratio | 0.45% | 0.07% | 0.09% |" in final
    assert "- Expense ratio: Lowest CSTB (0.07%), highest NWCE (0.45%)." in final
    assert "Solvane Power — 7.2%" in final
    assert "Policy: returns depend on subsidies" in final


def test_a_run_over_another_corpus_of_prose_reports_each_documents_points(settings, tmp_path):
    corpus = tmp_path / "articles"
    (corpus / "2026").mkdir(parents=True)
    (corpus / "2026" / "leases.txt").write_text(
        "Leases and fencing\n\nA lease names one owner of a run. A claim raises the epoch.\n"
    )
    (corpus / "receipts.md").write_text(
        "# Receipts\n\n* A receipt records that an action completed under its lease.\n"
    )
    (corpus / "latin1.txt").write_bytes(
        "Café notes\n\nThe lease holder reads é as bytes.".encode("latin-1")
    )
    # No receipt could hold a NUL: left in, it failed the read's receipt
    # at every attempt, and the run was retried for ever.
    (corpus / "nul.txt").write_bytes(b"Binary lease dump\n\nA lease \x00 record.\n")
    (corpus / "utf16.txt").write_text("Lease of UTF-16\n\nThe lease is read.\n", "utf-16")
    settings.RUNDESK_CORPUS_DIR = corpus
    run = submit(
        question="How do runs stay safe?",
        documents=["2026/leases.txt", "receipts.md", "latin1.txt", "nul.txt", "utf16.txt"],
        action_budget=12,
    )

    assert claim_and_drive(run.pk) == RunStatus.COMPLETED

    final = AnswerRevision.objects.get(run=run, is_final=True).content
    lines = final.splitlines()
    assert (
        "Documents compared: Leases and fencing, Receipts, Caf\ufffd notes, Binary lease dump, "
        "Lease of UTF-16." in lines
    )
    assert "- A lease \ufffd record." in lines and "- The lease is read." in lines
    assert "- A lease names one owner of a run." in lines
    assert "- A receipt records that an action completed under its lease." in lines
    assert "- Terms every document uses: lease." in lines
    assert "Not included" not in final


def test_refused_document_is_reported_and_the_run_still_completes(journal):
    # Submission refuses such a path now (test_submit_paths.py): a run queued
    # before it did still meets the read tool's refusal.
    documents = ["../../etc/passwd", DOCS[0]]
    run = Run.objects.create(
        question="Compare",
        documents=documents,
        input={"question": "Compare", "documents": documents},
    )
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    receipt = Receipt.objects.get(run=run, step_key="read:0")
    assert "'..' is refused" in receipt.result["refused"]
    final = AnswerRevision.objects.get(run=run, is_final=True).content
    assert "../../etc/passwd" in final and "NWCE" in final
    assert set(journal.counts("read_document")) == {f"rundesk:run-{run.pk}:read:1"}


def test_exhausted_budget_moves_to_finalizing_and_still_answers(journal):
    run = submit(question="Compare", documents=DOCS, action_budget=6)
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    run.refresh_from_db()
    assert run.phase == Phase.DONE
    assert "budget of 6 exhausted" in run.events.get(kind=EventKind.PHASE_CHANGED).message
    # Two documents fit in the budget (2 actions each), plus compose and deliver.
    assert run.actions.count() == 6
    assert len(journal.counts("read_document")) == 2
    final = AnswerRevision.objects.get(run=run, is_final=True).content
    assert "meridian-world-equity.md: not read (action budget of 6 exhausted)" in final


def test_executor_once_drains_the_queue_with_concurrency():
    runs = [submit(question=f"q{i}", documents=DOCS[:1]) for i in range(4)]
    drivers = []
    executor = Executor(
        concurrency=2,
        poll_seconds=0.05,
        # Told on the run's own thread.
        on_ending=lambda run, ending: drivers.append(threading.current_thread()),
    )
    results = executor.serve(once=True)
    assert sorted(results) == sorted((r.pk, RunStatus.COMPLETED) for r in runs)
    assert set(Run.objects.values_list("lease_epoch", flat=True)) == {1}
    # A thread that drove a run drives the next: two threads for four runs.
    assert len(drivers) == 4 and len(set(drivers)) <= 2


def test_completed_run_is_not_claimable_again(journal):
    run = submit(question="q", documents=DOCS[:1])
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    assert claim_and_drive(run.pk) == "not_claimable"
    assert sum(journal.counts().values()) == 4  # read, summarize, compose, deliver


def test_refused_delivery_fails_the_run_and_a_requeue_does_not_send_it_again(settings):
    with LocalServer(status(422)) as receiver:
        settings.RUNDESK_DELIVERY_URL = receiver.url
        run = submit(question="q", documents=DOCS[:1])
        assert claim_and_drive(run.pk) == RunStatus.FAILED
        assert Action.objects.get(run=run, step_key="deliver").state == "failed"
        # Requeued by hand, past the lifecycle (a failed run never goes back
        # to the queue): the runtime must not decide to send the effect again.
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("ALTER TABLE runs_run DISABLE TRIGGER run_lifecycle")
            Run.objects.filter(pk=run.pk).update(status=RunStatus.QUEUED, finished_at=None)
            cursor.execute("ALTER TABLE runs_run ENABLE TRIGGER run_lifecycle")
        assert claim_and_drive(run.pk) == RunStatus.NEEDS_OPERATOR
        run.refresh_from_db()
        assert "known not to have happened" in run.status_reason
        assert len(receiver.requests) == 1
        assert AnswerRevision.objects.filter(run=run, is_final=True).exists()

"""Resume without replay, with real executor processes killed mid-run."""

from __future__ import annotations

import json
import os
import signal

import pytest

from runs.models import Action, AnswerRevision, OutcomeItem, Receipt, Run, RunStatus
from runs.submission import submit
from runs.timeline import EventKind
from tests.conftest import manage
from tests.faultruns import wait_for
from tests.receivers import LocalServer, status

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

DOCS = ["northwind-clean-energy.md", "crestline-short-treasury.md", "meridian-world-equity.md"]


def finish(proc) -> str:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return out


def test_sigkill_mid_run_then_another_executor_completes_without_replay(process_env, journal):
    run = submit(question="Compare", documents=DOCS, faults=[{"point": "tool_delay", "ms": 150}])
    first = manage("executor", "--run", str(run.pk), env=process_env)
    wait_for(lambda: Receipt.objects.filter(run=run).count() >= 3)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    done_before_kill = set(Receipt.objects.filter(run=run).values_list("step_key", flat=True))
    assert 3 <= len(done_before_kill) < 8

    # The next executor starts at once, and takes the run when the dead
    # owner's lease has expired (it starts meanwhile).
    second = manage("executor", "--json", env=process_env)
    try:
        wait_for(lambda: Run.objects.filter(pk=run.pk, status=RunStatus.COMPLETED).exists())
    finally:
        second.send_signal(signal.SIGTERM)
    assert json.loads(finish(second)) == {"run_id": run.pk, "outcome": "completed"}

    run.refresh_from_db()
    assert (run.status, run.lease_epoch) == (RunStatus.COMPLETED, 2)
    counts = journal.counts()
    for step_key in done_before_kill:
        assert counts[f"rundesk:run-{run.pk}:{step_key}"] == 1, step_key
    assert sorted(journal.counts("read_document").values())[-1] <= 2
    assert AnswerRevision.objects.filter(run=run, is_final=True).exists()
    assert Receipt.objects.filter(run=run).count() == 8
    assert run.events.filter(kind=EventKind.RESUMED).exists()
    # The second owner went on from the newest checkpoint and the receipts
    # after it: no action completed before the kill was dispatched again.
    assert run.events.filter(kind=EventKind.CHECKPOINT_USED).exists()
    assert not run.events.filter(
        kind__in=[EventKind.ACTION_DISPATCHED, EventKind.ACTION_REDISPATCHED],
        action__step_key__in=done_before_kill,
        data__epoch=2,
    ).exists()


def test_effect_with_boundary_and_no_receipt_is_marked_unknown_never_sent_again(
    process_env, journal
):
    with LocalServer(status(200)) as receiver:
        env = {**process_env, "RUNDESK_DELIVERY_URL": receiver.url}
        # Action 4 is the delivery: its boundary is written, then the tool waits.
        run = submit(
            question="q",
            documents=DOCS[:1],
            faults=[{"point": "tool_delay", "action": 4, "ms": 60_000}],
        )
        first = manage("executor", "--run", str(run.pk), env=env)
        wait_for(lambda: Action.objects.filter(run=run, step_key="deliver").exists())
        os.kill(first.pid, signal.SIGKILL)
        first.wait()

        second = manage("executor", "--json", env=env)  # as above
        try:
            waiting = Run.objects.filter(pk=run.pk, status=RunStatus.NEEDS_OPERATOR)
            wait_for(waiting.exists)
        finally:
            second.send_signal(signal.SIGTERM)
        assert json.loads(finish(second))["outcome"] == RunStatus.NEEDS_OPERATOR

        run.refresh_from_db()
        deliver = Action.objects.get(run=run, step_key="deliver")
        assert deliver.state == "unknown" and deliver.attempts == 1
        assert "may have happened" in run.status_reason
        assert receiver.requests == []  # never delivered blindly
        # Only the receiver knows: the item for an operator says what to ask it.
        item = OutcomeItem.objects.get(run=run)
        assert (item.kind, item.action_id, item.state) == ("effect", deliver.pk, "open")
        assert item.evidence["idempotency_key"] == deliver.idempotency_key
        # The published answer is still readable.
        assert AnswerRevision.objects.filter(run=run, is_final=True).exists()
        assert run.events.filter(kind=EventKind.NEEDS_OPERATOR).exists()


def test_sigterm_gives_the_run_back_and_another_executor_finishes_it(process_env, journal):
    run = submit(question="q", documents=DOCS, faults=[{"point": "tool_delay", "ms": 150}])
    first = manage("executor", "--concurrency", "1", env=process_env)
    wait_for(lambda: Receipt.objects.filter(run=run).count() >= 2)
    first.send_signal(signal.SIGTERM)
    finish(first)
    run.refresh_from_db()
    assert run.status == RunStatus.QUEUED and run.lease_owner == ""

    second = manage("executor", "--once", "--json", env=process_env)
    assert json.loads(finish(second))["outcome"] == RunStatus.COMPLETED
    assert max(journal.counts("read_document").values()) == 1

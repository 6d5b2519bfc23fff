"""Recovery edges (issue 34): an xid this server does not know (lost with
the WAL, a failover, a restore) is evidence, not a 500; one lock order for
a decision and the owner's wait; a choice the state no longer allows is
refused under the lock; the inbox shows every run that waits."""

from __future__ import annotations

import datetime as dt
import html
import json
import re
import threading
import uuid
from collections.abc import Callable
from io import StringIO
from typing import Any

import psycopg
import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connection
from django.db.models import F

from runs import decisions
from runs.agents.tools import DELIVER_REPORT
from runs.decisions import DecisionRefused, Request, Who, decide, decide_run, gather, offers
from runs.executor import _end, claim_and_drive
from runs.leases import Lease
from runs.models import (
    Action,
    ActionState,
    Checkpoint,
    CheckpointOutcome,
    DecisionChoice,
    OperatorDecision,
    OutcomeItem,
    OutcomeKind,
    OutcomeState,
    Run,
    RunStatus,
)
from runs.outcomes import open_item
from runs.submission import submit
from runs.sweep import sweep
from tests.faultruns import DOCS, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("short_settle")]

UNKNOWN_TO_SERVER = "this server does not know that transaction"


# -- an xid in the future ----------------------------------------------------------------


def future_xid() -> int:
    """An xid this server has not reached: what a checkpoint's announced xid
    reads as after its WAL was lost, a failover or a restore."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_current_xact_id()::text::bigint + 1000000")
        return cursor.fetchone()[0]


def completed_run(settings) -> tuple[Run, Checkpoint]:
    settings.RUNDESK_CHECKPOINT_SECONDS = 0
    run = submit(question="q", documents=DOCS[:1])
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    saved = Checkpoint.objects.filter(run=run, state__isnull=False).order_by("number").first()
    return run, saved


def left_unknown(saved: Checkpoint, xid: int) -> Checkpoint:
    return Checkpoint.objects.create(
        run_id=saved.run_id,
        after_action=saved.after_action,
        number=saved.number,
        epoch=saved.epoch,
        outcome=CheckpointOutcome.UNKNOWN,
        xid=xid,
        error="COMMIT sent, no answer: the server crashed",
    )


def future_item(settings) -> OutcomeItem:
    run, saved = completed_run(settings)
    record = left_unknown(saved, future_xid())
    return open_item(
        run_id=run.pk,
        kind=OutcomeKind.CHECKPOINT,
        subject=f"checkpoint:{record.pk}",
        summary=f"checkpoint {record.number}: COMMIT sent, no answer",
        evidence={"xid": record.xid, "afterwards": "the run went on"},
        checkpoint=record,
        xid=record.xid,
    )


def test_an_xid_in_the_future_reads_as_unknown_to_this_server_on_the_item_page(settings, operator):
    item = future_item(settings)
    response = operator.get(f"/inbox/{item.pk}/")
    assert response.status_code == 200
    page = response.content.decode()
    assert UNKNOWN_TO_SERVER in page and "restored" in page


def test_check_again_on_an_xid_in_the_future_keeps_the_item_open(settings, operator_user):
    item = future_item(settings)
    decided = decide(
        item.pk,
        Request(DecisionChoice.CHECK_AGAIN, Who(user=operator_user), "t-1", reason="again"),
    )
    assert decided.decision.state_after == OutcomeState.OPEN
    item.refresh_from_db()
    assert item.state == OutcomeState.OPEN


def test_outcomes_show_says_an_xid_in_the_future_is_unknown_to_this_server(settings):
    item = future_item(settings)
    out = StringIO()
    call_command("outcomes", "show", str(item.pk), "--json", stdout=out)
    shown = json.loads(out.getvalue())
    assert shown["evidence"]["now"]["xid_status"] == "unknown to this server"
    assert any(UNKNOWN_TO_SERVER in sentence for sentence in shown["known"])
    text = StringIO()
    call_command("outcomes", "show", str(item.pk), stdout=text)
    assert UNKNOWN_TO_SERVER in text.getvalue()


def test_an_xid_in_the_future_offers_what_the_probe_by_identity_allows(settings):
    item = future_item(settings)
    # The probe finds checkpoint 1's saved row: it may be adopted as written.
    choices = {offer.choice for offer in offers(item, gather(item))}
    assert choices == {DecisionChoice.CHECK_AGAIN, DecisionChoice.WRITTEN}


def test_the_sweep_settles_each_checkpoint_on_its_own(settings):
    run, saved = completed_run(settings)
    future = left_unknown(saved, future_xid())
    normal = left_unknown(saved, saved.xid)  # committed: settles by its xid
    swept = sweep()
    future.refresh_from_db()
    normal.refresh_from_db()
    assert normal.outcome == CheckpointOutcome.SETTLED_COMMITTED
    assert swept.checkpoints == [run.pk]
    # The one the server does not know stays open, as an item for operators.
    assert future.outcome == CheckpointOutcome.UNKNOWN
    item = OutcomeItem.objects.get(checkpoint=future)
    assert item.state == OutcomeState.OPEN and UNKNOWN_TO_SERVER in item.summary
    assert sweep().checkpoints == []
    assert OutcomeItem.objects.get(checkpoint=future).state == OutcomeState.OPEN


# -- one lock order --------------------------------------------------------------------


def effect_item_on_a_running_run(*, owner_lost_the_run: bool = False) -> tuple[Lease, OutcomeItem]:
    """A running run whose delivery's answer its owner has just lost: the
    owner is about to end its run as waiting for an operator.  With
    `owner_lost_the_run`, the owner that dispatched it lost its lease during
    the call, and the next owner found the action dispatched, with no
    receipt: that call may still be in flight."""
    run = submit(question="q", documents=["a.md"])
    lease = Lease.claim(run.pk, "owner")
    action_id = lease.record_boundary(
        step_key="deliver", kind="deliver_report", effect_class="effect", input={"to": "x"}
    )
    if owner_lost_the_run:
        Run.objects.filter(pk=run.pk).update(lease_expires_at=F("lease_expires_at") - HOUR)
        lease = Lease.claim(run.pk, "next owner")
    lease.record_action_state(action_id, ActionState.UNKNOWN, "delivery answer lost")
    item = open_item(
        run_id=run.pk,
        kind=OutcomeKind.EFFECT,
        subject=f"effect:action-{action_id}:attempt-1",
        summary="the outcome of deliver is unknown: delivery answer lost",
        evidence={"idempotency_key": f"key-{action_id}", "lease_epoch": lease.epoch},
        action_id=action_id,
    )
    return lease, item


HOUR = dt.timedelta(hours=1)


def confirmed(user: User) -> Request:
    return Request(
        DecisionChoice.CONFIRMED_HAPPENED, Who(user=user), uuid.uuid4().hex, reason="in their log"
    )


def in_threads(*work: Callable[[], Any]) -> list[BaseException]:
    """Runs each in a thread of its own (its own connection) at once; what
    each raised."""
    raised: list[BaseException] = []
    start = threading.Barrier(len(work))

    def run(job: Callable[[], Any]) -> None:
        try:
            start.wait()
            job()
        except BaseException as error:
            raised.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(job,)) for job in work]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return raised


def waits_for_a_lock(pid: int) -> bool:
    with psycopg.connect(**connection.get_connection_params()) as watcher:
        return watcher.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = %s AND NOT granted)", [pid]
        ).fetchone()[0]


def test_a_decision_and_the_owners_wait_lock_in_one_order(operator_user, monkeypatch):
    """The decision holds what it locked while the owner ends its run as
    waiting and looks for its item: neither deadlocks, nor is refused."""
    lease, item = effect_item_on_a_running_run()
    owner_pid: list[int] = []
    holding = threading.Event()
    recorded = decisions._record

    def record_once_the_owner_waits(*args: Any, **kwargs: Any) -> Any:
        holding.set()
        wait_for(lambda: bool(owner_pid) and waits_for_a_lock(owner_pid[0]))
        return recorded(*args, **kwargs)

    def owner_waits() -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            owner_pid.append(cursor.fetchone()[0])
        wait_for(holding.is_set)
        _end(lease, RunStatus.NEEDS_OPERATOR, "the outcome of deliver is unknown", item_id=item.pk)

    monkeypatch.setattr(decisions, "_record", record_once_the_owner_waits)
    raised = in_threads(lambda: decide(item.pk, confirmed(operator_user)), owner_waits)
    assert raised == []
    item.refresh_from_db()
    assert item.state == OutcomeState.SETTLED
    # Whichever came second put the run back in the queue.
    assert Run.objects.get(pk=item.run_id).status == RunStatus.QUEUED


def test_decisions_and_owners_waits_at_once_never_deadlock(operator_user):
    for _ in range(25):
        lease, item = effect_item_on_a_running_run()
        raised = in_threads(
            lambda item=item: decide(item.pk, confirmed(operator_user)),
            lambda lease=lease, item=item: _end(
                lease, RunStatus.NEEDS_OPERATOR, "the outcome is unknown", item_id=item.pk
            ),
        )
        assert raised == [], [str(error) for error in raised]
        assert Run.objects.get(pk=item.run_id).status == RunStatus.QUEUED


# -- a choice the state no longer allows is refused under the lock ---------------------


def waiting_effect_item(**how: bool) -> OutcomeItem:
    lease, item = effect_item_on_a_running_run(**how)
    _end(lease, RunStatus.NEEDS_OPERATOR, "the outcome of deliver is unknown", item_id=item.pk)
    return item


def abandoned_once_gathered(monkeypatch: pytest.MonkeyPatch, user: User) -> None:
    """A decision's evidence is gathered while its run waits; another
    operator's abandon commits before the decision takes its locks."""
    gathered = decisions.gather

    def gathered_then_abandoned(of: OutcomeItem) -> dict[str, Any]:
        shown = gathered(of)
        abandon = Request(DecisionChoice.ABANDON, Who(user=user), "t-2", reason="gone")
        assert in_threads(lambda: decide_run(of.run_id, abandon)) == []
        return shown

    monkeypatch.setattr(decisions, "gather", gathered_then_abandoned)


def test_a_resend_racing_an_abandon_is_refused_under_the_lock(operator_user, monkeypatch):
    """The resend's evidence was gathered while the run waited; an abandon
    committed before the resend took its locks."""
    item = waiting_effect_item()
    assert DecisionChoice.RESEND_SAME_IDENTITY in {o.choice for o in offers(item, gather(item))}
    abandoned_once_gathered(monkeypatch, operator_user)
    resend = Request(
        DecisionChoice.RESEND_SAME_IDENTITY, Who(user=operator_user), "t-1", reason="not there"
    )
    with pytest.raises(DecisionRefused, match=r"run \d+ is cancelled"):
        decide(item.pk, resend)
    assert Run.objects.get(pk=item.run_id).status == RunStatus.CANCELLED
    assert not OperatorDecision.objects.filter(choice=DecisionChoice.RESEND_SAME_IDENTITY).exists()
    assert Action.objects.get(pk=item.action_id).state == ActionState.UNKNOWN
    item.refresh_from_db()
    assert item.state == OutcomeState.OPEN


def test_a_choice_whose_meaning_an_abandon_changed_is_refused_under_the_lock(
    operator_user, monkeypatch
):
    """'It did not happen' sends the effect once more on a waiting run and
    only records it on an ended one: taken as the first, it is not
    recorded as the second."""
    item = waiting_effect_item()
    abandoned_once_gathered(monkeypatch, operator_user)
    not_there = Request(
        DecisionChoice.CONFIRMED_NOT_HAPPENED, Who(user=operator_user), "t-1", reason="not there"
    )
    with pytest.raises(DecisionRefused, match="it ended while this was decided"):
        decide(item.pk, not_there)
    assert not OperatorDecision.objects.filter(item=item).exists()


def test_sending_again_waits_until_the_previous_owners_call_cannot_be_in_flight(
    settings, operator_user, operator
):
    settings.RUNDESK_LEASE_SECONDS = 15.0
    item = waiting_effect_item(owner_lost_the_run=True)
    dispatched = Action.objects.get(pk=item.action_id).dispatched_at
    # The lease, then the timeout the tool declares: its own I/O gives up by then.
    lasts = 15 + DELIVER_REPORT.timeout
    offered_at = (dispatched + dt.timedelta(seconds=lasts)).astimezone(dt.UTC)
    words = (
        f"offered from {offered_at:%H:%M:%S} UTC, when the previous owner's call can no "
        "longer be in flight"
    )
    assert [o.choice for o in offers(item, gather(item))] == [DecisionChoice.CONFIRMED_HAPPENED]
    page = html.unescape(operator.get(f"/inbox/{item.pk}/").content.decode())
    assert words in page and 'value="resend_same_identity"' not in page
    shown = StringIO()
    call_command("outcomes", "show", str(item.pk), stdout=shown)
    assert words in shown.getvalue()
    for choice in (DecisionChoice.RESEND_SAME_IDENTITY, DecisionChoice.CONFIRMED_NOT_HAPPENED):
        request = Request(choice, Who(user=operator_user), uuid.uuid4().hex, reason="not there")
        with pytest.raises(DecisionRefused, match=re.escape(f"not offered yet: {words}")):
            decide(item.pk, request)
    assert not OperatorDecision.objects.exists()

    # Once that call cannot be in flight any more, both are offered.
    Action.objects.filter(pk=item.action_id).update(dispatched_at=F("dispatched_at") - HOUR)
    item = OutcomeItem.objects.get(pk=item.pk)
    assert {o.choice for o in offers(item, gather(item))} == {
        DecisionChoice.CONFIRMED_HAPPENED,
        DecisionChoice.RESEND_SAME_IDENTITY,
        DecisionChoice.CONFIRMED_NOT_HAPPENED,
    }
    assert "no longer be in flight" not in operator.get(f"/inbox/{item.pk}/").content.decode()
    resend = Request(
        DecisionChoice.RESEND_SAME_IDENTITY, Who(user=operator_user), "t-3", reason="not there"
    )
    assert decide(item.pk, resend).run_resumed


def test_an_owner_that_saw_its_calls_answer_lost_leaves_nothing_in_flight(operator_user):
    item = waiting_effect_item()
    resend = Request(
        DecisionChoice.RESEND_SAME_IDENTITY, Who(user=operator_user), "t-1", reason="not there"
    )
    assert decide(item.pk, resend).run_resumed


# -- the inbox shows every waiting run ---------------------------------------------------


def waiting_with_a_checkpoint_item() -> tuple[Run, OutcomeItem]:
    """A run that waits for an operator (its receipt does not verify), and
    whose only open item is an unknown checkpoint's, which holds nothing."""
    run = submit(question="q", documents=["a.md"])
    lease = Lease.claim(run.pk, "owner")
    action_id = lease.record_boundary(
        step_key="read:0", kind="read_document", effect_class="read", input={"path": "a.md"}
    )
    record = Checkpoint.objects.create(
        run=run,
        after_action_id=action_id,
        number=1,
        epoch=lease.epoch,
        outcome=CheckpointOutcome.UNKNOWN,
        error="COMMIT sent, no answer",
    )
    item = open_item(
        run_id=run.pk,
        kind=OutcomeKind.CHECKPOINT,
        subject=f"checkpoint:{record.pk}",
        summary="checkpoint 1: COMMIT sent, no answer, and the evidence does not settle it",
        evidence={"xid": None},
        checkpoint=record,
    )
    lease.finish(RunStatus.NEEDS_OPERATOR, "the receipt of read:0 does not verify")
    return run, item


def test_a_waiting_run_whose_only_item_is_a_checkpoints_is_in_the_inbox(viewer):
    run, item = waiting_with_a_checkpoint_item()
    page = html.unescape(viewer.get("/inbox/").content.decode())
    waiting = page[page.index("Runs waiting") : page.index("<h2>Items</h2>")]
    assert f'<a href="/runs/{run.pk}/">run {run.pk}</a>' in waiting
    assert "the receipt of read:0 does not verify" in waiting
    assert f'href="/inbox/{item.pk}/"' in waiting  # its item, which holds nothing
    listed = StringIO()
    call_command("outcomes", "list", "--json", stdout=listed)
    (row,) = json.loads(listed.getvalue())["waiting_runs"]
    assert row["id"] == run.pk and row["open_items"] == [item.pk]
    assert [offer["choice"] for offer in row["offers"]] == ["resume", "abandon"]


def test_a_checkpoint_item_of_a_waiting_run_says_what_holds_the_run(viewer):
    _, item = waiting_with_a_checkpoint_item()
    page = html.unescape(viewer.get(f"/inbox/{item.pk}/").content.decode())
    assert "went on" not in page
    assert "the run waits for an operator for another reason" in page
    assert "the receipt of read:0 does not verify" in page


def test_a_run_an_item_holds_is_listed_by_its_item_not_among_the_runs_waiting(viewer):
    run, _ = waiting_with_a_checkpoint_item()
    open_item(
        run_id=run.pk,
        kind=OutcomeKind.RECEIPT,
        subject=f"receipt:{uuid.uuid4().hex}",
        summary="receipt: COMMIT sent, no answer",
        evidence={"xid": None},
    )
    page = viewer.get("/inbox/").content.decode()
    assert "Runs waiting" not in page and "the whole run" in page

"""Recovery edges (issue 34): an xid this server does not know (lost with
the WAL, a failover, a restore) is evidence, not a 500; one lock order for
a decision and the owner's wait; a choice the state no longer allows is
refused under the lock; the inbox shows every run that waits."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection

from runs.decisions import Request, Who, decide, gather, offers
from runs.executor import claim_and_drive
from runs.models import (
    Checkpoint,
    CheckpointOutcome,
    DecisionChoice,
    OutcomeItem,
    OutcomeKind,
    OutcomeState,
    Run,
    RunStatus,
)
from runs.outcomes import open_item
from runs.sweep import sweep
from tests.faultruns import DOCS

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
    run = Run.objects.submit(question="q", documents=DOCS[:1])
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
    decision = decide(
        item.pk,
        Request(DecisionChoice.CHECK_AGAIN, Who(user=operator_user), "t-1", reason="again"),
    )
    assert decision.state_after == OutcomeState.OPEN
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
    assert normal.outcome == CheckpointOutcome.RESOLVED_COMMITTED
    assert swept.checkpoints == [run.pk]
    # The one the server does not know stays open, as an item for operators.
    assert future.outcome == CheckpointOutcome.UNKNOWN
    item = OutcomeItem.objects.get(checkpoint=future)
    assert item.state == OutcomeState.OPEN and UNKNOWN_TO_SERVER in item.summary
    assert sweep().checkpoints == []
    assert OutcomeItem.objects.get(checkpoint=future).state == OutcomeState.OPEN

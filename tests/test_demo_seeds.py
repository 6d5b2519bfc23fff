"""The demo seeds sample runs, each of which submission takes, and one run
for each row of the decision table: each ends as its row says, through a
real executor.  Its support runs mail through its SMTP server and update
its helpdesk, and two of them leave an effect's lost answer in the inbox.
Its support-approved run's reply waits in the inbox for its operator, an
approver, to approve.

Two of the demo's waits are cut here (`shortened`): its late checkpoint
stays in flight 4 s, not 8 (the runtime stops asking after 2 s here, 5 s
in the demo: that the demo's own stall outlasts that is asserted), and its
slow support run's tools take 100 ms, not 1.5 s (a pace for the demo's
pages, where the run is seen in flight; nothing here depends on it)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from runs.approvals import APPROVE, decide_approval
from runs.decisions import Request, Who, settle_open_items
from runs.executor import Executor
from runs.management.commands.demo import (
    APPROVAL_RUN,
    DECISION_TABLE_RUNS,
    HELPDESK_LOSES,
    SAMPLE_RUNS,
    SUPPORT_RUNS,
    TWO_FUNDS,
    operator_account,
    support_receivers,
)
from runs.models import (
    ActionState,
    CheckpointOutcome,
    DecisionChoice,
    OutcomeItem,
    OutcomeKind,
    RunStatus,
)
from runs.outcomes import xact_status
from runs.submission import submit
from tests.faultruns import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

# How long the runtime asks after an unanswered commit, here; the late
# checkpoint's transaction stays in flight longer.
SETTLE_SECONDS = 2
LATE_STALL_MS = 4_000
TOOL_DELAY_MS = 100


def shortened(faults: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The demo's fault plan, its waits cut (the module's docstring)."""
    cut = []
    for fault in faults:
        if fault.get("outcome") == "late":
            fault = {**fault, "stall_ms": LATE_STALL_MS}
        elif fault["point"] == "tool_delay":
            fault = {**fault, "ms": TOOL_DELAY_MS}
        cut.append(fault)
    return cut


def test_every_sample_run_of_the_demo_is_taken_at_submission():
    runs = [submit(**sample) for sample in SAMPLE_RUNS]
    assert [run.status for run in runs] == [RunStatus.QUEUED] * len(SAMPLE_RUNS)


def test_each_decision_table_run_of_the_demo_ends_as_its_row_says(settings):
    # In the demo (settings' default), too, its late checkpoint outlasts
    # the runtime's asking.
    (late_plan,) = [f for _, faults in DECISION_TABLE_RUNS for f in faults if "stall_ms" in f]
    assert late_plan["stall_ms"] / 1000 > settings.RUNDESK_SETTLE_SECONDS
    settings.RUNDESK_SETTLE_SECONDS = SETTLE_SECONDS
    runs = [
        submit(question=question, documents=TWO_FUNDS, faults=shortened(faults))
        for question, faults in DECISION_TABLE_RUNS
    ]
    outcomes = dict(Executor().serve(once=True))
    assert [outcomes[run.pk] for run in runs] == [
        RunStatus.COMPLETED,  # row 1: handled locally
        RunStatus.COMPLETED,  # row 2: committed, adopted
        RunStatus.COMPLETED,  # row 2: aborted, known not written
        RunStatus.COMPLETED,  # row 2: still in flight: unknown, the run went on
        "lease_lost",  # row 3: the old owner stops
        RunStatus.CANCELLED,  # row 3: nothing new dispatched
        RunStatus.NEEDS_OPERATOR,  # the effect's answer was lost
    ]
    records = [run.checkpoints.filter(state__isnull=True).first() for run in runs[:4]]
    assert [r.outcome for r in records] == [
        CheckpointOutcome.FAILED_BEFORE_WRITE,
        CheckpointOutcome.SETTLED_COMMITTED,
        CheckpointOutcome.SETTLED_NOT_WRITTEN,
        CheckpointOutcome.UNKNOWN,
    ]
    items = {item.run_id: item for item in OutcomeItem.objects.all()}
    assert set(items) == {runs[3].pk, runs[6].pk}
    assert items[runs[6].pk].kind == OutcomeKind.EFFECT

    late = items[runs[3].pk]
    wait_for(lambda: xact_status(late.xid) == "committed")
    assert settle_open_items().settled == 1
    records[3].refresh_from_db()
    assert records[3].outcome == CheckpointOutcome.SETTLED_COMMITTED


def test_the_demos_support_runs_leave_a_lost_mail_and_a_lost_ticket_update_in_the_inbox(
    settings, tmp_path: Path
):
    mailbox, helpdesk = support_receivers(tmp_path, "smtp://127.0.0.1:0", "http://127.0.0.1:0/")
    with mailbox, helpdesk:
        settings.RUNDESK_SMTP_URL, settings.RUNDESK_HELPDESK_URL = mailbox.url, helpdesk.url
        runs = [
            submit(agent="support", input=input, faults=shortened(faults))
            for input, faults in SUPPORT_RUNS
        ]
        outcomes = dict(Executor().serve(once=True))

        assert [outcomes[run.pk] for run in runs] == [
            RunStatus.COMPLETED,
            RunStatus.NEEDS_OPERATOR,  # the mail went; its answer was lost
            RunStatus.NEEDS_OPERATOR,  # the helpdesk kept the update; its answer was lost
            RunStatus.COMPLETED,
        ]
        items = {item.run_id: item for item in OutcomeItem.objects.select_related("action")}
        assert set(items) == {runs[1].pk, runs[2].pk}
        assert [(items[run.pk].kind, items[run.pk].action.step_key) for run in runs[1:3]] == [
            (OutcomeKind.EFFECT, "send"),
            (OutcomeKind.EFFECT, "update"),
        ]
        assert all(item.action.state == ActionState.UNKNOWN for item in items.values())
        # Where a person sees them: one mail per run, an update for each
        # run whose mail is known sent.
        assert len(mailbox.messages()) == len(SUPPORT_RUNS)
        updated = [update["ticket"] for update in helpdesk.updates()]
        assert sorted(updated) == sorted(["T-1042", HELPDESK_LOSES, "T-1045"])


def test_the_demos_approved_support_run_waits_with_its_mail_for_the_demos_operator_to_approve(
    settings, tmp_path: Path
):
    mailbox, helpdesk = support_receivers(tmp_path, "smtp://127.0.0.1:0", "http://127.0.0.1:0/")
    with mailbox, helpdesk:
        settings.RUNDESK_SMTP_URL, settings.RUNDESK_HELPDESK_URL = mailbox.url, helpdesk.url
        operator = operator_account("demo-password")
        # support-approved is installed by default: the demo's seed is taken.
        run = submit(agent="support-approved", input=APPROVAL_RUN)

        assert dict(Executor().serve(once=True))[run.pk] == RunStatus.NEEDS_OPERATOR
        item = OutcomeItem.objects.get(run=run)
        assert item.kind == OutcomeKind.APPROVAL
        proposed = item.evidence["input"]
        assert (proposed["to"], proposed["subject"]) == (
            "ada.lovelace@example.com",
            "Re: Refund for a damaged grinder [T-1042]",
        )
        assert item.evidence["approvers"]["users"] == ["operator"]
        assert mailbox.messages() == []
        # The operator signs in with the printed password and finds it,
        # the email shown, in the inbox.
        client = Client()
        assert client.login(username="operator", password="demo-password")
        inbox = client.get("/inbox/").content.decode()
        assert "Re: Refund for a damaged grinder [T-1042]" in inbox

        assert operator.has_perm(APPROVE)
        request = Request(
            choice=DecisionChoice.APPROVE, who=Who(user=operator), token=uuid.uuid4().hex
        )
        assert decide_approval(item.pk, request).run_resumed
        assert dict(Executor().serve(once=True))[run.pk] == RunStatus.COMPLETED
        (mail,) = mailbox.messages()
        assert (mail["To"], mail["Subject"]) == (proposed["to"], proposed["subject"])

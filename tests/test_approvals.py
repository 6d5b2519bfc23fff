"""Approval gates (runs/approvals.py) end to end, with the support agent's
real local SMTP server and HTTP helpdesk: a reply is sent only as a person
approved it (as proposed, or edited), never when rejected or not approved
in time, once whatever crashes, and the database refuses a boundary whose
input was not approved."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import uuid
from collections.abc import Iterator
from io import StringIO
from pathlib import Path

import psycopg
import pytest
from django.contrib.auth.models import Group, Permission, User
from django.core import mail as told_by_mail
from django.core.management import CommandError, call_command
from django.db import IntegrityError, connection, connections, transaction
from psycopg.types.json import Jsonb

from evidence import charts
from runs import alerts, approvals
from runs.agents.receivers import Helpdesk, Mailbox
from runs.approvals import decide_approval
from runs.decisions import DecisionRefused, Request, Who
from runs.executor import Ending, claim_and_drive
from runs.leases import Lease
from runs.models import (
    Action,
    Approval,
    ApprovalState,
    DecisionChoice,
    OperatorDecision,
    OutcomeItem,
    OutcomeKind,
    OutcomeState,
    Receipt,
    Run,
    RunStatus,
    action_identity,
    digest,
)
from runs.submission import submit
from runs.sweep import sweep
from runs.timeline import EventKind, timeline
from tests import approval_agents
from tests.conftest import make_user, manage
from tests.faultruns import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

SUPPORT = "runs.agents.support:ApprovedSupportAgent"
INPUT = {"ticket": "T-1042", "articles": ["refunds.md", "shipping.md"]}
CUSTOMER = "ada.lovelace@example.com"
SUBJECT = "Re: Refund for a damaged grinder [T-1042]"
# The reads are steps 1-3, the draft 4, the reply 5.
SEND = 5


def make_approver(name: str, *, operator: bool = False) -> User:
    """A member of the approvers group (as migration 0021 makes it: the
    tables are emptied between transactional tests), and of the operators
    group too if asked."""
    group, _ = Group.objects.get_or_create(name=approvals.APPROVERS)
    group.permissions.add(Permission.objects.get(codename="approve_action"))
    user = make_user(name, operator=operator)
    user.groups.add(group)
    return User.objects.get(pk=user.pk)


class Receivers:
    def __init__(self, folder: Path) -> None:
        self.mailbox = Mailbox(folder / "mailbox")
        self.helpdesk = Helpdesk(folder / "helpdesk")

    def env(self) -> dict[str, str]:
        return {"RUNDESK_SMTP_URL": self.mailbox.url, "RUNDESK_HELPDESK_URL": self.helpdesk.url}


@pytest.fixture
def receivers(tmp_path: Path, settings) -> Iterator[Receivers]:
    started = Receivers(tmp_path)
    with started.mailbox, started.helpdesk:
        settings.RUNDESK_SMTP_URL = started.mailbox.url
        settings.RUNDESK_HELPDESK_URL = started.helpdesk.url
        yield started


@pytest.fixture(autouse=True)
def installed(settings) -> None:
    settings.RUNDESK_AGENTS = {
        **settings.RUNDESK_AGENTS,
        "support-approved": SUPPORT,
        "notice": approval_agents.PATH,
        "beside": approval_agents.BESIDE,
        "careless": approval_agents.CARELESS,
    }


def waiting_reply() -> tuple[Run, OutcomeItem]:
    """A support run driven to its reply, which waits for approval."""
    run = submit(agent="support-approved", input=INPUT)
    assert claim_and_drive(run.pk) == RunStatus.NEEDS_OPERATOR
    run.refresh_from_db()
    item = OutcomeItem.objects.get(run=run, kind=OutcomeKind.APPROVAL)
    return run, item


def asked(user: User, choice: str, reason: str = "", token: str = "") -> Request:
    return Request(
        choice=choice, who=Who(user=user), token=token or uuid.uuid4().hex, reason=reason
    )


def test_a_reply_waits_for_approval_with_the_mail_shown_and_nothing_sent(
    receivers, journal, settings
):
    settings.RUNDESK_ALERT_URL = "http://127.0.0.1:9/alerts"
    ana = make_approver("ana")
    User.objects.filter(pk=ana.pk).update(email="ana@example.com")  # told by email too
    run, item = waiting_reply()

    assert run.status_reason.startswith("waiting for approval of send_reply (send)")
    assert run.lease_owner == ""  # no owner holds it while it waits
    assert receivers.mailbox.messages() == []
    assert not run.actions.filter(step_key="send").exists()
    shown = item.evidence
    assert shown["input"]["to"] == CUSTOMER
    assert shown["input"]["subject"] == SUBJECT
    assert "From our article “Refunds and returns”" in shown["input"]["body"]
    # What the run published so far, and who may approve.
    assert [p["number"] for p in shown["published"]] == [1, 2]
    assert shown["approvers"] == {"group": "approvers", "users": ["ana"], "more": False}
    approval = Approval.objects.get(run=run)
    assert (approval.state, approval.step_key, approval.tool) == ("pending", "send", "send_reply")
    # Told once: an alert row per channel, written with the item.
    assert [alert.channel for alert in item.alerts.all()] == ["email", "webhook"]
    alerts.deliver_due()
    (told,) = told_by_mail.outbox  # the approvers, not the operators
    assert told.to == ["ana@example.com"]
    assert claim_and_drive(run.pk) == Ending.NOT_CLAIMABLE  # nothing opened again
    assert OutcomeItem.objects.filter(run=run).count() == 1


def test_approved_the_mail_is_sent_once_as_proposed(receivers, journal):
    ana = make_approver("ana")
    run, item = waiting_reply()
    proposed = Approval.objects.get(run=run).proposed

    decided = decide_approval(item.pk, asked(ana, DecisionChoice.APPROVE))

    assert decided.run_resumed
    assert Run.objects.get(pk=run.pk).status == RunStatus.QUEUED
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    (mail,) = receivers.mailbox.messages()
    assert (mail["To"], mail["Subject"]) == (CUSTOMER, SUBJECT)
    send = run.actions.get(step_key="send")
    assert send.input_digest == digest(proposed)
    result = Receipt.objects.get(action=send).result
    assert result["approval"] == {
        "decision": decided.decision.pk,
        "by": "ana",
        "edited": False,
        "input": proposed,
    }
    (update,) = receivers.helpdesk.updates()
    assert json.loads(update["body"])["status"] == "answered"
    decision = decided.decision
    assert (decision.choice, decision.reason) == ("approve", "approved as proposed")
    assert decision.evidence_digest == digest(decision.evidence)
    assert journal.counts("send_email") == {action_identity(run.pk, "send"): 1}


def test_approved_with_an_edit_the_edited_mail_is_sent_and_both_are_kept(receivers):
    ana = make_approver("ana")
    run, item = waiting_reply()
    approval = Approval.objects.get(run=run)
    edited = {**approval.proposed, "subject": "Your refund", "body": "Dear Ada,\n\nRefunded."}

    decided = decide_approval(
        item.pk, asked(ana, DecisionChoice.APPROVE_EDITED, "friendlier"), edited
    )
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED

    (mail,) = receivers.mailbox.messages()
    assert mail["Subject"] == "Your refund"
    assert mail.get_content().replace("\r\n", "\n").strip() == "Dear Ada,\n\nRefunded."
    send = run.actions.get(step_key="send")
    assert send.input == edited
    assert send.input_digest == digest(edited) != approval.proposed_digest
    approval.refresh_from_db()
    assert (approval.proposed["subject"], approval.sent["subject"]) == (SUBJECT, "Your refund")
    evidence = decided.decision.evidence
    assert evidence["edit"]["input_digest"] == digest(edited)
    assert "-subject: " + SUBJECT in evidence["diff"]
    assert "+subject: Your refund" in evidence["diff"]
    # The agent learnt what was sent: the ticket says the edited reply.
    assert Receipt.objects.get(action=send).result["approval"]["edited"] is True
    (update,) = receivers.helpdesk.updates()
    assert json.loads(update["body"])["reply"] == "Dear Ada,\n\nRefunded."


def test_an_edit_the_tools_schema_refuses_is_refused_with_the_field_named(receivers):
    ana = make_approver("ana")
    run, item = waiting_reply()
    proposed = Approval.objects.get(run=run).proposed

    with pytest.raises(DecisionRefused, match=r"the edit is refused: input\.to: "):
        decide_approval(
            item.pk,
            asked(ana, DecisionChoice.APPROVE_EDITED, "x"),
            {**proposed, "to": "not an address"},
        )
    with pytest.raises(DecisionRefused, match="changes nothing"):
        decide_approval(item.pk, asked(ana, DecisionChoice.APPROVE_EDITED, "x"), proposed)
    assert Approval.objects.get(run=run).state == ApprovalState.PENDING
    assert not OperatorDecision.objects.exists()


def test_rejected_the_run_completes_without_the_mail(receivers):
    ana = make_approver("ana")
    run, item = waiting_reply()

    with pytest.raises(DecisionRefused, match="a rejection needs a reason"):
        decide_approval(item.pk, asked(ana, DecisionChoice.REJECT))
    decide_approval(item.pk, asked(ana, DecisionChoice.REJECT, "wrong tone"))
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED

    assert receivers.mailbox.messages() == []
    assert not run.actions.filter(step_key="send").exists()
    (update,) = receivers.helpdesk.updates()
    assert json.loads(update["body"])["status"] == "not answered"
    assert Approval.objects.get(run=run).state == ApprovalState.REJECTED
    timeline.flush()
    (said,) = run.events.filter(kind=EventKind.ACTION_REFUSED).values_list("message", flat=True)
    assert said == "send: send_reply rejected by ana: wrong tone"  # what the agent was told


def test_the_same_token_again_changes_nothing(receivers):
    ana = make_approver("ana")
    _, item = waiting_reply()
    token = uuid.uuid4().hex

    first = decide_approval(item.pk, asked(ana, DecisionChoice.APPROVE, token=token))
    again = decide_approval(item.pk, asked(ana, DecisionChoice.APPROVE, token=token))

    assert (again.repeated, again.decision.pk) == (True, first.decision.pk)
    with pytest.raises(DecisionRefused, match="already decided by ana"):
        decide_approval(item.pk, asked(ana, DecisionChoice.REJECT, "no"))
    assert OperatorDecision.objects.count() == 1


def test_an_operator_without_the_approver_permission_may_not_approve(receivers):
    olga = make_user("olga", operator=True)
    run, item = waiting_reply()

    with pytest.raises(DecisionRefused, match="olga may not approve"):
        decide_approval(item.pk, asked(olga, DecisionChoice.APPROVE))
    assert Approval.objects.get(run=run).state == ApprovalState.PENDING


def test_two_approvers_at_once_one_wins(receivers):
    ana, bo = make_approver("ana"), make_approver("bo")
    run, item = waiting_reply()
    barrier = threading.Barrier(2)
    outcomes: dict[str, object] = {}

    def decide(user: User, choice: str, reason: str) -> None:
        try:
            barrier.wait(timeout=10)
            outcomes[user.username] = decide_approval(item.pk, asked(user, choice, reason))
        except DecisionRefused as refused:
            outcomes[user.username] = refused
        finally:
            connections.close_all()

    threads = [
        threading.Thread(target=decide, args=(ana, DecisionChoice.APPROVE, "fine")),
        threading.Thread(target=decide, args=(bo, DecisionChoice.REJECT, "wrong tone")),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    refused = [who for who, outcome in outcomes.items() if isinstance(outcome, DecisionRefused)]
    assert len(outcomes) == 2 and len(refused) == 1, outcomes
    (decision,) = OperatorDecision.objects.all()
    assert decision.decided_by != refused[0]
    # Refused under the locks: decided first, or (a slow machine) still locked.
    assert re.search("already decided by|locked by another session", str(outcomes[refused[0]]))
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    assert len(receivers.mailbox.messages()) == (decision.choice == DecisionChoice.APPROVE)


def test_the_database_refuses_a_boundary_that_was_not_approved(receivers):
    ana = make_approver("ana")
    run, item = waiting_reply()
    approval = Approval.objects.get(run=run)
    lease = Lease.claim(run.pk, "intruder")
    assert lease is None  # waiting: nobody may claim it
    Run.objects.filter(pk=run.pk).update(status=RunStatus.QUEUED)  # as if resumed early
    lease = Lease.claim(run.pk, "intruder")
    assert lease is not None

    def boundary(input: dict) -> None:
        with transaction.atomic():
            lease.record_boundary(
                step_key="send", kind="send_reply", effect_class="effect", input=input
            )

    with pytest.raises(IntegrityError, match="action_approved"):
        boundary(approval.proposed)  # still pending
    Run.objects.filter(pk=run.pk).update(status=RunStatus.NEEDS_OPERATOR, lease_owner="")
    edited = {**approval.proposed, "body": "edited"}
    decide_approval(item.pk, asked(ana, DecisionChoice.APPROVE_EDITED, "shorter"), edited)
    lease = Lease.claim(run.pk, "intruder")
    with pytest.raises(IntegrityError, match="action_approved"):
        boundary(approval.proposed)  # approved, but another input than the edit
    assert not Action.objects.filter(run=run, step_key="send").exists()
    # And a decided approval never changes again.
    with pytest.raises(Exception, match="decided once"), transaction.atomic():
        Approval.objects.filter(pk=approval.pk).update(sent={"to": "x@y"})


def test_not_approved_in_time_is_a_system_refusal_and_the_run_goes_on(journal):
    make_approver("ana")
    run = submit(agent="notice", input={"to": "ops@example.com", "text": "deploy at 5"})
    assert claim_and_drive(run.pk) == RunStatus.NEEDS_OPERATOR
    item = OutcomeItem.objects.get(run=run, kind=OutcomeKind.APPROVAL)

    wait_for(lambda: bool(sweep().approvals_expired), timeout=10)

    decision = OperatorDecision.objects.get(item=item)
    assert (decision.user, decision.decided_by) == (None, "system: approval timeout")
    assert (decision.choice, decision.reason) == ("reject", "not approved within 1.0 s")
    assert OutcomeItem.objects.get(pk=item.pk).state == OutcomeState.SETTLED
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    assert run.revisions.get().content == "not sent: notify not approved within 1.0 s"
    assert journal.counts("notify") == {}
    # A person is too late once it expired, even before the sweep.
    with pytest.raises(DecisionRefused, match="already decided"):
        decide_approval(item.pk, asked(make_approver("bo"), DecisionChoice.APPROVE))


@pytest.mark.parametrize("go_on", [True, False])
def test_an_agent_that_catches_the_wait_for_approval_still_waits_and_sends_nothing(journal, go_on):
    # The wait is an exception, and `except Exception` catches it: the run
    # waits all the same, and no later step of the agent is dispatched.
    run = submit(agent="careless", input={"go_on": go_on})
    assert claim_and_drive(run.pk) == RunStatus.NEEDS_OPERATOR
    item = OutcomeItem.objects.get(run=run, kind=OutcomeKind.APPROVAL)
    assert item.state == OutcomeState.OPEN
    assert not run.actions.exists()
    assert journal.counts("notify") == {}


def test_outcomes_show_says_who_decides_an_open_approval_and_how():
    run = submit(agent="notice", input={"to": "ops@example.com", "text": "deploy at 5"})
    assert claim_and_drive(run.pk) == RunStatus.NEEDS_OPERATOR
    item = OutcomeItem.objects.get(run=run, kind=OutcomeKind.APPROVAL)
    shown = StringIO()
    call_command("outcomes", "show", str(item.pk), stdout=shown)
    assert "Choices: an approver approves or rejects it (outcomes approve ID" in shown.getvalue()
    assert "none (settled)" not in shown.getvalue()


def test_an_agent_asks_for_approval_per_call_and_sends_once_approved(journal):
    ana = make_approver("ana")
    run = submit(agent="notice", input={"to": "ops@example.com", "text": "deploy at 5"})
    assert claim_and_drive(run.pk) == RunStatus.NEEDS_OPERATOR
    item = OutcomeItem.objects.get(run=run, kind=OutcomeKind.APPROVAL)
    assert journal.counts("notify") == {}

    decide_approval(item.pk, asked(ana, DecisionChoice.APPROVE))
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED

    assert run.revisions.get().content == "sent to ops@example.com"
    assert journal.counts("notify") == {action_identity(run.pk, "notice"): 1}


def test_a_step_that_needs_approval_never_goes_side_by_side(journal):
    run = submit(agent="beside", input={})

    assert claim_and_drive(run.pk) == RunStatus.FAILED
    run.refresh_from_db()
    assert "look: look needs approval: step it on its own" in run.status_reason
    assert journal.counts("look") == {}
    assert not run.actions.exists()


def test_sigkilled_right_after_an_approval_the_mail_is_sent_once(receivers, process_env, journal):
    ana = make_approver("ana")
    env = {**process_env, **receivers.env(), "RUNDESK_AGENTS": f"support-approved={SUPPORT}"}
    run, item = waiting_reply()
    edited = {**Approval.objects.get(run=run).proposed, "body": "Refunded. Sorry!"}
    decide_approval(item.pk, asked(ana, DecisionChoice.APPROVE_EDITED, "short"), edited)

    # Another session holds the reply's identity, uncommitted: the executor's
    # boundary statement waits on it, in flight, when the executor is killed.
    holder = psycopg.connect(
        dbname=connection.settings_dict["NAME"],
        host=connection.settings_dict["HOST"],
        port=connection.settings_dict["PORT"],
        user=connection.settings_dict["USER"],
    )
    holder.execute(
        """INSERT INTO runs_action (run_id, step_key, kind, effect_class, input, input_digest,
               state, epoch, attempts, idempotency_key, error, created_at, dispatched_at)
           VALUES (%s, 'send', 'send_reply', 'effect', %s, %s, 'dispatched', 0, 1, %s, '',
               now(), now())""",
        [run.pk, Jsonb(edited), digest(edited), "test:holder"],
    )
    first = manage("executor", "--run", str(run.pk), env=env)
    try:
        wait_for(lambda: boundary_waits(run.pk), timeout=30)
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        # Its connections die with it (the server would see them gone only
        # when it next answers them: the boundary must not commit after).
        holder.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name LIKE 'rundesk:executor%%' AND datname = current_database()"
        )
        holder.rollback()
        holder.close()
    assert receivers.mailbox.messages() == []
    assert not run.actions.filter(step_key="send").exists()

    wait_for(lambda: Run.objects.claimable().filter(pk=run.pk).exists(), timeout=30)
    second = manage("executor", "--once", "--json", env=env)
    out, _ = second.communicate(timeout=60)
    run.refresh_from_db()
    assert json.loads(out) == {"run_id": run.pk, "outcome": "completed"}, run.status_reason

    (mail,) = receivers.mailbox.messages()
    assert mail.get_content().strip() == "Refunded. Sorry!"
    assert run.actions.get(step_key="send").input_digest == digest(edited)
    assert journal.counts("send_email") == {action_identity(run.pk, "send"): 1}


def boundary_waits(run_id: int) -> bool:
    """Whether the run's executor waits for a lock, in its boundary write
    (held up by the test's uncommitted row: nothing else of it waits).  Its
    pooled connections serve any run, so they are named for the executor,
    not the run: this database's only executor is the run's."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND application_name LIKE 'rundesk:executor%%' AND query LIKE '%%runs_action%%'"
            " AND datname = current_database()"
        )
        return cursor.fetchone()[0] > 0


def outcomes_json(*args: str) -> dict:
    out = StringIO()
    call_command("outcomes", *args, "--json", stdout=out)
    return json.loads(out.getvalue())


def test_the_outcomes_command_approves_with_an_input_file(receivers, tmp_path):
    make_approver("ana")
    make_user("olga", operator=True)
    run, item = waiting_reply()
    shown = outcomes_json("show", str(item.pk))
    assert shown["item"]["kind"] == "approval"
    out = StringIO()
    call_command("outcomes", "show", str(item.pk), stdout=out)
    assert "Nothing is sent until an approver decides (the approvers group)" in out.getvalue()
    assert shown["evidence"]["approval"]["input"]["to"] == CUSTOMER
    edited = {**Approval.objects.get(run=run).proposed, "body": "Refunded, from the CLI."}
    path = tmp_path / "edit.json"
    path.write_text(json.dumps(edited))

    with pytest.raises(CommandError, match="olga may not decide: it needs the approver"):
        call_command("outcomes", "approve", str(item.pk), "--as", "olga")
    with pytest.raises(CommandError, match="invalid choice: 'approve'"):
        call_command(
            "outcomes",
            "decide",
            str(item.pk),
            "--choice",
            "approve",
            "--as",
            "olga",
            "--reason",
            "x",
        )
    done = outcomes_json(
        "approve", str(item.pk), "--as", "ana", "--input-file", str(path), "--token", "t-1"
    )
    again = outcomes_json(
        "approve", str(item.pk), "--as", "ana", "--input-file", str(path), "--token", "t-1"
    )

    assert (done["decision"]["choice"], done["run_resumed"]) == ("approve_edited", True)
    assert again["repeated"] is True
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    (mail,) = receivers.mailbox.messages()
    assert mail.get_content().strip() == "Refunded, from the CLI."


def test_the_outcomes_command_rejects_with_a_reason(receivers):
    make_approver("ana")
    run, item = waiting_reply()

    done = outcomes_json("reject", str(item.pk), "--as", "ana", "--reason", "not our policy")

    assert done["decision"]["choice"] == "reject"
    assert done["item"]["state"] == "resolved"
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    assert receivers.mailbox.messages() == []


def test_the_run_timeline_draws_the_gate_as_a_wait_ended_by_the_decision(receivers):
    ana = make_approver("ana")
    run, item = waiting_reply()
    decide_approval(item.pk, asked(ana, DecisionChoice.APPROVE))
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    timeline.flush()

    figure = json.dumps(charts.timeline(run, list(run.actions.all()), []), ensure_ascii=False)

    assert "waiting for approval: " in figure
    assert "ended by the decision of ana (approve)" in figure

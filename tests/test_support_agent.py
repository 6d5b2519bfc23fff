"""The support agent end to end, through a real executor path, against a
real local SMTP server and a real local HTTP helpdesk (runs/agents/
receivers.py): one mail and one ticket update, never two, whatever is lost
on the way; the reads side by side in one boundary write."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

from runs.agent import OutcomeUnknown, ToolFailed
from runs.agents.providers import SUPPORT_INSTRUCTIONS, OfflineProvider, support_prompt
from runs.agents.receivers import Helpdesk, Mailbox
from runs.agents.support import SupportAgent, message_id, send_email
from runs.decisions import Request, Who, decide
from runs.executor import claim_and_drive
from runs.models import (
    ActionState,
    AnswerRevision,
    DecisionChoice,
    OutcomeItem,
    OutcomeKind,
    Receipt,
    Run,
    RunStatus,
    action_identity,
)
from runs.submission import submit
from tests.conftest import make_user, manage
from tests.faultruns import wait_for
from tests.tool_calls import call

pytestmark = pytest.mark.django_db(transaction=True)

# T-1042 answered from two articles: the reads are steps 1-3, the draft 4,
# the mail 5, the ticket update 6.
INPUT = {"ticket": "T-1042", "articles": ["refunds.md", "shipping.md"]}
READS = ["ticket", "article:refunds.md", "article:shipping.md"]
DRAFT, SEND, UPDATE = 4, 5, 6


class Receivers:
    def __init__(self, folder: Path, **lose: set[str]) -> None:
        self.mailbox = Mailbox(folder / "mailbox", lose_answers_to=lose.get("mail", ()))
        self.helpdesk = Helpdesk(folder / "helpdesk", lose_answers_for=lose.get("tickets", ()))

    def env(self) -> dict[str, str]:
        return {"RUNDESK_SMTP_URL": self.mailbox.url, "RUNDESK_HELPDESK_URL": self.helpdesk.url}


@pytest.fixture
def receivers(tmp_path: Path, settings) -> Iterator[Receivers]:
    started = Receivers(tmp_path)
    with started.mailbox, started.helpdesk:
        settings.RUNDESK_SMTP_URL = started.mailbox.url
        settings.RUNDESK_HELPDESK_URL = started.helpdesk.url
        yield started


def key_of(run: Run, step_key: str) -> str:
    return run.actions.get(step_key=step_key).idempotency_key


def assert_one_mail_and_one_update(run: Run, receivers: Receivers) -> None:
    """Exactly one mail, to the customer, under the mail action's key; and
    exactly one update of the ticket, under the update action's key."""
    (mail,) = receivers.mailbox.messages()
    assert mail["To"] == "ada.lovelace@example.com"
    assert mail["Message-ID"] == message_id(key_of(run, "send"))
    assert mail["Subject"] == "Re: Refund for a damaged grinder [T-1042]"
    (update,) = receivers.helpdesk.updates()
    assert (update["ticket"], update["idempotency_key"]) == ("T-1042", key_of(run, "update"))
    assert json.loads(update["body"])["reply"] == mail.get_content().replace("\r\n", "\n").strip()


def test_a_ticket_is_answered_with_one_mail_and_one_ticket_update(receivers, journal):
    run = submit(agent="support", input={"ticket": "T-1042"})
    assert run.question == "Reply to ticket T-1042: Refund for a damaged grinder"

    assert claim_and_drive(run.pk) == RunStatus.COMPLETED

    assert_one_mail_and_one_update(run, receivers)
    body = receivers.mailbox.messages()[0].get_content()
    # The offline provider's draft quotes the article that answers the ticket.
    assert "From our article “Refunds and returns” (refunds.md):" in body
    assert "> A refund is issued to the original payment method within 5 business days" in body
    update = json.loads(receivers.helpdesk.updates()[0]["body"])
    assert update["message_id"] == message_id(key_of(run, "send"))
    # A person reads it on the helpdesk's page.
    with urllib.request.urlopen(receivers.helpdesk.url, timeout=5) as page:
        assert "From our article “Refunds and returns”" in page.read().decode()
    revisions = list(AnswerRevision.objects.filter(run=run).order_by("number"))
    assert [(r.number, r.is_final) for r in revisions] == [(1, False), (2, True)]
    assert revisions[0].content.startswith("**Draft**")
    assert revisions[1].content.startswith("To: ada.lovelace@example.com\nSubject: Re: ")
    # Every article of the knowledge base read, once each.
    articles = sorted(entry["article"] for entry in journal.entries() if "article" in entry)
    assert articles == ["account-access.md", "refunds.md", "shipping.md", "subscriptions.md"]
    assert set(journal.counts().values()) == {1}
    assert Receipt.objects.filter(run=run).count() == run.actions.count() == 4 + 4


def test_the_reads_go_side_by_side_in_one_boundary_write_each_read_once(
    receivers, process_env, journal
):
    # The executor holds the batch open on the first article's read, for
    # the boundaries to be looked at as written.
    faults = [{"point": "tool_delay", "action": 2, "ms": 1500}]
    run = submit(agent="support", input=INPUT, faults=faults)
    executor = manage("executor", "--run", str(run.pk), env={**process_env, **receivers.env()})
    wait_for(lambda: run.actions.count() == len(READS))
    with connection.cursor() as cursor:
        cursor.execute("SELECT step_key, xmin::text FROM runs_action WHERE run_id = %s", [run.pk])
        written = dict(cursor.fetchall())
    assert sorted(written) == sorted(READS)
    assert len(set(written.values())) == 1, written
    executor.communicate(timeout=60)

    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED, run.status_reason
    assert [journal.counts()[action_identity(run.pk, key)] for key in READS] == [1, 1, 1]
    assert_one_mail_and_one_update(run, receivers)


def test_sigkill_mid_run_then_resumed_sends_one_mail_and_reads_nothing_again(
    receivers, process_env, journal
):
    env = {**process_env, **receivers.env()}
    # The draft is slow (each time: a tool_delay is no fault that fires once).
    faults = [{"point": "tool_delay", "action": DRAFT, "ms": 2000}]
    run = submit(agent="support", input=INPUT, faults=faults)
    first = manage("executor", "--run", str(run.pk), env=env)
    # The reads' receipts went with the draft's boundary.
    wait_for(lambda: Receipt.objects.filter(run=run).count() == len(READS))
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert not run.actions.filter(step_key="send").exists()  # killed mid-draft

    # The next executor starts at once (a start takes seconds), and takes
    # the run once the dead owner's lease has expired.
    second = manage("executor", "--json", env=env)
    try:
        wait_for(lambda: Run.objects.filter(pk=run.pk, status=RunStatus.COMPLETED).exists())
    finally:
        second.send_signal(signal.SIGTERM)
    out, err = second.communicate(timeout=60)
    assert json.loads(out) == {"run_id": run.pk, "outcome": "completed"}, err

    assert [journal.counts()[action_identity(run.pk, key)] for key in READS] == [1, 1, 1]
    assert_one_mail_and_one_update(run, receivers)
    assert journal.counts("send_email") == {action_identity(run.pk, "send"): 1}


def decided(run: Run, choice: str, reason: str) -> None:
    item = OutcomeItem.objects.get(run=run)
    request = Request(
        choice=choice, who=Who(user=make_user("olga", operator=True)), token=uuid.uuid4().hex
    )
    request.reason = reason
    assert decide(item.pk, request).run_resumed


def test_the_mails_lost_answer_waits_for_an_operator_and_is_never_sent_again(receivers, journal):
    # The mail is the run's first effect: the fault plan loses its answer.
    run = submit(agent="support", input=INPUT, faults=[{"point": "delivery_timeout"}])

    assert claim_and_drive(run.pk) == RunStatus.NEEDS_OPERATOR

    send = run.actions.get(step_key="send")
    assert send.state == ActionState.UNKNOWN
    item = OutcomeItem.objects.get(run=run)
    assert (item.kind, item.action_id) == (OutcomeKind.EFFECT, send.pk)
    assert item.evidence["idempotency_key"] == send.idempotency_key
    # The mail is there, findable by its Message-ID; the ticket is untouched.
    (mail,) = receivers.mailbox.messages()
    assert mail["Message-ID"] == message_id(send.idempotency_key)
    assert receivers.helpdesk.updates() == []
    assert not run.actions.filter(step_key="update").exists()
    # Published before the effects: readable while the run waits.
    assert AnswerRevision.objects.filter(run=run, is_final=True).exists()

    decided(run, DecisionChoice.CONFIRMED_HAPPENED, "it is in the customer's mailbox")
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED

    assert_one_mail_and_one_update(run, receivers)
    assert journal.counts("send_email") == {action_identity(run.pk, "send"): 1}


def test_the_helpdesks_lost_answer_is_sent_again_under_its_key_and_kept_once(tmp_path, settings):
    lossy = Receivers(tmp_path, tickets={"T-1042"})
    with lossy.mailbox, lossy.helpdesk:
        settings.RUNDESK_SMTP_URL = lossy.mailbox.url
        settings.RUNDESK_HELPDESK_URL = lossy.helpdesk.url
        run = submit(agent="support", input=INPUT)

        assert claim_and_drive(run.pk) == RunStatus.NEEDS_OPERATOR

        update = run.actions.get(step_key="update")
        assert update.state == ActionState.UNKNOWN
        assert "answer lost" in update.error
        item = OutcomeItem.objects.get(run=run)
        assert (item.kind, item.action_id) == (OutcomeKind.EFFECT, update.pk)
        # The helpdesk kept it; its answer never came.
        assert len(lossy.helpdesk.updates()) == 1

        decided(run, DecisionChoice.RESEND_SAME_IDENTITY, "the helpdesk keeps one per key")
        assert claim_and_drive(run.pk) == RunStatus.COMPLETED

        # Sent again under the same key: the helpdesk answered its first
        # update, and kept nothing new.
        assert_one_mail_and_one_update(run, lossy)
        assert Receipt.objects.get(run=run, step_key="update").result["status"] == 200


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"ticket": "T-9999"}, "input.ticket: no ticket 'T-9999'"),
        ({"ticket": "../T-1042"}, "input.ticket: '../T-1042' does not match"),
        ({"tickets": "T-1042"}, "'ticket' is a required property"),
        ({"ticket": "T-1042", "articles": ["refunds.md", "faq.md"]}, "input.articles[1]: "),
        ({"ticket": "T-1042", "articles": ["../tickets/T-1042.json"]}, "input.articles[0]: "),
        ({"ticket": "T-1042", "articles": []}, "input.articles: [] should be non-empty"),
    ],
)
def test_a_bad_input_is_refused_at_submission_with_the_field_named(given, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        submit(agent="support", input=given)
    assert not Run.objects.exists()


def test_the_drill_input_is_taken():
    run = submit(agent="support", input=SupportAgent.drill_input)
    assert (run.agent, run.agent_version, run.status) == ("support", "1", RunStatus.QUEUED)


# -- the mail tool on its own -------------------------------------------------------


MAIL = {"to": "ada.lovelace@example.com", "subject": "Re: hello", "body": ".\nA dot alone."}


def test_a_mail_server_that_is_not_there_is_known_not_sent(settings):
    settings.RUNDESK_SMTP_URL = "smtp://127.0.0.1:1"
    with pytest.raises(ToolFailed, match="unreachable"):
        send_email(MAIL, call("rundesk:run-7:send", "rundesk:host:k1"))


def test_a_mail_whose_answer_is_lost_is_an_unknown_outcome(tmp_path, settings):
    with Mailbox(tmp_path, lose_answers_to={MAIL["to"]}) as mailbox:
        settings.RUNDESK_SMTP_URL = mailbox.url
        with pytest.raises(OutcomeUnknown, match="answer lost"):
            send_email(MAIL, call("rundesk:run-7:send", "rundesk:host:k2"))
        # It came, whole: a line of one dot did not end it.
        (mail,) = mailbox.messages()
        assert mail.get_content().replace("\r\n", "\n") == MAIL["body"] + "\n"
        assert mail["Message-ID"] == "<rundesk.host.k2@rundesk>"


def test_the_offline_draft_quotes_no_article_that_does_not_answer_the_ticket():
    refunds = (Path(settings.RUNDESK_SUPPORT_DIR) / "articles" / "refunds.md").read_text()
    prompt = support_prompt(
        "Ticket T-7 from Bo <bo@example.com>: Weather",
        "Will it rain tomorrow?",
        [("refunds.md", refunds)],
    )
    messages = [
        {"role": "system", "content": SUPPORT_INSTRUCTIONS},
        {"role": "user", "content": prompt},
    ]
    reply = OfflineProvider().complete(messages)
    assert reply.startswith("Hello Bo,\n\nThank you for writing to us about “Weather”.")
    assert "a member of our team will reply to you in person" in reply
    assert "From our article" not in reply

"""A run resumed after its agent changed: a version that does not declare
it continues the run's waits for an operator, who resumes it under that
version (recorded on the run) or abandons it; a version that declares it
goes on; an agent no longer installed leaves the run waiting, run by
nothing else's code, and can only be abandoned.

Real runs of the tests' echo agent (tests/echo_agent.py), driven here: the
first drive stops at its send (the answer lost, settled by an operator),
the installed version is changed with the settings between that drive and
the next."""

from __future__ import annotations

import pytest

from runs.decisions import DecisionRefused, Request, Who, decide, decide_run, run_offers
from runs.executor import claim_and_drive
from runs.models import DecisionChoice, OutcomeItem, OutcomeKind, Run, RunStatus, action_identity
from runs.submission import submit
from runs.timeline import timeline
from tests import echo_agent

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("short_settle")]


def waiting_at_its_send(settings, operator_user) -> Run:
    """A run of echo 1 whose send's answer was lost, confirmed by an
    operator: settled, the run is back in the queue for its next drive."""
    echo_agent.install(settings)
    given = {"message": "hello", "to": "ops@example.com"}
    run = submit("echo", given, faults=[{"point": "delivery_timeout"}])
    assert claim_and_drive(run.pk) == RunStatus.NEEDS_OPERATOR
    item = OutcomeItem.objects.get(run=run, kind=OutcomeKind.EFFECT)
    confirmed = Request(
        DecisionChoice.CONFIRMED_HAPPENED, Who(user=operator_user), "t-item", "in the log"
    )
    assert decide(item.pk, confirmed).run_resumed
    return run


def drive(run: Run) -> Run:
    ending = claim_and_drive(run.pk)
    timeline.flush()
    run.refresh_from_db()
    assert ending == run.status
    return run


def asked(choice: DecisionChoice, operator_user, token: str) -> Request:
    return Request(choice, Who(user=operator_user), token, reason="checked the new code")


def test_a_changed_version_waits_and_resumed_completes_under_it(settings, operator_user, journal):
    run = waiting_at_its_send(settings, operator_user)
    echo_agent.install(settings, "tests.echo_agent:EchoAgentV2")
    run = drive(run)
    assert run.status == RunStatus.NEEDS_OPERATOR and run.agent_version == "1"
    assert run.status_reason == (
        "agent echo is version 2 here, which does not declare it continues runs of version 1: "
        "resume it under version 2, or abandon it"
    )
    offered = {offer.choice: offer.does for offer in run_offers(run)}
    assert list(offered) == [DecisionChoice.RESUME, DecisionChoice.ABANDON]
    assert offered[DecisionChoice.RESUME].startswith(
        "Back to the queue: it continues under version 2 (it started under 1): its code changed."
    )
    decided = decide_run(run.pk, asked(DecisionChoice.RESUME, operator_user, "t-run"))
    run.refresh_from_db()
    assert decided.run_resumed and run.agent_version == "2"  # in the decision's transaction
    assert decided.decision.evidence["agent"] == {"name": "echo", "version": "1", "installed": "2"}
    run = drive(run)
    assert run.status == RunStatus.COMPLETED and run.agent_version == "2"
    # It went on from its receipts: nothing that completed ran again.
    counts = journal.counts()
    assert counts[action_identity(run.pk, "look")] == counts[action_identity(run.pk, "send")] == 1
    assert run.revisions.get(is_final=True).content == "Sent: hello"


def test_a_version_that_declares_it_continues_goes_on_without_waiting(
    settings, operator_user, journal
):
    run = waiting_at_its_send(settings, operator_user)
    echo_agent.install(settings, "tests.echo_agent:EchoAgentV3")
    run = drive(run)
    assert run.status == RunStatus.COMPLETED
    assert not run.events.filter(message__contains="does not declare it continues").exists()
    assert journal.counts()[action_identity(run.pk, "look")] == 1


def test_a_run_whose_agent_is_not_installed_waits_and_can_only_be_abandoned(
    settings, operator_user, journal
):
    run = waiting_at_its_send(settings, operator_user)
    before = len(journal.entries())
    echo_agent.uninstall(settings)
    run = drive(run)
    assert run.status == RunStatus.NEEDS_OPERATOR
    assert run.status_reason.startswith("no agent 'echo' is installed here: nothing else runs it")
    assert len(journal.entries()) == before  # no code ran it: not another agent's, not a tool
    assert run.actions.count() == 2
    (abandon,) = run_offers(run)
    assert abandon.choice == DecisionChoice.ABANDON
    assert "no agent 'echo' is installed here, and nothing else runs it" in abandon.does
    with pytest.raises(DecisionRefused, match="resume is not offered for run"):
        decide_run(run.pk, asked(DecisionChoice.RESUME, operator_user, "t-resume"))
    # Claimed again, it waits again: still nothing runs it.
    assert claim_and_drive(run.pk) == "not_claimable"
    decide_run(run.pk, asked(DecisionChoice.ABANDON, operator_user, "t-abandon"))
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED and len(journal.entries()) == before


def test_the_run_page_offers_resume_under_the_new_version(settings, operator_user, operator):
    run = waiting_at_its_send(settings, operator_user)
    echo_agent.install(settings, "tests.echo_agent:EchoAgentV2")
    drive(run)
    page = operator.get(f"/runs/{run.pk}/").content.decode()
    assert "echo 1 (version 2 is installed here)" in page
    assert "it continues under version 2 (it started under 1): its code changed" in page
    assert 'value="resume"' in page and 'value="abandon"' in page

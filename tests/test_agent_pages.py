"""The dashboard, the inbox, the `outcomes` command and bundles for an
agent Rundesk does not ship (tests/echo_agent.py): the runs list shows and
filters the agent, a run's page shows its agent, version and input by the
shape the agent declares, and no research words; an inbox item names the
tool and the receiver the tool says, and "send again" is offered only for a
tool that sends the action's identity as an idempotency key."""

from __future__ import annotations

import html
import json
import re
from io import StringIO

import pytest
from django.core.management import call_command
from playwright.sync_api import expect

from evidence import bundles
from runs.decisions import DecisionRefused, Request, Who, decide, gather, offers
from runs.executor import claim_and_drive
from runs.models import (
    DecisionChoice,
    OperatorDecision,
    OutcomeItem,
    OutcomeKind,
    OutcomeState,
    Run,
    RunStatus,
    action_identity,
)
from runs.submission import submit
from runs.timeline import timeline
from tests import echo_agent
from tests.test_browser import SCREENSHOTS
from tests.test_bundles import entries
from tests.test_delivery_evidence import item_text
from tests.test_inbox import decision_form

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("short_settle")]

HOSTILE = '<script>alert("echo")</script> & <b>bold</b>'
# What only a research run's page says of its actions and answer.
RESEARCH_WORDS = ("summaris", "the report", "reading ", "composing", "document")


@pytest.fixture
def echo(settings) -> None:
    echo_agent.install(settings)


def echo_run(via: str = "post", faults: list | None = None, **extra) -> Run:
    """A run of the echo agent, driven here until it ends or waits."""
    given = {"message": "hello", "to": "ops@example.com", "via": via, **extra}
    run = submit("echo", given, faults=faults)
    claim_and_drive(run.pk)
    timeline.flush()
    run.refresh_from_db()
    return run


def lost_answer(via: str) -> tuple[Run, OutcomeItem]:
    """An echo run whose send reached its receiver, its answer lost."""
    run = echo_run(via, [{"point": "delivery_timeout"}])
    assert run.status == RunStatus.NEEDS_OPERATOR
    return run, OutcomeItem.objects.get(run=run, kind=OutcomeKind.EFFECT)


def text_of(page: str) -> str:
    """A page as a reader sees it: no markup, entities decoded."""
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page)))


def choices(item: OutcomeItem) -> dict[str, str]:
    return {offer.choice: offer.does for offer in offers(item, gather(item))}


# -- the runs list ---------------------------------------------------------------------


def test_the_runs_list_shows_each_runs_agent_and_filters_by_it(echo, viewer):
    research = submit(question="Which fund is cheapest?", documents=["a.md"])
    echoed = submit("echo", {"message": "hi", "to": "ops@example.com"})
    page = viewer.get("/").content.decode()
    assert "<th>Agent</th>" in page
    assert 'title="only the runs of echo">echo</a>' in page
    assert 'title="only the runs of research">research</a>' in page
    only = viewer.get("/", {"agent": "echo"}).content.decode()
    assert f'href="/runs/{echoed.pk}/"' in only and f'href="/runs/{research.pk}/"' not in only
    assert '<option value="echo" selected>' in only and 'id="clear-filters"' in only
    assert f'href="/runs/{research.pk}/"' in viewer.get("/", {"agent": "research"}).content.decode()


def test_an_unknown_agent_is_refused_and_one_no_longer_installed_still_filters(
    echo, viewer, settings
):
    echoed = submit("echo", {"message": "hi", "to": "ops@example.com"})
    refused = viewer.get("/", {"agent": "nobody"})
    body = html.unescape(refused.content.decode())
    assert refused.status_code == 400 and 'id="nav-inbox"' in body  # the site's layout
    assert "agent='nobody' is not one of: echo, research" in body
    echo_agent.uninstall(settings)
    kept = viewer.get("/", {"agent": "echo"})
    assert kept.status_code == 200
    page = kept.content.decode()
    assert f'href="/runs/{echoed.pk}/"' in page and '<option value="echo" selected>' in page
    # Installed nowhere and no run of it: refused, as any unknown name.
    assert viewer.get("/", {"agent": "echo2"}).status_code == 400


# -- the run page ----------------------------------------------------------------------


def test_the_run_page_shows_the_agent_and_the_input_by_its_shape(echo, viewer):
    run = echo_run(tags=["urgent", "billing"], options={"retry": {"times": 2}})
    assert run.status == RunStatus.COMPLETED
    page = viewer.get(f"/runs/{run.pk}/").content.decode()
    assert re.search(r'id="run-agent">echo 1</dd>', page)
    inputs = page[page.index('id="run-input"') : page.index("</dl>", page.index('id="run-input"'))]
    # In the order the schema names them (jsonb keeps none), by their titles.
    labels = re.findall(r"<dt[^>]*>([^<]+)</dt>", inputs)
    assert labels == ["Message", "Recipient", "Sent by", "Tags", "Options"]
    assert '<dt title="what is sent">Message</dt>' in inputs
    assert '<ul class="values"><li>urgent</li><li>billing</li></ul>' in inputs
    nested = json.dumps({"retry": {"times": 2}}, indent=2)
    assert f"<pre>{nested}</pre>" in html.unescape(inputs)


def test_the_input_is_shown_as_text_never_as_markup(echo, viewer):
    run = submit("echo", {"message": HOSTILE, "to": "<i>x</i>@example.com"})
    page = viewer.get(f"/runs/{run.pk}/").content.decode()
    assert '<script>alert("echo")' not in page and "<b>bold</b>" not in page
    assert "&lt;script&gt;alert(&quot;echo&quot;)&lt;/script&gt; &amp; &lt;b&gt;bold" in page
    assert "&lt;i&gt;x&lt;/i&gt;@example.com" in page


def test_a_run_page_of_another_agent_says_no_research_words(echo, viewer):
    run = echo_run()
    assert run.status == RunStatus.COMPLETED
    text = text_of(viewer.get(f"/runs/{run.pk}/").content.decode())
    for research in RESEARCH_WORDS:
        assert research not in text.lower(), research
    assert "Documents" not in text
    # Its actions by tool and effect class.
    assert "look read (repeatable)" in text and "post outside effect (irreversible)" in text


def test_a_research_run_page_shows_its_input_and_its_words(viewer, journal):
    run = submit(question="Which fund is cheapest?", documents=["northwind-clean-energy.md"])
    claim_and_drive(run.pk)
    text = text_of(viewer.get(f"/runs/{run.pk}/").content.decode())
    assert "Agent research 1" in text
    assert "Question Which fund is cheapest?" in text
    assert "Documents northwind-clean-energy.md" in text


# -- inbox items and their offers -------------------------------------------------------


def test_an_item_names_the_tool_and_its_receiver_and_offers_no_blind_resend(
    echo, operator, journal
):
    run, item = lost_answer("post")
    key = item.action.idempotency_key
    text = item_text(operator.get(f"/inbox/{item.pk}/").content.decode())
    assert text.startswith("Outside effect: post (send)")
    receiver = f"{echo_agent.MAIL_HOST}, message <{key}@echo.test> to ops@example.com"
    assert f"Tool post, of agent echo Receiver {receiver}" in text
    assert (
        f"look it up at {receiver}; post gave it the key {key}, and sends no Idempotency-Key"
    ) in text
    assert "Idempotency-Key sent none: the tool sends none" in text
    offered = choices(item)
    assert list(offered) == ["confirmed_happened", "confirmed_not_happened"]
    assert offered["confirmed_not_happened"].startswith(
        "Sends it again, once, as a new attempt under the same identity: the receiver told "
        "you it does not have it."
    )
    assert 'value="resend_same_identity"' not in operator.get(f"/inbox/{item.pk}/").content.decode()
    for research in RESEARCH_WORDS:
        assert research not in text.lower(), research
    # The run page's evidence of the item says the same.
    run_page = operator.get(f"/runs/{run.pk}/").content.decode()
    assert "<dt>Key the tool was given</dt>" in run_page
    assert "Idempotency-Key sent" not in run_page


def test_a_tool_that_sends_an_idempotency_key_is_offered_a_resend(echo, operator, journal):
    _, item = lost_answer("store")
    key = item.action.idempotency_key
    text = item_text(operator.get(f"/inbox/{item.pk}/").content.decode())
    receiver = f"{echo_agent.STORE_HOST}/ops@example.com"
    assert f"look it up at {receiver} by Idempotency-Key {key}" in text
    assert f"Tool store, of agent echo Receiver {receiver} Idempotency-Key sent {key}" in text
    offered = choices(item)
    assert list(offered) == ["confirmed_happened", "resend_same_identity", "confirmed_not_happened"]
    assert f"under the same Idempotency-Key {key}" in offered["resend_same_identity"]


def test_a_resend_posted_by_hand_for_a_tool_without_a_key_is_refused(
    echo, operator, operator_user, journal
):
    run, item = lost_answer("post")
    page = operator.get(f"/inbox/{item.pk}/").content.decode()
    form = decision_form(page, choice="resend_same_identity", reason="cannot tell")
    said = text_of(operator.post(f"/inbox/{item.pk}/decide/", form, follow=True).content.decode())
    assert "Not decided: resend_same_identity is not offered for this item now" in said
    asked = Request(DecisionChoice.RESEND_SAME_IDENTITY, Who(user=operator_user), "t-1", "?")
    with pytest.raises(DecisionRefused, match="resend_same_identity is not offered"):
        decide(item.pk, asked)
    item.refresh_from_db()
    assert item.state == OutcomeState.OPEN and not OperatorDecision.objects.exists()
    assert journal.counts("post")[action_identity(run.pk, "send")] == 1


def test_it_did_not_happen_sends_it_again_once_under_the_same_identity(
    echo, operator_user, journal
):
    run, item = lost_answer("post")
    not_there = Request(
        DecisionChoice.CONFIRMED_NOT_HAPPENED, Who(user=operator_user), "t-1", "not in the log"
    )
    assert decide(item.pk, not_there).run_resumed
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    sent = [e for e in journal.entries() if e["tool"] == "post"]
    assert len(sent) == 2 and sent[0]["key"] == sent[1]["key"] == item.action.idempotency_key
    assert journal.counts("look")[action_identity(run.pk, "look")] == 1


def test_an_item_of_an_agent_no_longer_installed_names_the_tool_and_key_only(
    echo, operator, settings, journal
):
    _, item = lost_answer("store")
    key = item.action.idempotency_key
    echo_agent.uninstall(settings)
    text = item_text(operator.get(f"/inbox/{item.pk}/").content.decode())
    assert (
        f"look it up at the receiver of store, by its key {key} (no agent 'echo' is "
        "installed here: where store sends is not known here)"
    ) in text
    assert "Tool store, of agent echo: not known here (no agent 'echo' is installed here)" in text
    offered = choices(item)
    assert list(offered) == ["confirmed_happened", "confirmed_not_happened"]
    assert (
        "no agent 'echo' is installed here, and nothing else runs it"
        in (offered["confirmed_not_happened"])
    )


# -- the CLI and bundles ----------------------------------------------------------------


def test_outcomes_lists_and_shows_an_item_of_another_agent(echo, journal):
    run, item = lost_answer("post")
    listed = StringIO()
    call_command("outcomes", "list", "--json", stdout=listed)
    (row,) = json.loads(listed.getvalue())["items"]
    assert (row["id"], row["what"], row["blocks"]) == (
        item.pk,
        action_identity(run.pk, "send"),
        "whole_run",
    )
    shown = StringIO()
    call_command("outcomes", "show", str(item.pk), "--json", stdout=shown)
    document = json.loads(shown.getvalue())
    delivery = document["evidence"]["delivery"]
    assert (delivery["tool"], delivery["agent"], delivery["accepts_idempotency_key"]) == (
        "post",
        "echo",
        False,
    )
    assert delivery["receiver"].startswith(echo_agent.MAIL_HOST)
    assert [offer["choice"] for offer in document["offers"]] == [
        "confirmed_happened",
        "confirmed_not_happened",
    ]
    text = StringIO()
    call_command("outcomes", "show", str(item.pk), stdout=text)
    assert f"Item {item.pk}: effect post (send) (open)" in text.getvalue()
    assert "Tool: post, of agent echo" in text.getvalue()


def test_a_bundle_of_another_agents_run_holds_it_and_verifies(echo, journal, tmp_path):
    run = echo_run(tags=["urgent"])
    assert run.status == RunStatus.COMPLETED
    path = tmp_path / "run.zip"
    bundles.export(run.pk, path)
    assert bundles.verify(path).ok
    files = entries(path)
    saved = json.loads(files["run.json"])
    assert (saved["agent"], saved["agent_version"], saved["input"]["to"]) == (
        "echo",
        "1",
        "ops@example.com",
    )
    report = text_of(files["report.html"].decode())
    assert "Agent echo 1" in report and "Recipient ops@example.com" in report
    assert "Documents" not in report
    steps = {json.loads(line)["step_key"] for line in files["receipts.jsonl"].splitlines()}
    assert steps == {"look", "send"}


# -- one look in a real browser -----------------------------------------------------------


@pytest.fixture
def echo_waiting(echo, journal) -> tuple[Run, OutcomeItem]:
    return lost_answer("post")


@pytest.mark.slow
def test_in_a_browser_the_run_page_and_item_of_another_agent(echo_waiting, page):
    run, item = echo_waiting
    page.goto(f"/runs/{run.pk}/")
    expect(page.locator("#run-agent")).to_have_text("echo 1")
    expect(page.locator("#input-message")).to_have_text("hello")
    expect(page.locator("#run-unblock")).to_contain_text(f"Decide item {item.pk}")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / "run-page-other-agent.png", full_page=True)
    page.click(f"#unblock-item-{item.pk} a.button")
    expect(page.locator("h1")).to_contain_text("Outside effect: post (send)")
    expect(page.locator("#item-known")).to_contain_text(f"look it up at {echo_agent.MAIL_HOST}")
    expect(page.locator('input[value="resend_same_identity"]')).to_have_count(0)
    page.check('input[value="confirmed_happened"]')
    page.fill("textarea[name=reason]", "in the mail server's log")
    page.click("#item-decide button[type=submit]")
    expect(page.locator("#item-state")).to_have_text("settled")
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED

"""The inbox in a real browser (Debian's Chromium, Playwright): an operator
opens the inbox, reads an item's evidence, says why, settles it, and sees
the decision in the history; the run then completes with one delivery.

Screenshots go to var/screenshots/ (`RUNDESK_SCREENSHOTS=docs/screenshots`
refreshes the committed ones), as in tests/test_browser.py.
"""

from __future__ import annotations

import pytest
from playwright.sync_api import Page, expect

from runs.executor import claim_and_drive
from runs.models import OperatorDecision, OutcomeItem, OutcomeKind, OutcomeState, RunStatus
from tests.faultruns import run_with
from tests.receivers import LocalServer, status
from tests.test_browser import SCREENSHOTS

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.slow,
    pytest.mark.usefixtures("short_settle"),
]


@pytest.fixture
def operator_name() -> str:
    return "olga"  # the decision's history names her


def test_an_operator_settles_a_lost_delivery_through_the_inbox(page: Page, settings, journal):
    with LocalServer(status(200)) as receiver:
        settings.RUNDESK_DELIVERY_URL = receiver.url
        late = {"point": "drop_connection_at_commit", "write": "receipt", "action": 3}
        receipt_run, _ = run_with([{**late, "outcome": "late", "stall_ms": 3000}])
        run, outcome = run_with([{"point": "delivery_timeout"}])
        assert outcome == RunStatus.NEEDS_OPERATOR and len(receiver.requests) == 1
        item = OutcomeItem.objects.get(run=run, kind=OutcomeKind.EFFECT)
        # Named by what it did; its identity is in the evidence.
        doing = "delivering the report to 127.0.0.1"

        page.goto("/inbox/")
        expect(page.locator("main h1")).to_contain_text("2 open")
        row = page.locator("#inbox-rows tr", has_text=doing)
        expect(row.locator(".blocks")).to_have_text("the whole run")
        expect(page.locator("#inbox-rows tr", has_text=f"run {receipt_run.pk}")).to_be_visible()
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=SCREENSHOTS / "inbox.png", full_page=True)

        # A receipt whose COMMIT got no answer: its transaction has ended
        # since, and the page, checking again on load, says so.
        page.locator("#inbox-rows tr", has_text=f"run {receipt_run.pk}").locator("a").first.click()
        expect(page.locator("#item-known")).to_contain_text("The evidence now says: written")
        expect(page.locator("#item-decide")).to_contain_text("Check the evidence again")
        page.screenshot(path=SCREENSHOTS / "inbox-item-receipt.png", full_page=True)

        page.goto("/inbox/")
        row.locator("a", has_text=doing).click()
        expect(page.locator("#item h1")).to_contain_text(doing)
        expect(page.locator("#item-known")).to_contain_text(f"look it up at {receiver.url}")
        expect(page.locator("#item-known")).to_contain_text("Not known: whether the receiver")
        expect(page.locator("dt", has_text="Idempotency-Key sent").first).to_be_visible()
        page.screenshot(path=SCREENSHOTS / "inbox-item.png", full_page=True)

        form = page.locator("#item-decide")
        form.get_by_label("Confirmed: it happened").check()
        form.locator("textarea[name=reason]").fill("Delivery D-7 is in the receiver's log")
        form.locator("input[name=reference]").fill("D-7")
        form.get_by_role("button", name="Record the decision").click()

        expect(page.locator("ul.messages")).to_contain_text("Recorded: confirmed: it happened")
        expect(page.locator("#item-state")).to_have_text("settled")
        decision = OperatorDecision.objects.get(item=item)
        history = page.locator(f"#decision-{decision.pk}")
        expect(history).to_contain_text("olga")
        expect(history).to_contain_text("Delivery D-7 is in the receiver's log")
        expect(history).to_contain_text("open → settled")
        expect(page.locator("#item-decide")).to_have_count(0)  # nothing left to decide
        page.screenshot(path=SCREENSHOTS / "inbox-item-decided.png", full_page=True)

        assert OutcomeItem.objects.get(pk=item.pk).state == OutcomeState.SETTLED
        assert claim_and_drive(run.pk) == RunStatus.COMPLETED
        assert len(receiver.requests) == 1  # never sent again

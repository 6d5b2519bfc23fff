"""The 3 a.m. path in a real browser (Debian's Chromium, Playwright): sign
in, land on "Needs you", open the waiting run it lists with why, decide
from the choices at the top of the run's page, and the run continues;
"Needs you" then says nothing needs anyone, and shows new trouble by
itself, without a reload.

Screenshots go to var/screenshots/ (`RUNDESK_SCREENSHOTS=docs/screenshots`
refreshes the committed ones), as in tests/test_browser.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.contrib.auth.models import User
from playwright.sync_api import Browser, Page, expect

from runs.executor import claim_and_drive
from runs.models import OutcomeItem, OutcomeKind, OutcomeState, RunStatus
from tests.conftest import PASSWORD
from tests.faultruns import run_with
from tests.receivers import LocalServer, status
from tests.test_browser import SCREENSHOTS

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.slow,
    pytest.mark.usefixtures("short_settle"),
]

VIEWPORT = {"width": 1280, "height": 900}


@pytest.fixture
def operator_name() -> str:
    return "olga"


@pytest.fixture
def signed_out(browser: Browser, live_server) -> Iterator[Page]:
    """A fresh window, not signed in; no console error by the end."""
    context = browser.new_context(base_url=live_server.url, viewport=VIEWPORT)
    page = context.new_page()
    problems: list[str] = []
    page.on("console", lambda message: message.type == "error" and problems.append(message.text))
    page.on("pageerror", lambda error: problems.append(str(error)))
    yield page
    assert problems == []  # console errors, CSP refusals
    context.close()


def in_view(page: Page, selector: str) -> bool:
    """Whether the element's top is inside the window as it is scrolled."""
    box = page.locator(selector).first.bounding_box()
    return box is not None and 0 <= box["y"] < VIEWPORT["height"]


def test_at_3am_sign_in_shows_the_waiting_run_and_deciding_lets_it_go_on(
    signed_out: Page, operator_user: User, settings, journal
):
    page = signed_out
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with LocalServer(status(200)) as receiver:
        settings.RUNDESK_DELIVERY_URL = receiver.url
        run, outcome = run_with([{"point": "delivery_timeout"}])
        assert outcome == RunStatus.NEEDS_OPERATOR and len(receiver.requests) == 1
        finished, _ = run_with([])  # a run that needs nobody (it delivers too)
        sent = len(receiver.requests)
        item = OutcomeItem.objects.get(run=run, kind=OutcomeKind.EFFECT)

        # Whoever types the site's address signs in, and lands on Needs you.
        page.goto("/")
        page.fill("input[name=username]", operator_user.get_username())
        page.fill("input[name=password]", PASSWORD)
        page.click("button[type=submit]")
        expect(page.locator("main h1")).to_have_text("Needs you")
        expect(page.locator("header nav a").first).to_have_text("Needs you")
        waiting = page.locator("#needs-waiting li", has_text=f"Run {run.pk}")
        expect(waiting).to_contain_text(run.status_reason[:60])
        expect(page.locator("#needs-items li", has_text=f"Item {item.pk}")).to_contain_text(
            "the whole run"
        )
        expect(page.locator("#needs-you-lines")).not_to_contain_text(f"Run {finished.pk} ")
        page.screenshot(path=SCREENSHOTS / "needs-you.png", full_page=True)

        # The run's page: what lets it go on, at the top, in view without
        # scrolling, above the Cancel button.
        waiting.get_by_role("link", name=f"Run {run.pk}").click()
        expect(page.locator("#run-live > h1")).to_contain_text(f"Run {run.pk}")
        expect(page.locator("#run-unblock")).to_contain_text(run.status_reason[:60])
        decide = page.get_by_role("link", name=f"Decide item {item.pk}")
        expect(decide).to_be_visible()
        assert in_view(page, f"#unblock-item-{item.pk}")
        expect(page.locator("#run-unblock")).to_contain_text("Offered: confirmed: it happened")
        expect(page.locator("#run-unblock #run-decide")).to_contain_text("Abandon the run")
        unblock_top = page.locator("#run-unblock").bounding_box()["y"]
        cancel = page.locator("#run-cancel > summary")  # the cancel form opens from it
        assert unblock_top < cancel.bounding_box()["y"]
        page.screenshot(path=SCREENSHOTS / "run-page-waiting.png")  # what is in view

        # Decide: the receiver's log has it.
        decide.click()
        form = page.locator("#item-decide")
        form.get_by_label("Confirmed: it happened").check()
        form.locator("textarea[name=reason]").fill("Delivery D-9 is in the receiver's log")
        form.locator("input[name=reference]").fill("D-9")
        form.get_by_role("button", name="Record the decision").click()
        expect(page.locator("ul.messages")).to_contain_text(f"Run {run.pk} is back in the queue")
        assert OutcomeItem.objects.get(pk=item.pk).state == OutcomeState.SETTLED

        # The run continues from its receipts, and never sends again.
        assert claim_and_drive(run.pk) == RunStatus.COMPLETED
        assert len(receiver.requests) == sent

        page.get_by_role("link", name="Needs you").click()
        expect(page.locator("#nothing-needs-you")).to_contain_text("Nothing needs anyone now")
        expect(page.locator("#nav-inbox .badge")).to_have_text("0")
        page.screenshot(path=SCREENSHOTS / "needs-you-clear.png", full_page=True)

        # New trouble shows up by itself: the lines refresh without a reload.
        another, outcome = run_with([{"point": "delivery_timeout"}])
        assert outcome == RunStatus.NEEDS_OPERATOR
        expect(page.locator("#needs-waiting li", has_text=f"Run {another.pk}")).to_be_visible(
            timeout=15_000
        )
        expect(page.locator("#nothing-needs-you")).to_have_count(0)

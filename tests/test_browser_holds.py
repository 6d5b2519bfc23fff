"""Holding a tool and releasing it from the holds page, in a real browser
(Debian's Chromium, Playwright): the operator adds a hold with the form, a
run reaching the held tool waits under it, and the release button sends the
run back to the queue.  A screenshot goes to var/screenshots/holds.png
(`RUNDESK_SCREENSHOTS=docs/screenshots` refreshes the committed one)."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import Page, expect

from runs.executor import Ending, claim_and_drive
from runs.models import Hold, HoldWait, Run, RunStatus
from runs.submission import submit
from runs.timeline import timeline
from tests.test_browser import SCREENSHOTS
from tests.test_holds import INPUT, receivers  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture
def operator_name() -> str:
    return "alice"


@pytest.mark.usefixtures("receivers")
def test_an_operator_holds_a_tool_and_releases_it_from_the_page(page: Page):
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.goto("/")  # where signing in lands: Needs you
    page.click("#nav-holds")
    expect(page.locator("main h1")).to_have_text("Holds")
    expect(page.locator("main")).to_contain_text("Nothing is held.")

    page.select_option("#hold-add select[name=tool]", "send_email")
    page.select_option("#hold-add select[name=agent]", "support")
    page.fill("#hold-add textarea[name=reason]", "drafts quote the wrong refund period")
    page.click("#hold-add button[type=submit]")
    hold = Hold.objects.get()
    expect(page.locator(".messages")).to_contain_text(
        f"Hold {hold.pk} added: send_email of support is held."
    )
    section = page.locator(f"#hold-{hold.pk}")
    expect(section).to_contain_text("Held by alice")
    expect(section).to_contain_text("drafts quote the wrong refund period")

    run = submit(agent="support", input=INPUT)
    assert claim_and_drive(run.pk) == Ending.NEEDS_OPERATOR
    page.reload()
    expect(section).to_contain_text("1 run waiting now")
    expect(section.locator(f'a[href="/runs/{run.pk}/"]')).to_contain_text(f"run {run.pk}")
    page.screenshot(path=SCREENSHOTS / "holds.png", full_page=True)

    section.locator("input[name=reason]").fill("drafts fixed")
    section.locator("button", has_text=f"Release hold {hold.pk}").click()
    expect(page.locator(".messages")).to_contain_text(
        f"Hold {hold.pk} released: 1 run back in the queue."
    )
    expect(page.locator("main")).to_contain_text("Nothing is held.")
    released = page.locator(f"tr#hold-{hold.pk}")
    expect(released).to_contain_text("by alice")
    expect(released).to_contain_text("drafts fixed")
    assert Run.objects.get(pk=run.pk).status == RunStatus.QUEUED
    assert HoldWait.objects.get(run=run).until is not None

    # The run goes on; its timeline shows the wait, and who ended it.
    assert claim_and_drive(run.pk) == Ending.COMPLETED
    timeline.flush()
    page.goto(f"/runs/{run.pk}/")
    expect(page.locator("#chart-timeline")).to_contain_text(
        re.compile(r"held: send_email by alice: [0-9.]+ (ms|s), ended by the release of alice")
    )
    page.screenshot(path=SCREENSHOTS / "run-page-held.png", full_page=True)

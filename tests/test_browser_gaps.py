"""Completed with gaps in a real browser (Debian's Chromium, Playwright):
the runs list marks the completed runs whose answer leaves work out, its
status filter lists them alone, and such a run's page says at its top what
was left out, each line leading to its action, which is not drawn as a
success.

Screenshots go to var/screenshots/ (`RUNDESK_SCREENSHOTS=docs/screenshots`
refreshes the committed ones), as in tests/test_browser.py.
"""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import Page, expect

from tests.faultruns import DOCS
from tests.test_browser import SCREENSHOTS
from tests.test_completed_with_gaps import completed, corpus  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

MARKER_TITLE = (
    "The answer leaves work out: a read refused or failed, or research ended by its budget"
    " or deadline. The run's page names what."
)


@pytest.mark.usefixtures("corpus")
def test_the_list_marks_runs_with_gaps_and_their_page_says_what_was_left_out(page: Page):
    refused = completed("Compare the prospectus with Northwind", ["prospectus.pdf", DOCS[0]])
    over_budget = completed("Compare all three on a small budget", DOCS, action_budget=6)
    completed("Compare two funds in full", DOCS[:2])

    page.goto("/")
    marker = page.locator("#run-rows tr", has_text="prospectus").locator(".left-out")
    expect(marker).to_have_text("⚠ with gaps")
    expect(marker).to_have_attribute("title", MARKER_TITLE)
    full = page.locator("#run-rows tr", has_text="two funds in full")
    expect(full.locator(".status")).to_have_text("completed")
    expect(full.locator(".left-out")).to_have_count(0)

    page.select_option("select[name=status]", label="completed with gaps")
    page.get_by_role("button", name="Filter").click()
    expect(page).to_have_url(re.compile(r"/\?status=completed_with_gaps(&|$)"))
    expect(page.locator("#run-rows tr")).to_have_count(2)
    expect(page.locator("#run-rows")).not_to_contain_text("two funds in full")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / "runs-list-gaps.png", full_page=True)

    page.get_by_role("link", name=over_budget.question).click()
    expect(page.locator("#run-left-out")).to_contain_text(
        f"1 of 3 documents not read (action budget of 6 exhausted): {DOCS[2]}"
    )
    page.go_back()
    page.get_by_role("link", name=refused.question).click()
    top = page.locator("#run-left-out")
    expect(top).to_be_visible()
    expect(top).to_contain_text("Completed with gaps: the answer leaves out")
    page.screenshot(path=SCREENSHOTS / "run-page-gaps.png")  # what is in view
    top.get_by_role(
        "link", name="reading prospectus.pdf: refused: a PDF document, not text"
    ).click()
    expect(page.locator(":target .state")).to_have_text("refused")
    expect(page.locator(":target")).to_contain_text("'prospectus.pdf': a PDF document, not text")

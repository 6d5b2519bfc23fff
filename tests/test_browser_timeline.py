"""The run timeline in a real browser (Debian's Chromium, Playwright),
after a wait for an operator: the page shows the run still waiting on its
chart, the operator decides from the item's page, the run completes, and
its chart draws the wait as a labelled span ended by that decision, with
its legend.  Screenshots go to var/screenshots/ (`RUNDESK_SCREENSHOTS=
docs/screenshots` refreshes the committed ones), as in tests/test_browser.py.
"""

from __future__ import annotations

import pytest
from playwright.sync_api import Page, expect

from runs.executor import claim_and_drive
from runs.models import OutcomeItem, OutcomeKind, RunStatus
from runs.timeline import timeline
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
    return "olga"


def test_the_timeline_draws_the_wait_and_the_decision_that_ended_it(page: Page, settings, journal):
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with LocalServer(status(200)) as receiver:
        settings.RUNDESK_DELIVERY_URL = receiver.url
        run, outcome = run_with([{"point": "delivery_timeout"}])
        assert outcome == RunStatus.NEEDS_OPERATOR
        item = OutcomeItem.objects.get(run=run, kind=OutcomeKind.EFFECT)

        page.goto(f"/runs/{run.pk}/")
        chart = page.locator("#chart-timeline")
        expect(chart.locator("svg.main-svg").first).to_be_visible()
        expect(chart.locator(".annotation-text", has_text="still waiting")).to_be_visible()
        expect(chart.locator(".legend")).to_contain_text("action outcome unknown")

        page.get_by_role("link", name=f"Decide item {item.pk}").click()
        form = page.locator("#item-decide")
        form.get_by_label("Confirmed: it happened").check()
        form.locator("textarea[name=reason]").fill("Delivery D-9 is in the receiver's log")
        form.locator("input[name=reference]").fill("D-9")
        form.get_by_role("button", name="Record the decision").click()
        expect(page.locator("ul.messages")).to_contain_text(f"Run {run.pk} is back in the queue")
        assert claim_and_drive(run.pk) == RunStatus.COMPLETED
        timeline.flush()

    page.goto(f"/runs/{run.pk}/")
    expect(chart.locator("svg.main-svg").first).to_be_visible()
    expect(chart.locator(".bars path").first).to_be_attached()
    wait = chart.locator(".annotation-text", has_text="waiting for an operator")
    expect(wait).to_be_visible()
    expect(wait).to_contain_text("ended by the decision of olga (confirmed: it happened)")
    legend = chart.locator(".legend")
    expect(legend).to_be_visible()
    for name in ("waiting for an operator", "action completed", "checkpoint committed"):
        expect(legend).to_contain_text(name)
    expect(legend).not_to_contain_text("action outcome unknown")  # the delivery is settled
    # The legend is beside the plot, not over its time axis.
    axis = chart.locator(".xaxislayer-above").first.bounding_box()
    box = legend.bounding_box()
    assert axis is not None and box is not None
    assert box["x"] >= axis["x"] + axis["width"]
    chart.scroll_into_view_if_needed()
    chart.screenshot(path=SCREENSHOTS / "run-timeline-wait.png")

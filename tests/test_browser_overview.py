"""The overview in a real browser (Debian's Chromium, Playwright): the
operator opens it from the header, sees the runs over the last hour drawn,
and a bar of the figure opens the runs it counts, filtered; the table by
agent links to that agent's runs.  The figures refresh without a reload.

Screenshots go to var/screenshots/ (`RUNDESK_SCREENSHOTS=docs/screenshots`
refreshes the committed ones), as in tests/test_browser.py.
"""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from runs import summaries
from runs.models import Run, RunStatus
from tests.test_browser import SCREENSHOTS
from tests.test_overview import ended_run

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_a_bar_of_the_overview_opens_the_runs_it_counts(page: Page):
    now = timezone.now()
    failed = ended_run(
        RunStatus.FAILED, ended=now - dt.timedelta(minutes=10), took=600.0, steps=(0.5,)
    )
    Run.objects.create(question="still queued", documents=["a.md"])  # not a failed one
    summaries.roll_up()

    page.goto("/")  # where signing in lands: Needs you
    page.click("#nav-overview")
    expect(page.locator("h1")).to_have_text("Overview")
    chart = page.locator("#chart-over-time")
    expect(chart.locator(".main-svg").first).to_be_visible()
    expect(page.locator("#agent-research td").nth(1)).to_have_text("1")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / "overview.png", full_page=True)

    # The failed runs' bar: the only bar (the submitted ones are a line).
    bar = chart.locator("g.trace.bars g.point path").first
    expect(bar).to_be_visible()
    # Plotly's drag layer takes the pointer and finds the point under it: a
    # click where the bar is drawn, as a person's.
    box = bar.bounding_box()
    assert box is not None
    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    expect(page.locator("h1")).to_have_text("Runs")
    assert "status=failed" in page.url and "time=finished" in page.url
    rows = page.locator("#run-rows tr")
    expect(rows).to_have_count(1)
    expect(rows.first.locator("td").first).to_contain_text(str(failed.pk))
    page.screenshot(path=SCREENSHOTS / "overview-bar-to-runs.png")


def test_the_agent_table_links_to_the_agents_runs_and_the_figures_refresh(page: Page):
    now = timezone.now()
    done = ended_run(RunStatus.COMPLETED, ended=now - dt.timedelta(minutes=5), took=30.0)
    summaries.roll_up()
    # The page's timers run on Playwright's clock, which the test moves on:
    # the region's poll is not waited for in real time.
    page.clock.install()
    page.goto("/overview/")
    expect(page.locator("#overview-waiting")).to_contain_text("No run waits for an operator")
    # From here the page's time moves only when told (a second on).
    page.clock.pause_at(page.evaluate("Date.now()") / 1000 + 1)

    # New trouble shows by itself within 15 s: the region polls.  Its timer
    # fires as the page's 15 s pass, and asks the live server.
    Run.objects.create(question="waits", documents=["a.md"], status=RunStatus.NEEDS_OPERATOR)
    page.clock.run_for(15_000)
    expect(page.locator("#overview-waiting")).to_contain_text("no item holds it")
    page.clock.resume()

    page.click("#agent-research a")
    expect(page.locator("h1")).to_have_text("Runs")
    assert "agent=research" in page.url and "time=finished" in page.url
    expect(page.locator("#run-rows tr")).to_have_count(1)
    expect(page.locator("#run-rows tr").first).to_contain_text(str(done.pk))

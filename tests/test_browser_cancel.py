"""In Chromium: a run whose owner stopped renewing says so in warning
colour, and a cancel asks for a reason and a confirmation before it is
sent (issue 36, points 3 and 5)."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from runs.models import Run, RunStatus
from runs.submission import submit
from tests.test_browser import SCREENSHOTS

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_a_stuck_run_warns_and_a_cancel_asks_why_and_whether_you_mean_it(page: Page) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    stuck = Run.objects.create(
        question="a run whose executor stopped",
        documents=["a.md"],
        status=RunStatus.RUNNING,
        lease_owner="executor@host-7:123",
        lease_epoch=2,
        lease_expires_at=timezone.now() - dt.timedelta(minutes=2),
    )
    page.goto(f"/runs/{stuck.pk}/")
    status = page.locator("#run-status")
    expect(status).to_contain_text("the owner stopped renewing")
    expect(status).to_contain_text("lease expired 2 min")
    expect(status).to_have_class("status running warning")
    # Warning colour, not the calm blue of a run whose owner renews.
    assert status.evaluate("e => getComputedStyle(e).backgroundColor") == "rgb(253, 231, 191)"
    expect(page.locator("#run-lease")).to_have_class("warning")
    page.screenshot(path=SCREENSHOTS / "run-page-lease-expired.png")

    queued = submit(question="a run asked by mistake", documents=["a.md"])
    page.goto(f"/runs/{queued.pk}/")
    form = page.locator("#run-cancel form")
    expect(form).to_be_hidden()  # nothing is one click away
    page.get_by_text(f"Cancel run {queued.pk}…").click()
    expect(form).to_be_visible()
    button = form.get_by_role("button", name=f"Cancel run {queued.pk}")
    # Sent without a reason nor the tick, the browser keeps it: nothing is asked.
    button.click()
    reason = form.locator("textarea[name=reason]")
    assert reason.evaluate("e => e.validity.valueMissing")
    reason.fill("asked the wrong question")
    button.click()
    assert form.locator("input[name=confirm]").evaluate("e => e.validity.valueMissing")
    assert Run.objects.get(pk=queued.pk).status == RunStatus.QUEUED
    page.screenshot(path=SCREENSHOTS / "run-page-cancel-form.png")

    form.get_by_label(f"Yes, cancel run {queued.pk}").check()
    button.click()
    expect(page.locator("#run-notice")).to_have_text(f"Cancel requested for run {queued.pk}.")
    expect(page.locator("#run-status")).to_have_text("cancelled by operator")
    expect(page.locator("#run-cancelled-by")).to_contain_text(
        "by operator (asked the wrong question); the run ended by it"
    )
    expect(page.locator("#run-cancel")).to_have_count(0)
    run = Run.objects.get(pk=queued.pk)
    assert run.status_reason == "cancelled by operator: asked the wrong question"

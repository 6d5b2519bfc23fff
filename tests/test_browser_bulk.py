"""A bulk action in a real browser (Debian's Chromium, Playwright): an
operator filters the runs list, asks to act on the runs it selects, reads
the dry run (what each run would change, what would be refused and why),
confirms with a reason, and follows the job's progress live until it ends.
The action is the one only Rundesk offers: settling unknown outcomes by
their evidence, in bulk.

Screenshots go to var/screenshots/ (`RUNDESK_SCREENSHOTS=docs/screenshots`
refreshes the committed ones), as in tests/test_browser.py.
"""

from __future__ import annotations

import pytest
from playwright.sync_api import Page, expect

from runs import bulk
from runs.bulk import BulkJob, BulkState
from runs.models import OperatorDecision, OutcomeItem, OutcomeState, RunStatus
from tests.processes import broker as broker  # where the confirm's hand-over goes
from tests.test_browser import SCREENSHOTS
from tests.test_bulk import publication_item, run_in
from tests.test_handover import fresh_producers as fresh_producers

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_filter_dry_run_confirm_and_follow_a_bulk_settlement_by_evidence(
    page: Page, broker, fresh_producers
) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    adopted = run_in(RunStatus.NEEDS_OPERATOR, "Compare the clean-energy funds")
    publication_item(adopted, written=True)
    lost = run_in(RunStatus.NEEDS_OPERATOR, "Summarise the treasury fund")
    publication_item(lost, written=False)
    held = run_in(RunStatus.NEEDS_OPERATOR, "A run no item holds")
    run_in(RunStatus.QUEUED, "A queued run the filter leaves out")

    page.goto("/")
    page.locator('select[name="status"]').select_option("needs_operator")
    page.get_by_role("button", name="Filter").click()
    act = page.locator("#bulk-act a")
    expect(act).to_have_text("Act on these 3 runs…")
    act.click()

    expect(page.locator("h1")).to_have_text("Bulk action: dry run")
    expect(page.locator("#bulk-selection")).to_contain_text("status=needs_operator")
    page.get_by_label("Action").select_option("decide")
    page.get_by_label("Decision").select_option("check_again")
    page.get_by_label("on open items of kind").select_option("publication")
    page.get_by_role("button", name="Dry run").click()

    expect(page.locator("#bulk-summary")).to_have_text(
        "3 runs selected: 2 would change, 1 would be refused."
    )
    expect(page.locator(f"#plan-run-{adopted.pk}")).to_contain_text(
        "The evidence now settles it: committed."
    )
    expect(page.locator(f"#plan-run-{lost.pk}")).to_contain_text(
        "The evidence now settles it: not written."
    )
    expect(page.locator(f"#plan-run-{held.pk}")).to_contain_text("no open answer publication item")
    page.screenshot(path=SCREENSHOTS / "bulk-dry-run.png", full_page=True)
    # The dry run wrote nothing.
    assert not BulkJob.objects.exists() and not OperatorDecision.objects.exists()

    confirm = page.locator("#bulk-confirm")
    button = confirm.get_by_role("button")
    expect(confirm.locator("#bulk-left-alone")).to_have_text("The 1 refused is left alone.")
    expect(button).to_have_text(
        "Confirm: “check the evidence again” on every open answer publication item, on the 2 runs "
        "that would change"
    )
    button.click()  # without a reason the browser keeps it
    assert confirm.locator("textarea[name=reason]").evaluate("e => e.validity.valueMissing")
    confirm.get_by_label("Why").fill("the database restarted: settle what the evidence shows")
    button.click()

    job = BulkJob.objects.get()
    expect(page.locator("h1")).to_have_text(f"Bulk job {job.pk}")
    expect(page.locator("#bulk-state")).to_contain_text("2 to do")
    # A worker carries it out; the page follows it without a reload.
    assert bulk.process(job.pk) == BulkState.DONE
    expect(page.locator("#bulk-state")).to_contain_text(
        "Done: 2 done, 0 refused, 0 not done (stopped), 0 to do.", timeout=10_000
    )
    expect(page.locator(f"#result-run-{adopted.pk}")).to_contain_text(
        "settled; the run is back in the queue"
    )
    # The run the dry run refused was left alone, as it said.
    expect(page.locator(f"#result-run-{held.pk}")).to_have_count(0)
    # It stopped polling (286) once the job ended: no stop button either.
    assert page.locator("#bulk-progress[hx-get]").count() == 0
    expect(page.locator("#bulk-stop")).to_have_count(0)
    page.screenshot(path=SCREENSHOTS / "bulk-job-done.png", full_page=True)

    assert set(OutcomeItem.objects.values_list("state", flat=True)) == {OutcomeState.SETTLED}
    assert OperatorDecision.objects.filter(decided_by="operator", choice="check_again").count() == 2
    page.goto("/bulk/")
    expect(page.locator("#bulk-jobs tbody tr")).to_have_count(1)
    expect(page.locator("#bulk-jobs tbody tr")).to_contain_text("status=needs_operator")

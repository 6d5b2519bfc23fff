"""The dashboard in a real browser: Debian's Chromium driven by Playwright.

Signs in, reads the runs list, opens a run and sees its timeline drawn,
follows a run live until it completes, opens a lock incident's graph; no
console error, nothing blocked by the Content-Security-Policy, and model
output never runs.  Screenshots go to var/screenshots/, so a test run
leaves the work tree clean; `RUNDESK_SCREENSHOTS=docs/screenshots make test`
refreshes the committed ones.
"""

from __future__ import annotations

import os
import threading

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from evidence import locks, pglog
from evidence.models import IncidentSource
from runs.executor import claim_and_drive
from runs.leases import Lease
from runs.models import OutcomeKind, Run
from runs.outcomes import open_item
from runs.submission import submit
from runs.timeline import EventKind, timeline
from tests.conftest import ROOT
from tests.test_pglog import THREE_WAY

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

SCREENSHOTS = ROOT / os.environ.get("RUNDESK_SCREENSHOTS", "var/screenshots")
DOCS = ["northwind-clean-energy.md", "crestline-short-treasury.md", "meridian-world-equity.md"]


def completed_run() -> Run:
    run = submit(question="Which fund is cheapest to hold?", documents=DOCS)
    claim_and_drive(run.pk)
    timeline.flush()
    return run


def test_runs_list_and_a_run_page_with_its_timeline_drawn(page: Page):
    run = completed_run()
    lost = submit(
        question="Deliver the bond comparison (its delivery answer is lost)",
        documents=DOCS[1:],
        faults=[{"point": "delivery_timeout"}],
    )
    claim_and_drive(lost.pk)
    submit(question="Compare all five funds (cancelled)", documents=DOCS).request_cancel(
        by="operator"
    )
    submit(question="Which fund pays the most income? (waiting)", documents=DOCS)
    timeline.flush()
    page.goto("/")
    lost_row = page.locator("#run-rows tr", has_text="delivery answer is lost")
    expect(lost_row.locator(".status")).to_have_text("waits for an operator")
    expect(lost_row.locator(".state.unknown")).to_have_text("1")
    row = page.locator("#run-rows tr", has_text="Which fund is cheapest")
    expect(row.locator(".status")).to_have_text("completed")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / "runs-list.png", full_page=True)

    row.locator("a").first.click()
    expect(page.locator("#run-live > h1")).to_contain_text(f"Run {run.pk}")
    expect(page.locator("#chart-timeline svg.main-svg").first).to_be_visible()
    expect(page.locator("#chart-timeline .bars path").first).to_be_attached()
    expect(page.locator(".answer.final table")).to_be_visible()  # the final answer, rendered
    page.screenshot(path=SCREENSHOTS / "run-page.png", full_page=True)


def test_a_run_is_followed_live_until_it_completes(page: Page):
    run = submit(
        question="Follow me live", documents=DOCS[:2], faults=[{"point": "tool_delay", "ms": 400}]
    )
    page.goto(f"/runs/{run.pk}/")
    expect(page.locator("#run-status")).to_have_text("queued")
    worker = threading.Thread(target=_execute_in_thread, args=(run.pk,))
    worker.start()
    expect(page.locator("#run-status")).to_have_text("running", timeout=15_000)
    expect(page.locator("#run-status")).to_have_text("completed", timeout=30_000)
    worker.join(30)
    expect(page.locator("#chart-timeline svg.main-svg").first).to_be_visible()


def test_the_live_region_refreshes_and_keeps_what_the_reader_did(page: Page):
    run = submit(question="Watched while running", documents=["a.md"])
    lease = Lease.claim(run.pk, "owner")
    assert lease is not None
    item = open_item(
        run_id=run.pk,
        kind=OutcomeKind.RECEIPT,
        subject="receipt:watched",
        summary="a receipt whose COMMIT got no answer",
        evidence={"xid": 1234},
    )
    # As the executor says its claim: the run's timeline has it, so a chart.
    timeline.record(run.pk, EventKind.LEASE_ACQUIRED, "owner", epoch=lease.epoch)
    timeline.flush()
    page.goto(f"/runs/{run.pk}/")
    expect(page.locator("#chart-timeline svg.main-svg").first).to_be_visible()
    page.evaluate("""() => Plotly.relayout("chart-timeline", {"xaxis.range": [-3, 7]})""")
    # An open item's evidence is shown at once, as labelled fields; the
    # reader closes it.
    evidence = page.locator(f"#item-{item.pk}-evidence")
    expect(evidence).to_have_attribute("open", "")
    expect(evidence.locator("dd").first).to_have_text("1234")
    evidence.locator("summary").click()
    expect(evidence).not_to_have_attribute("open", "")
    lease.record_boundary(step_key="read:a.md", kind="read_document", effect_class="read", input={})
    # The next refresh shows the new action, and the zoom and the closed
    # evidence are still as the reader left them.
    expect(page.locator("#run-live code", has_text="read:a.md")).to_be_visible(timeout=10_000)
    zoom = page.evaluate("document.getElementById('chart-timeline').layout.xaxis.range")
    assert zoom == [-3, 7]
    expect(evidence).not_to_have_attribute("open", "")
    evidence.locator("summary").click()
    expect(evidence.locator("dt").first).to_have_text("Transaction id (xid)")


def test_older_events_load_in_place(page: Page):
    run = submit(question="Many events", documents=["a.md"])
    for i in range(70):
        timeline.record(run.pk, EventKind.FAULT_INJECTED, f"filler {i}")
    timeline.flush()
    page.goto(f"/runs/{run.pk}/")
    rows = page.locator("table.events tbody tr")
    expect(rows).to_have_count(51)  # a page of 50 events and the link
    page.get_by_text("load older events").click()
    expect(rows).to_have_count(71)  # the rest, in place of the link
    expect(page.locator("table.events")).to_contain_text("submitted")
    assert page.url.endswith(f"/runs/{run.pk}/")  # the page stayed where it was


def test_a_run_with_an_open_item_and_a_settled_checkpoint_reads_in_plain_words(page: Page):
    """Checkpoint 1's COMMIT got no answer and evidence settled it; the lease
    was taken away before action 4 and the run resumed; the delivery's
    answer was lost, so the run waits for an operator."""
    run = submit(
        question="Compare the three funds and deliver the report",
        documents=DOCS,
        faults=[
            {"point": "drop_connection_at_commit", "write": "checkpoint", "action": 1},
            {"point": "lease_stolen", "action": 4},
            {"point": "delivery_timeout"},
        ],
    )
    assert claim_and_drive(run.pk) == "lease_lost"
    Run.objects.filter(pk=run.pk).update(lease_expires_at=timezone.now())
    assert claim_and_drive(run.pk) == "needs_operator"
    timeline.flush()
    page.goto(f"/runs/{run.pk}/")
    expect(page.locator("#run-status")).to_have_text("waits for an operator")
    expect(page.locator("#nav-inbox .badge")).to_have_text("1")
    item = page.locator("article.item.open")
    expect(item.locator("dt", has_text="Idempotency-Key sent")).to_be_visible()
    expect(page.locator("#checkpoint-1")).to_contain_text("committed (settled by evidence)")
    expect(page.locator("table.checkpoints tbody tr")).to_have_count(
        len(set(run.checkpoints.values_list("number", flat=True)))
    )
    chart = page.locator("#chart-timeline")
    expect(chart.locator("svg.main-svg").first).to_be_visible()
    expect(chart.get_by_text("lease lost").first).to_be_attached()
    expect(chart.get_by_text("resumed").first).to_be_attached()
    run.refresh_from_db()
    expect(chart.get_by_text(f"lease taken, epoch {run.lease_epoch}")).to_be_attached()
    page.screenshot(path=SCREENSHOTS / "run-page-outcomes.png", full_page=True)
    # The runs list has no chart: plotly.js is not even loaded there.
    page.goto("/")
    assert page.evaluate("typeof window.Plotly") == "undefined"


def _execute_in_thread(run_id: int) -> None:
    from django.db import connection

    try:
        claim_and_drive(run_id)
    finally:
        connection.close()


def test_lock_incident_graph_is_drawn_with_its_cycle(page: Page):
    (report,) = pglog.parse(THREE_WAY)
    incident = locks.store(IncidentSource.LOG, report.graph, summary="imported deadlock")
    page.goto("/locks/")
    page.click(f"a[href='/locks/{incident.pk}/']")
    expect(page.locator("main h1")).to_contain_text("cycle")
    expect(page.locator("#chart-locks svg.main-svg").first).to_be_visible()
    expect(page.locator("#chart-locks").get_by_text("ExclusiveLock on tuple").first).to_be_visible()
    page.screenshot(path=SCREENSHOTS / "lock-graph.png", full_page=True)


def test_model_output_with_script_is_shown_never_run(page: Page):
    run = submit(question="hostile answer", documents=["a.md"])
    lease = Lease.claim(run.pk, "owner")
    assert lease is not None
    lease.publish_revision(
        1,
        "# Answer\n\n<script>window.pwned = 1</script>\n\n"
        '<img src="/static/favicon.svg" onerror="window.pwned = 2">',
        is_final=True,
    )
    page.goto(f"/runs/{run.pk}/")
    expect(page.locator(".answer h1")).to_have_text("Answer")
    assert page.evaluate("window.pwned") is None
    assert page.locator(".answer script").count() == 0
    assert page.locator(".answer img").count() == 0  # an answer fetches nothing

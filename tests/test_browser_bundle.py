"""The run page's "Export bundle" in a real browser (Debian's Chromium,
Playwright): an operator exports a run's bundle, watches its progress,
and downloads it when done; the file verifies.  The export task runs in
this process (on its own thread) where a worker would.

Screenshots go to var/screenshots/ (`RUNDESK_SCREENSHOTS=docs/screenshots`
refreshes the committed ones), as in tests/test_browser.py.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from django.db import connection
from playwright.sync_api import Page, expect

from evidence import bundles, tasks
from evidence.models import BundleExport
from tests.test_browser import SCREENSHOTS, completed_run

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def _export_in_thread(export_id: int, outcome: list[str]) -> None:
    try:
        outcome.append(tasks.export_bundle(export_id))
    finally:
        connection.close()


def test_an_operator_exports_a_bundle_watches_it_and_downloads_it(
    page: Page, tmp_path: Path, settings: object, monkeypatch: pytest.MonkeyPatch
):
    settings.RUNDESK_BUNDLE_DIR = tmp_path / "bundles"
    sent: list[int] = []
    monkeypatch.setattr(tasks.export_bundle, "delay", sent.append)
    # The report is the last thing written: the export waits there until
    # the test has seen it running.
    seen_running, real_report = threading.Event(), bundles.report_html

    def report_when_seen(*args: object, **kwargs: object) -> str:
        assert seen_running.wait(30)
        return real_report(*args, **kwargs)

    monkeypatch.setattr(bundles, "report_html", report_when_seen)
    run = completed_run()
    page.goto(f"/runs/{run.pk}/")
    region = page.locator("#run-bundles")
    expect(region).to_contain_text("No bundle exported yet.")

    region.get_by_role("button", name="Export bundle").click()
    row = region.locator("tr.bundle")
    expect(row.locator(".state")).to_have_text("waiting for a worker")
    export = BundleExport.objects.get()
    assert sent == [export.pk] and export.requested_by == "operator"

    outcome: list[str] = []
    worker = threading.Thread(target=_export_in_thread, args=(export.pk, outcome))
    worker.start()
    try:
        # The region polls: the bar fills as rows are written.
        expect(row.locator(".state")).to_have_text("exporting", timeout=15_000)
        expect(row.locator("progress[value]")).to_be_visible(timeout=15_000)
        expect(row.locator(".rows")).to_contain_text(" rows")
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        region.screenshot(path=SCREENSHOTS / "run-bundle-progress.png")
    finally:
        seen_running.set()
        worker.join(60)
    assert outcome == ["done"]

    export.refresh_from_db()
    expect(row.locator(".state")).to_have_text("ready", timeout=15_000)
    expect(row.locator(".rows")).to_have_text(f"{export.rows_total} of {export.rows_total} rows")
    expect(row.locator(".seal code")).to_have_text(export.seal)
    link = row.get_by_role("link", name=f"Download rundesk-run-{run.pk}.zip")
    expect(link).to_be_visible()
    region.screenshot(path=SCREENSHOTS / "run-bundle.png")
    # Polling stopped (286): the region no longer asks for itself.
    expect(region).not_to_have_attribute("hx-trigger", "every 1s")

    with page.expect_download() as started:
        link.click()
    download = started.value
    assert download.suggested_filename == f"rundesk-run-{run.pk}.zip"
    saved = tmp_path / download.suggested_filename
    download.save_as(saved)
    assert saved.read_bytes() == export.path.read_bytes()
    checked = bundles.verify(saved)
    assert checked.ok and checked.manifest["seal"] == export.seal

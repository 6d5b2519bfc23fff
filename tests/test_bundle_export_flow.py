"""The run page's "Export bundle": who may export and download, the Celery
task that writes the bundle (called in-process here, and once by a real
worker), its progress region, and the expiry of its files.  Real runs on
a real PostgreSQL."""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
import zipfile
from pathlib import Path

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from evidence import bundles, tasks
from evidence.models import BUNDLE_STALLED_AFTER, BundleExport, BundleState
from runs.executor import claim_and_drive
from runs.models import Run, RunEvent
from runs.submission import submit
from runs.timeline import EventKind, timeline
from tests import test_celery
from tests.conftest import make_user, signed_in
from tests.test_celery import Worker, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

# The filesystem broker folder a real worker reads (tests/test_celery.py).
broker = test_celery.broker


@pytest.fixture(autouse=True)
def bundle_dir(tmp_path: Path, settings: object) -> Path:
    # Where a worker started with process_env (RUNDESK_VAR_DIR) writes too.
    settings.RUNDESK_BUNDLE_DIR = tmp_path / "var" / "bundles"
    return settings.RUNDESK_BUNDLE_DIR


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """The export tasks sent to the broker (once their row is committed),
    recorded instead of sent: no worker runs here."""
    calls: list[tuple] = []
    monkeypatch.setattr(tasks.export_bundle, "delay", lambda *args: calls.append(args))
    return calls


@pytest.fixture
def run() -> Run:
    run = submit(question="Compare", documents=["northwind-clean-energy.md"])
    claim_and_drive(run.pk)
    timeline.flush()
    return run


def queued(run: Run, **fields: object) -> BundleExport:
    return BundleExport.objects.create(run=run, requested_by="operator", **fields)


def done(run: Run) -> BundleExport:
    export = queued(run)
    assert tasks.export_bundle(export.pk) == "done"
    export.refresh_from_db()
    return export


def files_in(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir()) if directory.exists() else []


def htmx(client: Client, url: str):
    return client.get(url, headers={"HX-Request": "true", "HX-Target": "run-bundles"})


def test_anonymous_is_sent_to_sign_in(client, run, sent):
    export = done(run)
    for response in [
        client.post(f"/runs/{run.pk}/bundle/"),
        client.get(f"/runs/{run.pk}/bundles/"),
        client.get(f"/bundles/{export.pk}/download"),
    ]:
        assert response.status_code == 302 and response["Location"].startswith("/login/")
    assert BundleExport.objects.count() == 1 and not sent


def test_viewers_see_the_exports_but_may_neither_export_nor_download(viewer, run, sent):
    export = done(run)
    assert viewer.post(f"/runs/{run.pk}/bundle/").status_code == 403
    assert viewer.get(f"/bundles/{export.pk}/download").status_code == 403
    assert BundleExport.objects.count() == 1 and not sent
    page = viewer.get(f"/runs/{run.pk}/").content.decode()
    assert f'id="bundle-{export.pk}"' in page and export.seal in page
    assert "Export bundle" not in page and f"/bundles/{export.pk}/download" not in page


def test_operator_exports_and_downloads_the_bundle_the_task_wrote(operator, run, sent, bundle_dir):
    response = operator.post(f"/runs/{run.pk}/bundle/")
    assert response.status_code == 302
    assert response["Location"] == f"/runs/{run.pk}/#run-bundles"
    export = BundleExport.objects.get()
    assert (export.run_id, export.requested_by) == (run.pk, "operator")
    assert export.state == BundleState.QUEUED and export.include_evidence
    assert sent == [(export.pk,)]  # handed to the worker once committed

    before = timezone.now()
    assert tasks.export_bundle(export.pk) == "done"
    export.refresh_from_db()
    assert export.state == BundleState.DONE
    assert files_in(bundle_dir) == [export.file_name]  # no partial file left
    checked = bundles.verify(export.path)
    assert checked.ok, checked.failures
    assert checked.manifest["seal"] == export.seal and checked.manifest["run_id"] == run.pk
    rows = sum(entry.get("rows", 0) for entry in checked.manifest["files"].values())
    assert export.rows_written == export.rows_total == rows > 1
    assert export.bytes == export.path.stat().st_size
    assert export.path.stat().st_mode & 0o007 == 0  # nobody outside the service's group
    hours = dt.timedelta(hours=24)
    assert before + hours <= export.expires_at <= timezone.now() + hours

    page = operator.get(f"/runs/{run.pk}/").content.decode()
    assert f'href="/bundles/{export.pk}/download"' in page and export.seal in page
    download = operator.get(f"/bundles/{export.pk}/download")
    assert download.status_code == 200 and download["Content-Type"] == "application/zip"
    assert download["Content-Disposition"] == f'attachment; filename="rundesk-run-{run.pk}.zip"'
    assert b"".join(download.streaming_content) == export.path.read_bytes()


def test_an_export_no_worker_can_be_asked_for_fails_with_why(operator, run, monkeypatch):
    def refused(*args: object) -> None:
        raise OSError("[Errno 111] Connection refused")

    monkeypatch.setattr(tasks.export_bundle, "delay", refused)
    page = operator.post(f"/runs/{run.pk}/bundle/", follow=True).content.decode()
    export = BundleExport.objects.get()
    assert export.state == BundleState.FAILED and "Connection refused" in export.error
    assert f"Bundle export {export.pk} failed: no worker could be asked" in page


def test_leaving_evidence_out_leaves_the_copies_out_of_the_bundle(operator, run, sent):
    operator.post(f"/runs/{run.pk}/bundle/", {"no_evidence": "1"})
    export = BundleExport.objects.get()
    assert not export.include_evidence
    tasks.export_bundle(export.pk)
    export.refresh_from_db()
    with zipfile.ZipFile(export.path) as bundle:
        assert "evidence_copies.jsonl" not in bundle.namelist()
        assert json.loads(bundle.read("manifest.json"))["evidence_included"] is False
    refused = operator.post(f"/runs/{run.pk}/bundle/", {"no_evidence": "maybe"})
    assert refused.status_code == 400 and b"no_evidence" in refused.content
    assert operator.post("/runs/987654/bundle/").status_code == 404
    assert BundleExport.objects.count() == 1


def test_htmx_gets_the_bundles_region_polling_while_the_export_is_queued(operator, run, sent):
    response = operator.post(f"/runs/{run.pk}/bundle/", headers={"HX-Request": "true"})
    assert response.status_code == 200
    fragment = response.content.decode().lstrip()
    assert fragment.startswith('<section id="run-bundles"')
    assert f'hx-get="/runs/{run.pk}/bundles/"' in fragment and 'hx-trigger="every 1s"' in fragment
    assert "waiting for a worker" in fragment and "<progress>" in fragment


def test_export_needs_a_csrf_token(run, sent):
    strict = signed_in(make_user("strict", operator=True), enforce_csrf_checks=True)
    assert strict.post(f"/runs/{run.pk}/bundle/").status_code == 403
    assert not BundleExport.objects.exists() and not sent
    strict.get(f"/runs/{run.pk}/")  # sets the CSRF cookie, as the page does
    token = strict.cookies["csrftoken"].value
    response = strict.post(f"/runs/{run.pk}/bundle/", {"csrfmiddlewaretoken": token})
    assert response.status_code == 302 and BundleExport.objects.count() == 1


def test_wrong_methods_are_refused(operator, run, sent):
    export = done(run)
    assert operator.get(f"/runs/{run.pk}/bundle/").status_code == 405
    assert operator.post(f"/runs/{run.pk}/bundles/").status_code == 405
    assert operator.post(f"/bundles/{export.pk}/download").status_code == 405
    assert BundleExport.objects.count() == 1 and not sent


def test_progress_region_polls_while_an_export_is_active_and_then_stops_with_286(viewer, run):
    assert htmx(viewer, f"/runs/{run.pk}/bundles/").status_code == 286  # nothing exported
    export = queued(run)
    active = htmx(viewer, f"/runs/{run.pk}/bundles/")
    assert active.status_code == 200 and 'hx-trigger="every 1s"' in active.content.decode()
    tasks.export_bundle(export.pk)
    export.refresh_from_db()
    finished = htmx(viewer, f"/runs/{run.pk}/bundles/")
    assert finished.status_code == 286
    body = finished.content.decode()
    assert "hx-trigger" not in body and "ready" in body and export.seal in body
    assert f'value="{export.rows_total}"' in body
    # Without htmx, the region's URL is the run page's region.
    plain = viewer.get(f"/runs/{run.pk}/bundles/")
    assert plain.status_code == 302 and plain["Location"] == f"/runs/{run.pk}/#run-bundles"


def test_a_task_run_twice_exports_once(run, bundle_dir):
    export = done(run)
    written = export.path.stat()
    assert tasks.export_bundle(export.pk) == "already_done"
    assert export.path.stat().st_mtime_ns == written.st_mtime_ns
    assert files_in(bundle_dir) == [export.file_name]
    again = BundleExport.objects.get(pk=export.pk)
    assert (again.seal, again.finished_at) == (export.seal, export.finished_at)

    # A task redelivered while its export is being written leaves it alone.
    running = queued(run)
    assert running.start(timezone.now())
    assert tasks.export_bundle(running.pk) == "already_running"
    assert not running.path.exists() and not running.part_path.exists()
    assert BundleExport.objects.get(pk=running.pk).state == BundleState.RUNNING
    assert tasks.export_bundle(987654) == "missing"


def test_an_expired_bundle_is_404_and_the_next_task_run_removes_its_file(operator, run, sent):
    export = done(run)
    assert operator.get(f"/bundles/{export.pk}/download").status_code == 200
    BundleExport.objects.filter(pk=export.pk).update(
        expires_at=timezone.now() - dt.timedelta(seconds=1)
    )
    assert operator.get(f"/bundles/{export.pk}/download").status_code == 404
    page = operator.get(f"/runs/{run.pk}/").content.decode()
    assert f"/bundles/{export.pk}/download" not in page and "expired at" in page

    other = done(run)  # each task run removes what expired
    assert not export.path.exists() and other.path.exists()
    export.refresh_from_db()
    assert export.state == BundleState.EXPIRED and export.seal
    assert operator.get(f"/bundles/{export.pk}/download").status_code == 404
    assert "its file was removed" in operator.get(f"/runs/{run.pk}/").content.decode()


def test_a_missing_file_is_404_not_a_500(operator, run):
    export = done(run)
    export.path.unlink()
    assert operator.get(f"/bundles/{export.pk}/download").status_code == 404
    assert operator.get("/bundles/987654/download").status_code == 404


def test_a_failed_export_says_why_and_leaves_no_file(run, bundle_dir, monkeypatch, viewer):
    def broken(*args: object, **kwargs: object) -> str:
        raise RuntimeError("the report could not be drawn")

    # After every .jsonl file was written into the partial file.
    monkeypatch.setattr(bundles, "report_html", broken)
    export = queued(run)
    assert tasks.export_bundle(export.pk) == "failed"
    export.refresh_from_db()
    assert export.state == BundleState.FAILED and export.finished_at is not None
    assert export.error == "RuntimeError: the report could not be drawn"
    assert export.rows_written > 0  # it had got that far
    assert files_in(bundle_dir) == []
    page = viewer.get(f"/runs/{run.pk}/").content.decode()
    assert "the report could not be drawn" in page


def test_an_export_failed_as_stalled_while_still_written_ends_with_no_file(
    run, bundle_dir, monkeypatch
):
    real = bundles.report_html
    export = queued(run)

    def slow_then_failed(*args: object, **kwargs: object) -> str:
        # Another worker's sweep, on its own connection, found it stalled
        # meanwhile (the export reads in a read-only snapshot).
        stalled_at = timezone.now() + BUNDLE_STALLED_AFTER + dt.timedelta(seconds=1)
        failed: list[bool] = []

        def sweep() -> None:
            try:
                failed.append(BundleExport.objects.get(pk=export.pk).fail_stalled(stalled_at))
            finally:
                connection.close()

        other = threading.Thread(target=sweep)
        other.start()
        other.join()
        assert failed == [True]
        return real(*args, **kwargs)

    monkeypatch.setattr(bundles, "report_html", slow_then_failed)
    assert tasks.export_bundle(export.pk) == "abandoned"
    export.refresh_from_db()
    assert export.state == BundleState.FAILED and "worker stopped" in export.error
    assert files_in(bundle_dir) == []


def test_a_stalled_export_is_failed_and_its_partial_file_removed(run, bundle_dir):
    now = timezone.now()
    stalled = queued(run)
    assert stalled.start(now - BUNDLE_STALLED_AFTER - dt.timedelta(minutes=1))
    bundle_dir.mkdir(parents=True)
    stalled.part_path.write_bytes(b"half a bundle")
    moving = queued(run)
    assert moving.start(now)  # progressed just now: not stalled

    fresh = done(run)
    stalled.refresh_from_db()
    assert stalled.state == BundleState.FAILED and "worker stopped" in stalled.error
    assert not stalled.part_path.exists()
    assert BundleExport.objects.get(pk=moving.pk).state == BundleState.RUNNING
    assert files_in(bundle_dir) == [fresh.file_name]


def test_progress_is_written_at_most_every_half_second_not_once_per_row(run):
    started = timezone.now()
    RunEvent.objects.bulk_create(
        RunEvent(run=run, kind=EventKind.SUBMITTED, message=f"event {i}", created_at=started)
        for i in range(30_000)
    )
    export = queued(run)
    began = time.monotonic()
    with CaptureQueriesContext(connection) as queries:
        assert tasks.export_bundle(export.pk) == "done"
    elapsed = time.monotonic() - began
    updates = [
        q["sql"]
        for q in queries.captured_queries
        if q["sql"].startswith('UPDATE "evidence_bundleexport"')
    ]
    export.refresh_from_db()
    assert export.rows_written == export.rows_total > 30_000
    # start, the first report (with the total), one per half second, the
    # report that reaches the total, finish.
    assert 3 <= len(updates) <= 4 + elapsed / tasks.PROGRESS_SECONDS + 1
    assert len(updates) < export.rows_total / 1000


def test_progress_reported_for_every_row_is_written_twice_a_second_at_most(run):
    export = queued(run)
    assert export.start(timezone.now())
    progress = tasks.Progress(export)
    began = time.monotonic()
    with CaptureQueriesContext(connection) as queries:
        for written in range(1, 20_001):
            progress(written, 20_000)
    elapsed = time.monotonic() - began
    assert 2 <= len(queries) <= 2 + elapsed / tasks.PROGRESS_SECONDS + 1
    export.refresh_from_db()
    assert (export.rows_written, export.rows_total) == (20_000, 20_000)  # the last is written
    # Failed meanwhile (found stalled): the writer is told to stop.
    BundleExport.objects.filter(pk=export.pk).update(state=BundleState.FAILED, error="stalled")
    with pytest.raises(tasks.Abandoned):
        tasks.Progress(export)(1, 20_000)


def test_admin_shows_exports_and_changes_nothing(staff, run):
    export = done(run)
    assert staff.get("/admin/evidence/bundleexport/").status_code == 200
    assert staff.get(f"/admin/evidence/bundleexport/{export.pk}/change/").status_code == 200
    assert staff.get("/admin/evidence/bundleexport/add/").status_code == 403


@pytest.mark.slow
def test_a_real_worker_writes_the_bundle_and_a_redelivered_task_changes_nothing(
    process_env, tmp_path, broker, bundle_dir, run, sent, operator
):
    operator.post(f"/runs/{run.pk}/bundle/")
    export = BundleExport.objects.get()
    assert sent == [(export.pk,)]
    # The task, sent twice: as after a redelivery (acks_late).
    for _ in range(2):
        with tasks.export_bundle.app.connection_for_write() as conn:
            tasks.export_bundle.apply_async((export.pk,), connection=conn)
    env = {**process_env, "RUNDESK_BUNDLE_DIR": str(bundle_dir)}
    worker = Worker(env, tmp_path / "worker.log", beat=False)
    try:
        wait_until(
            lambda: BundleExport.objects.get(pk=export.pk).state == BundleState.DONE,
            60,
            "bundle not written",
            worker,
        )
        wait_until(lambda: not any(broker.iterdir()), 60, "second task not consumed", worker)
        wait_until(lambda: "'already_done'" in worker.output(), 10, "no second task", worker)
    finally:
        worker.stop()
    export.refresh_from_db()
    assert files_in(bundle_dir) == [export.file_name]
    assert bundles.verify(export.path).ok
    download = operator.get(f"/bundles/{export.pk}/download")
    assert b"".join(download.streaming_content) == export.path.read_bytes()
    assert worker.output().count("'done'") == 1

"""The life of a bundle export: an export whose task was lost does not
wait forever, expired files go on beat's schedule, and the CLI never
replaces a file unasked nor leaves a partial one.  Real PostgreSQL."""

from __future__ import annotations

import datetime as dt
import io
import json
import zipfile

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.utils import timezone

from dashboard.celery import app
from evidence import bundles, tasks
from evidence.models import BUNDLE_UNCLAIMED_AFTER, BundleExport, BundleState
from tests import test_bundle_export_flow as flow

pytestmark = pytest.mark.django_db(transaction=True)

# The export flow's fixtures: a finished run, the bundle folder, the tasks sent.
run, bundle_dir, sent = flow.run, flow.bundle_dir, flow.sent


def lost(run) -> BundleExport:
    """An export asked for long ago whose task no worker ever got."""
    export = flow.queued(run)
    asked = timezone.now() - BUNDLE_UNCLAIMED_AFTER - dt.timedelta(minutes=1)
    BundleExport.objects.filter(pk=export.pk).update(created_at=asked)
    export.refresh_from_db()
    return export


def test_an_export_whose_task_was_lost_stops_polling_and_says_so(viewer, run):
    export = lost(run)
    region = flow.htmx(viewer, f"/runs/{run.pk}/bundles/")
    assert region.status_code == 286
    body = region.content.decode()
    assert "hx-trigger" not in body and "its task was probably lost" in body
    waiting = flow.queued(run)  # asked just now: still waited for
    assert flow.htmx(viewer, f"/runs/{run.pk}/bundles/").status_code == 200
    assert BundleExport.objects.get(pk=waiting.pk).state == BundleState.QUEUED
    assert BundleExport.objects.get(pk=export.pk).is_lost(timezone.now())


def test_beat_fails_a_lost_export_and_a_new_one_can_be_asked(operator, run, sent):
    export = lost(run)
    waiting = flow.queued(run)
    assert tasks.sweep_bundles() == 1
    export.refresh_from_db()
    assert export.state == BundleState.FAILED and "task was lost" in export.error
    assert BundleExport.objects.get(pk=waiting.pk).state == BundleState.QUEUED
    # A worker that gets the lost task after all leaves it alone.
    assert tasks.export_bundle(export.pk) == "already_failed"
    assert operator.post(f"/runs/{run.pk}/bundle/").status_code == 302
    again = BundleExport.objects.latest("id")
    assert again.state == BundleState.QUEUED and sent[-1] == (again.pk,)
    assert tasks.export_bundle(again.pk) == "done"


def test_beat_removes_expired_files_when_no_export_is_asked(run, bundle_dir):
    export = flow.done(run)
    assert export.path.exists()
    BundleExport.objects.filter(pk=export.pk).update(
        expires_at=timezone.now() - dt.timedelta(seconds=1)
    )
    tasks.sweep_bundles()
    export.refresh_from_db()
    assert export.state == BundleState.EXPIRED and not export.path.exists()
    assert flow.files_in(bundle_dir) == []


def test_the_bundle_sweep_is_on_beats_schedule():
    (entry,) = [
        entry
        for entry in settings.CELERY_BEAT_SCHEDULE.values()
        if entry["task"] == "evidence.tasks.sweep_bundles"
    ]
    assert 0 < entry["schedule"] <= 3600
    app.loader.import_default_modules()
    assert "evidence.tasks.sweep_bundles" in app.tasks


def test_the_run_page_shows_who_signed_a_ready_bundle(viewer, run):
    export = flow.done(run)
    page = viewer.get(f"/runs/{run.pk}/").content.decode()
    assert f"seal <code>{export.seal}</code>" in page
    assert "signed by this installation" in page


@pytest.fixture
def out_dir(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    return folder


def test_the_cli_never_replaces_a_file_unless_forced(run, out_dir):
    tmp_path = out_dir
    path = tmp_path / "run.zip"
    path.write_bytes(b"someone's file")
    with pytest.raises(CommandError, match="exists: give --force"):
        call_command("export_bundle", str(run.pk), "-o", str(path), stdout=io.StringIO())
    assert path.read_bytes() == b"someone's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.zip"]
    out = io.StringIO()
    call_command("export_bundle", str(run.pk), "-o", str(path), "--force", "--json", stdout=out)
    said = json.loads(out.getvalue())
    assert said["signer"]["kind"] == "this_installation" and said["path"] == str(path)
    assert bundles.verify(path).ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.zip"]


@pytest.mark.parametrize("force", [False, True])
def test_a_cli_export_that_fails_leaves_no_partial_file(run, out_dir, monkeypatch, force):
    tmp_path = out_dir

    def broken(*args: object, **kwargs: object) -> str:
        raise RuntimeError("the report could not be drawn")

    monkeypatch.setattr(bundles, "report_html", broken)
    path = tmp_path / "run.zip"
    if force:
        path.write_bytes(b"the bundle before")
    with pytest.raises(RuntimeError):
        call_command("export_bundle", str(run.pk), "-o", str(path), *(["--force"] if force else []))
    assert sorted(p.name for p in tmp_path.iterdir()) == (["run.zip"] if force else [])
    if force:
        assert path.read_bytes() == b"the bundle before"


def test_the_cli_writes_a_whole_bundle_under_its_name(run, out_dir):
    tmp_path = out_dir
    path = tmp_path / "run.zip"
    call_command("export_bundle", str(run.pk), "-o", str(path), stdout=io.StringIO())
    with zipfile.ZipFile(path) as bundle:
        assert "manifest.json" in bundle.namelist()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.zip"]

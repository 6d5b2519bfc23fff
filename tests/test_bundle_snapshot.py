"""One snapshot: a run that moves while its bundle is exported gives a
bundle of one moment -- its counts, every file and report.html -- that
refers to no row it does not hold and opens.  The run moves on a real
second connection while the export is under way."""

from __future__ import annotations

import json
import threading
import zipfile

import pytest
from django.db import connection
from django.utils import timezone

from evidence import bundles
from evidence.opening import open_bundle
from runs.models import Action, ActionState, Receipt, RunEvent, digest
from runs.timeline import EventKind
from tests import test_bundles

pytestmark = pytest.mark.django_db(transaction=True)

decided_run = test_bundles.decided_run  # a fixture: a run an operator settled

LATE = "late-step-5521"


def move_on(run_id: int, epoch: int) -> None:
    """What an executor would commit meanwhile, on a connection of its own:
    an action, its receipt and its event."""

    def commit() -> None:
        try:
            action = Action.objects.create(
                run_id=run_id,
                step_key=LATE,
                kind="noop",
                effect_class="read",
                input={},
                input_digest=digest({}),
                state=ActionState.COMPLETED,
                epoch=epoch,
            )
            Receipt.objects.create(
                action=action,
                run_id=run_id,
                step_key=LATE,
                result={"ok": True},
                result_digest=digest({"ok": True}),
                epoch=epoch,
            )
            RunEvent.objects.create(
                run_id=run_id,
                action=action,
                kind=EventKind.ACTION_COMPLETED,
                message=LATE,
                created_at=timezone.now(),
            )
        finally:
            connection.close()

    other = threading.Thread(target=commit)
    other.start()
    other.join()


def test_a_run_that_moves_during_its_export_gives_a_bundle_of_one_moment(decided_run, tmp_path):
    run = decided_run
    counts = {kind.name: kind.rows(run).count() for kind in bundles.KINDS}
    reports: list[tuple[int, int]] = []

    def progress(written: int, total: int) -> None:
        reports.append((written, total))
        if len(reports) == 2:  # run.json and actions.jsonl are written
            move_on(run.pk, run.lease_epoch)

    path = tmp_path / "run.zip"
    bundles.export(run.pk, path, progress=progress)
    assert Action.objects.filter(run=run, step_key=LATE).exists()  # it did move

    with zipfile.ZipFile(path) as bundle:
        files = {name: bundle.read(name) for name in bundle.namelist()}
    manifest = json.loads(files["manifest.json"])
    for name, count in counts.items():
        assert manifest["files"][name]["rows"] == count, name
    assert reports[-1] == (1 + sum(counts.values()),) * 2
    for name, data in files.items():
        assert LATE.encode() not in data, name
    rows = {
        name: [json.loads(line) for line in files[name].decode().splitlines()]
        for name in ("actions.jsonl", "receipts.jsonl", "events.jsonl")
    }
    actions = {action["id"] for action in rows["actions.jsonl"]}
    assert {receipt["action_id"] for receipt in rows["receipts.jsonl"]} <= actions
    assert {event["action_id"] for event in rows["events.jsonl"]} - {None} <= actions
    assert bundles.verify(path).ok
    assert open_bundle(path).first_time


def test_the_export_reads_in_a_read_only_repeatable_read_transaction(decided_run, tmp_path):
    """What the export's connection says of its transaction, asked from
    within it (report.html is drawn last)."""
    seen: list[tuple[str, str]] = []
    real = bundles.report_html

    def drawn(*args, **kwargs):
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT current_setting('transaction_isolation'), "
                "current_setting('transaction_read_only')"
            )
            seen.append(cursor.fetchone())
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bundles, "report_html", drawn)
        bundles.export(decided_run.pk, tmp_path / "run.zip")
    assert seen == [("repeatable read", "on")]


def test_a_progress_callback_that_raises_stops_the_export(decided_run, tmp_path):
    class Stop(Exception):
        pass

    def progress(written: int, total: int) -> None:
        raise Stop

    with pytest.raises(Stop):
        bundles.export(decided_run.pk, tmp_path / "run.zip", progress=progress)

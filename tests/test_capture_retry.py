"""A copy that could not take its lock is tried again later, from capture's
bounded retry queue, by the capture writer: never by the main path, never
holding a lock while it waits.  Its gap is honest at once and says so when
a try saves it; what runs out of tries, does not fit, or is still waiting
when the writer stops stays a gap that says why.  Every lock here is held by
a real concurrent session."""

from __future__ import annotations

import json
import time
import uuid
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from io import StringIO
from pathlib import Path

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection
from django.urls import reverse
from django.utils import timezone

from evidence import bundles, retries
from evidence.capture import Capture, Copy
from evidence.models import CaptureGap, CaptureGapHour, CaptureStats, EvidenceCopy, GapReason
from evidence.opening import open_bundle
from runs.models import Run, RunStatus
from tests.conftest import database_url
from tests.faultruns import DOCS, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def writer() -> Iterator[Capture]:
    capture = Capture(capacity=50)
    yield capture
    capture.stop()


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tries again as soon as the writer looks (it looks at least every
    GAP_INTERVAL), not after seconds."""
    monkeypatch.setattr(retries, "RETRY_FIRST", 0.02)
    monkeypatch.setattr(retries, "RETRY_LONGEST", 0.05)


@contextmanager
def holding_model_record(copy: Copy) -> Iterator[psycopg.Connection]:
    """What a publication's UPDATE of the model record holds, in another
    session's open transaction."""
    with psycopg.connect(database_url()) as other:
        other.execute(
            "SELECT 1 FROM evidence_modelcall WHERE id = %s FOR NO KEY UPDATE",
            [copy.model_call_id],
        )
        yield other
        other.rollback()


def gap_rows(run: Run) -> list[CaptureGap]:
    return list(CaptureGap.objects.filter(run=run).order_by("id"))


def submitted_at_once(writer: Capture, copy: Copy) -> None:
    started = time.perf_counter()
    assert writer.submit(copy)
    assert time.perf_counter() - started < 0.25, "the caller waited on capture"


def test_a_copy_that_could_not_take_its_lock_is_saved_later_and_its_gap_says_so(evidence, writer):
    run, _, copy = evidence
    with holding_model_record(copy):
        submitted_at_once(writer, copy)
        # The gap is written at once, while the lock is still held.
        wait_for(lambda: gap_rows(run), "the gap")
        (gap,) = gap_rows(run)
        assert (gap.reason, gap.count, gap.saved_at) == (GapReason.LOCK_NOT_AVAILABLE, 1, None)
        assert CaptureStats.objects.get(run=run).lost == 1
        assert not EvidenceCopy.objects.filter(run=run).exists()
    # The contention passed: the writer's try again saves it.
    wait_for(lambda: gap_rows(run)[0].saved_at is not None, "the copy saved later")
    (gap,) = gap_rows(run)
    assert gap.attempts >= 1 and gap.reason == GapReason.LOCK_NOT_AVAILABLE
    copied = EvidenceCopy.objects.get(run=run)
    assert (copied.input, copied.output) == ("input", "output")
    assert list(copied.sources.values_list("path", flat=True)) == [DOCS[0]]
    # No longer missing data: not lost for the run, nor for its hour.
    stats = CaptureStats.objects.get(run=run)
    assert (stats.captured, stats.lost) == (1, 0)
    hour = CaptureGapHour.objects.get(reason=GapReason.LOCK_NOT_AVAILABLE)
    assert hour.count == 0
    assert writer.counts["retry_kept"] == writer.counts["saved_later"] == 1
    local = timezone.localtime(gap.saved_at)
    tries = "1 try" if gap.attempts == 1 else f"{gap.attempts} tries"
    assert gap.saved_later == f"saved later (at {local:%H:%M:%S}, after {tries})"


def _capture_waits_on_a_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND application_name LIKE 'rundesk:capture%%' AND datname = current_database())"
        )
        return cursor.fetchone()[0]


def test_tries_again_never_wait_on_the_lock_nor_hold_up_its_holder(evidence, writer, quick):
    run, _, copy = evidence
    with holding_model_record(copy) as holder:
        submitted_at_once(writer, copy)
        wait_for(lambda: gap_rows(run), "the gap")
        # While the writer tries again and again, it never waits on the
        # lock (NOWAIT)...
        deadline = time.monotonic() + 0.75
        while time.monotonic() < deadline:
            assert not _capture_waits_on_a_lock()
        # ... and the holder's next statements (a refresh marking the source
        # each try locks in share mode for a moment) are never held up long.
        deadline = time.monotonic() + 0.75
        slowest = 0.0
        while time.monotonic() < deadline:
            started = time.perf_counter()
            holder.execute("SAVEPOINT mark")
            holder.execute(
                "UPDATE evidence_source SET checked_at = now() WHERE run_id = %s", [run.pk]
            )
            holder.execute("ROLLBACK TO SAVEPOINT mark")
            slowest = max(slowest, time.perf_counter() - started)
        # A try holds the source for one short transaction (its locks
        # NOWAIT or bounded by the capture lock timeout): generous here.
        assert slowest < 1.0
        assert gap_rows(run)[0].saved_at is None
    wait_for(lambda: gap_rows(run)[0].saved_at is not None, "the copy saved later")
    # It was tried while the lock was held, and saved by the try after.
    assert gap_rows(run)[0].attempts >= 2
    assert EvidenceCopy.objects.filter(run=run).count() == 1


def test_out_of_tries_it_stays_a_gap_that_says_why(evidence, writer, quick, settings):
    settings.RUNDESK_CAPTURE_RETRY_TRIES = 3
    run, _, copy = evidence
    with holding_model_record(copy):
        submitted_at_once(writer, copy)
        assert writer.wait_for_retries(10)
    (gap,) = gap_rows(run)
    assert gap.saved_at is None and gap.attempts == 3 and gap.saved_later == ""
    assert "(not saved after 3 tries: could not obtain lock" in gap.detail
    assert writer.counts["retry_exhausted"] == 1 and not writer.counts["saved_later"]
    assert not EvidenceCopy.objects.filter(run=run).exists()
    assert CaptureStats.objects.get(run=run).lost == 1


@pytest.mark.parametrize("bound", ["records", "bytes"])
def test_a_full_retry_queue_leaves_gaps_that_say_so(evidence, writer, settings, bound):
    run, _, copy = evidence
    if bound == "records":
        settings.RUNDESK_CAPTURE_RETRY_QUEUE = 2
    else:  # room for two copies' bytes, not three
        settings.RUNDESK_CAPTURE_RETRY_BYTES = 2 * (copy.size + retries.ENTRY_BYTES)
    with holding_model_record(copy):
        for _ in range(6):
            submitted_at_once(writer, copy)
        assert writer.flush()
        assert len(writer.retries) == 2
        assert writer.retries.held_bytes == 2 * (copy.size + retries.ENTRY_BYTES)
        wait_for(lambda: sum(gap.count for gap in gap_rows(run)) == 6, "the six gaps")
    assert writer.wait_for_retries(10)
    gaps = gap_rows(run)
    saved = [gap for gap in gaps if gap.saved_at]
    left = [gap for gap in gaps if not gap.saved_at]
    assert len(saved) == 2
    assert sum(gap.count for gap in left) == 4
    assert all("(not tried again: the retry queue is full)" in gap.detail for gap in left)
    assert writer.counts["retry_full"] == 4 and writer.counts["saved_later"] == 2
    stats = CaptureStats.objects.get(run=run)
    assert (stats.captured, stats.lost) == (1, 4)


def test_what_waits_to_be_tried_when_the_writer_stops_stays_a_gap(evidence):
    run, _, copy = evidence
    writer = Capture(capacity=5)
    with holding_model_record(copy):
        submitted_at_once(writer, copy)
        wait_for(lambda: gap_rows(run), "the gap")
        writer.stop(grace=0.1)
    (gap,) = gap_rows(run)
    assert gap.saved_at is None
    assert gap.detail.endswith("(not tried again: the process stopped)")
    assert writer.counts["retry_shutdown"] == 1 and len(writer.retries) == 0
    assert not EvidenceCopy.objects.filter(run=run).exists()
    assert CaptureStats.objects.get(run=run).lost == 1


@pytest.fixture
def saved_later(evidence, writer) -> tuple[Run, CaptureGap]:
    run, lease, copy = evidence
    with holding_model_record(copy):
        submitted_at_once(writer, copy)
        wait_for(lambda: gap_rows(run), "the gap")
    wait_for(lambda: gap_rows(run)[0].saved_at is not None, "the copy saved later")
    lease.finish(RunStatus.COMPLETED, "done")
    return Run.objects.get(pk=run.pk), gap_rows(run)[0]


def test_the_pages_say_a_gap_was_saved_later_and_do_not_count_it_lost(saved_later, viewer):
    run, gap = saved_later
    words = gap.saved_later
    assert words.startswith("saved later (at ")
    for page in (reverse("gaps"), reverse("run-detail", args=[run.pk])):
        response = viewer.get(page)
        assert response.status_code == 200
        assert words in response.content.decode()
    run_page = viewer.get(reverse("run-detail", args=[run.pk])).content.decode()
    assert "1 copy saved, 0 not captured (gaps)" in run_page
    # The list of runs with gaps leaves it out.
    assert not Run.objects.with_capture_gaps().filter(pk=run.pk).exists()


def test_the_pages_refuse_anonymous_readers(saved_later, client):
    run, _ = saved_later
    for page in (reverse("gaps"), reverse("run-detail", args=[run.pk])):
        assert client.get(page).status_code == 302


def test_a_bundle_exports_the_save_and_opens_it_as_no_loss(saved_later, tmp_path: Path):
    run, gap = saved_later
    path = tmp_path / f"run-{run.pk}-{uuid.uuid4().hex[:6]}.zip"
    bundles.export(run.pk, path)
    with zipfile.ZipFile(path) as bundle:
        (row,) = [json.loads(line) for line in bundle.read("capture_gaps.jsonl").splitlines()]
    assert row["attempts"] == gap.attempts and row["saved_at"] is not None
    assert "retry_key" not in row  # this installation's own, not a fact of the run
    opened = open_bundle(path).run
    (imported,) = CaptureGap.objects.filter(run=opened)
    assert imported.saved_at == gap.saved_at and imported.retry_key is None
    assert CaptureStats.objects.get(run=opened).lost == 0


def test_reproduce_contention_saves_nine_copies_in_ten_once_the_contention_passes():
    out = StringIO()
    call_command(
        "reproduce_contention", "--policy", "nowait", "--trials", "30", "--json", stdout=out
    )
    report = json.loads(out.getvalue())
    assert report["deadlocks"] == 0 and report["publications_committed"] == 30
    assert report["retries_settled"]
    saved = report["capture_saved"] + report["capture_saved_later"]
    assert saved + report["capture_gaps"] == 30
    assert saved >= 27 and report["capture_saved_percent"] >= 90
    # What it says is what is stored: a copy per save, and the gaps of those
    # saved later say so.
    run = Run.objects.get(pk=report["run_id"])
    assert EvidenceCopy.objects.filter(run=run).count() == saved == report["copies_stored"]
    gaps = CaptureGap.objects.filter(run=run, reason=GapReason.LOCK_NOT_AVAILABLE)
    assert gaps.filter(saved_at__isnull=False).count() == report["capture_saved_later"]
    assert gaps.filter(saved_at__isnull=True).count() == report["capture_gaps"]
    assert CaptureStats.objects.get(run=run).lost == report["capture_gaps"]

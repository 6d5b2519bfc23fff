"""Capture and the timeline under far more than their queues hold, from many
threads at once, while their writers are stuck behind a lock another
session holds: every caller returns at once, no queue grows past its bound,
and what did not fit becomes gaps and counters (`queue_full`), each item
accounted for.  Real sessions hold the locks."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg
import pytest
from django.db import connection
from django.db.models import Sum

from evidence.capture import Capture, Copy
from evidence.models import CaptureGap, CaptureStats, EvidenceCopy, GapReason
from evidence.records import record_model_call, record_source
from runs import submission
from runs.leases import Lease
from runs.models import Run, RunEvent, digest
from runs.timeline import EventKind, Timeline
from tests.conftest import database_url
from tests.faultruns import DOCS, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

THREADS = 16
EACH = 250  # items a thread hands over: 4,000 in all, for queues of 50
CAPACITY = 50
# Generous, for a loaded machine: a put that waited on the stuck writer
# would not return before the lock is released (each test checks that every
# put returned while the writer was still stuck).
SLOWEST_PUT = 1.0
TYPICAL_PUT = 0.001


@contextmanager
def holding(sql: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(database_url()) as other:
        other.execute(sql)
        yield other
        other.rollback()


def waiting(role: str) -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND application_name LIKE %s AND datname = current_database())",
            [f"rundesk:{role}%"],
        )
        return cursor.fetchone()[0]


def flood(put: Callable[[int], object], length: Callable[[], int]) -> tuple[list[float], int]:
    """THREADS threads each call `put` EACH times, at once; returns every
    call's duration and the longest queue seen meanwhile.  Fails when they
    are not all done within 30 s (a put that waited for the stuck writer
    would never be)."""
    durations: list[float] = []
    longest = 0
    start = threading.Barrier(THREADS + 1)
    lock = threading.Lock()

    def hand_over(thread: int) -> None:
        mine = []
        start.wait()
        for i in range(EACH):
            began = time.perf_counter()
            put(thread * EACH + i)
            mine.append(time.perf_counter() - began)
        with lock:
            durations.extend(mine)

    threads = [threading.Thread(target=hand_over, args=(n,), daemon=True) for n in range(THREADS)]
    for thread in threads:
        thread.start()
    start.wait()
    deadline = time.monotonic() + 30
    while any(thread.is_alive() for thread in threads) and time.monotonic() < deadline:
        longest = max(longest, length())
    assert not any(thread.is_alive() for thread in threads), "a put waited for the writer"
    return durations, max(longest, length())


def assert_never_blocked(durations: list[float]) -> None:
    assert len(durations) == THREADS * EACH
    assert max(durations) < SLOWEST_PUT, f"a put took {max(durations):.3f} s"
    assert statistics.median(durations) < TYPICAL_PUT


@pytest.fixture
def copy() -> Copy:
    run = submission.submit(question="q", documents=DOCS[:1])
    lease = Lease.claim(run.pk, "owner")
    assert lease is not None
    read_id = lease.record_boundary(
        step_key="read:0", kind="read_document", effect_class="read", input={"path": DOCS[0]}
    )
    lease.record_receipt(read_id, {"sha256": "ab" * 32, "bytes": 10})
    record_source(run.pk, read_id, DOCS[0], "ab" * 32, 10)
    call_id = lease.record_boundary(
        step_key="summarize:0", kind="model_call", effect_class="read", input={"m": 1}
    )
    lease.record_receipt(call_id, {"text": "summary"})
    model_call = record_model_call(run.pk, call_id, "offline", digest({}), digest({}), [DOCS[0]])
    return Copy(run.pk, model_call, "input", "output")


def test_capture_flooded_from_many_threads_never_blocks_and_counts_every_drop(copy, settings):
    settings.RUNDESK_CAPTURE_LOCK_TIMEOUT_MS = 30_000
    writer = Capture(capacity=CAPACITY)
    accepted: list[bool] = []
    try:
        # Capture's first write waits behind the table lock: nothing drains.
        with holding("LOCK TABLE evidence_source IN ACCESS EXCLUSIVE MODE"):
            assert writer.submit(copy)
            wait_for(lambda: waiting("capture"), "capture stuck behind the lock")
            durations, longest = flood(
                lambda _: accepted.append(writer.submit(copy)), lambda: writer.queued
            )
            # Every put returned while the writer was still stuck.
            assert waiting("capture")
        assert writer.flush(30)
    finally:
        writer.stop()
    assert_never_blocked(durations)
    assert longest <= CAPACITY
    dropped = accepted.count(False)
    assert dropped >= THREADS * EACH - CAPACITY
    # Every drop is a gap and a counter; every other copy was taken.
    gaps = CaptureGap.objects.filter(run_id=copy.run_id, reason=GapReason.QUEUE_FULL)
    assert gaps.aggregate(n=Sum("count"))["n"] == dropped == writer.counts["queue_full"]
    assert EvidenceCopy.objects.filter(run_id=copy.run_id).count() == 1
    assert CaptureStats.objects.get(run_id=copy.run_id).lost == dropped


def test_the_timeline_flooded_from_many_threads_never_blocks_and_counts_every_drop(settings):
    settings.RUNDESK_CAPTURE_LOCK_TIMEOUT_MS = 30_000
    run: Run = submission.submit(question="q", documents=DOCS[:1])
    writer = Timeline(capacity=CAPACITY, batch=10, linger=0.0)
    try:
        with holding("LOCK TABLE runs_runevent IN ACCESS EXCLUSIVE MODE"):
            writer.record(run.pk, EventKind.FAULT_INJECTED, "first")
            wait_for(lambda: waiting("timeline"), "the timeline stuck behind the lock")
            durations, longest = flood(
                lambda n: writer.record(run.pk, EventKind.FAULT_INJECTED, f"event {n}"),
                lambda: writer.queued,
            )
            assert waiting("timeline")
        assert writer.flush(30)
    finally:
        writer.stop()
    assert_never_blocked(durations)
    assert longest <= CAPACITY
    # Every event handed over is in the timeline, or counted in an honest
    # gap that says why.
    events = RunEvent.objects.filter(run=run)
    written = events.filter(kind=EventKind.FAULT_INJECTED).count()
    lost = [event.data for event in events.filter(kind=EventKind.EVENTS_LOST)]
    full = sum(data["count"] for data in lost if data["reason"] == "queue_full")
    assert full >= THREADS * EACH - CAPACITY
    assert written + sum(data["count"] for data in lost) == THREADS * EACH + 1


def test_an_event_handed_to_a_sleeping_writer_wakes_it(monkeypatch):
    """An idle writer sleeps until something is handed over, not until its
    next look at the queue: with that look half a minute away, an event is
    written at once."""
    monkeypatch.setattr("runs.background.GAP_INTERVAL", 30.0)
    run: Run = submission.submit(question="q", documents=DOCS[:1])
    writer = Timeline(capacity=CAPACITY, batch=10, linger=0.0)
    written = RunEvent.objects.filter(run=run, kind=EventKind.FAULT_INJECTED)
    try:
        writer.record(run.pk, EventKind.FAULT_INJECTED, "wakes the writer up")
        wait_for(lambda: written.count() == 1, "the first event written")
        time.sleep(0.5)  # the writer has gone back to sleep
        writer.record(run.pk, EventKind.FAULT_INJECTED, "wakes it again")
        wait_for(lambda: written.count() == 2, "the second event written", timeout=10)
    finally:
        writer.stop()

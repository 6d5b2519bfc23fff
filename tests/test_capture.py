"""Evidence capture cannot block publication: it gives up at once on a lock
it cannot get, leaves an honest gap, and never slows its caller.  Every
lock behaviour here uses real concurrent connections."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
from django.db import DatabaseError, connection

from evidence import capture as capture_module
from evidence.capture import (
    Capture,
    Copy,
    CopyTransaction,
    ModelCallRecord,
    RunCapture,
    SourceCheck,
    SourceRecord,
)
from evidence.capture import capture as process_capture
from evidence.models import CaptureGap, CaptureStats, EvidenceCopy, GapReason, ModelCall, Source
from evidence.records import record_model_call, record_source
from runs import submission
from runs.executor import claim_and_drive
from runs.leases import Lease
from runs.models import AnswerRevision, Run, RunEvent, RunStatus
from runs.timeline import timeline
from tests.conftest import database_url
from tests.faultruns import DOCS, executions, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def writer():
    capture = Capture(capacity=5)
    yield capture
    capture.stop()


@contextmanager
def holding(sql: str, *params: object) -> Iterator[psycopg.Connection]:
    """Another session holds the locks `sql` takes, in an open transaction."""
    with psycopg.connect(database_url()) as other:
        other.execute(sql, params)
        yield other
        other.rollback()


def submit(capture: Capture, copy: Copy) -> bool:
    return capture.submit(copy)


def gaps(run: Run) -> list[tuple[str, int]]:
    return list(CaptureGap.objects.filter(run=run).order_by("id").values_list("reason", "count"))


def test_capture_saves_a_bounded_copy_with_its_sources(evidence, writer):
    run, _, copy = evidence
    assert submit(writer, copy) and writer.flush()
    saved = EvidenceCopy.objects.get(run=run)
    assert (saved.input, saved.output, saved.truncated) == ("input", "output", False)
    assert list(saved.sources.values_list("path", flat=True)) == [DOCS[0]]
    assert CaptureStats.objects.get(run=run).captured == 1


def test_locked_model_record_gives_a_gap_and_a_later_capture_succeeds(evidence, writer):
    run, _, copy = evidence
    # What a publication's UPDATE of the model record holds.
    with holding(
        "SELECT 1 FROM evidence_modelcall WHERE id = %s FOR NO KEY UPDATE", copy.model_call_id
    ):
        assert submit(writer, copy) and writer.flush()
        assert gaps(run) == [(GapReason.LOCK_NOT_AVAILABLE, 1)]
        assert not EvidenceCopy.objects.filter(run=run).exists()
    # The failed capture released what it held; the next independent
    # capture saves, and the kept copy's try again finds it saved: its gap
    # is no longer missing data (tests/test_capture_retry.py says more).
    assert submit(writer, copy) and writer.flush()
    assert EvidenceCopy.objects.filter(run=run).count() == 1
    assert writer.wait_for_retries(10)
    assert CaptureGap.objects.get(run=run).saved_at is not None
    stats = CaptureStats.objects.get(run=run)
    assert (stats.captured, stats.lost) == (1, 0)


def test_what_queues_while_capture_writes_shares_a_commit_and_a_failure_takes_no_other(
    evidence, writer, settings
):
    settings.RUNDESK_CAPTURE_LOCK_TIMEOUT_MS = 30_000
    run, lease, copy = evidence
    reads = []
    for i in range(1, 4):
        read = lease.record_boundary(
            step_key=f"read:{i}", kind="read_document", effect_class="read", input={"i": i}
        )
        lease.record_receipt(read, {"ok": i})
        reads.append(read)

    def source(read: int, path: str) -> SourceRecord:
        return SourceRecord(run.pk, read, path, "cd" * 32, 3)

    # Another session is inserting the first record's row: capture waits
    # for it while the others queue.
    with holding(
        "INSERT INTO evidence_source (run_id, path, read_action_id, digest, bytes, created_at,"
        " changed) VALUES (%s, 'a.md', %s, '', 0, now(), false)",
        run.pk,
        reads[0],
    ):
        assert writer.submit(source(reads[0], "a.md"))
        wait_for(lambda: _waiting("rundesk:capture"))
        # A copy of a model call that does not exist breaks a foreign key.
        queued = [
            source(reads[1], "b.md"),
            source(reads[2], "c.md"),
            Copy(run.pk, 987_654, "i", "o"),
        ]
        assert all(writer.submit(record) for record in [*queued, copy])
    assert writer.flush()
    saved = dict(Source.objects.filter(run=run).values_list("path", "created_at"))
    # One transaction for what queued (now() is its start), after the first.
    assert saved["b.md"] == saved["c.md"] > saved["a.md"]
    assert gaps(run) == [(GapReason.DB_ERROR, 1)]
    assert EvidenceCopy.objects.filter(run=run).count() == 1
    assert CaptureStats.objects.get(run=run).lost == 1


def test_a_stop_within_its_grace_saves_the_batch_the_writer_took(evidence, settings):
    settings.RUNDESK_CAPTURE_LOCK_TIMEOUT_MS = 30_000
    run, lease, _ = evidence
    writer = Capture(capacity=200)
    paths = [f"doc-{i}.md" for i in range(151)]
    reads = []
    for path in paths:
        read = lease.record_boundary(
            step_key=f"read:{path}", kind="read_document", effect_class="read", input={"p": path}
        )
        lease.record_receipt(read, {"ok": path})
        reads.append(read)
    records = [SourceRecord(run.pk, read, path, "ef" * 32, 1) for read, path in zip(reads, paths)]
    with holding(
        "INSERT INTO evidence_source (run_id, path, read_action_id, digest, bytes, created_at,"
        " changed) VALUES (%s, %s, %s, '', 0, now(), false)",
        run.pk,
        paths[0],
        reads[0],
    ):
        assert writer.submit(records[0])
        wait_for(lambda: _waiting("rundesk:capture"))
        assert all(writer.submit(record) for record in records[1:])
        # The stop waits for the queue; once the first is saved, the writer
        # takes the rest in two batches, and finishes the last one it took
        # within the grace.
        stopper = threading.Thread(target=writer.stop, kwargs={"grace": 10})
        stopper.start()
    stopper.join(20)
    assert sorted(
        Source.objects.filter(run=run, path__in=paths).values_list("path", flat=True)
    ) == (sorted(paths))
    assert gaps(run) == []


def test_a_check_of_the_sources_between_other_records_marks_what_changed(evidence, writer):
    # The fixture's source was read with a digest the file does not have.
    run, _, copy = evidence
    assert all(writer.submit(record) for record in (copy, SourceCheck(run.pk), copy))
    assert writer.flush() and timeline.flush()
    source = Source.objects.get(run=run, path=DOCS[0])
    assert source.changed and source.checked_at is not None
    assert list(
        RunEvent.objects.filter(run=run, kind="source_changed").values_list("message", flat=True)
    ) == [f"{DOCS[0]} changed since read"]
    assert EvidenceCopy.objects.filter(run=run).count() == 1 and gaps(run) == []


def test_capture_fails_fast_behind_an_access_exclusive_table_lock(evidence, settings):
    settings.RUNDESK_CAPTURE_LOCK_TIMEOUT_MS = 100
    _, _, copy = evidence
    outcome: list[object] = []

    def save() -> None:
        started = time.monotonic()
        try:
            CopyTransaction(copy).save()
        except DatabaseError as error:
            outcome.append((error, time.monotonic() - started))
        finally:
            connection.close()

    with holding("LOCK TABLE evidence_modelcall IN ACCESS EXCLUSIVE MODE"):
        saver = threading.Thread(target=save)
        saver.start()
        saver.join(10)
    ((error, seconds),) = outcome
    assert error.__cause__.sqlstate == "55P03"  # lock_timeout, not a wait
    assert seconds < 0.1 + 1.0


def test_publication_commits_and_reads_back_while_capture_is_blocked(evidence, settings):
    # Capture waits (here up to 5 s) for a source row another session is
    # updating.  It has taken nothing yet: sources come first.
    settings.RUNDESK_CAPTURE_LOCK_TIMEOUT_MS = 5000
    run, lease, copy = evidence
    blocked = threading.Event()

    def save() -> None:
        try:
            CopyTransaction(copy).save()
        finally:
            blocked.set()
            connection.close()

    with holding(
        "UPDATE evidence_source SET changed = false WHERE id = %s", Source.objects.get(run=run).pk
    ):
        saver = threading.Thread(target=save)
        saver.start()
        wait_for(lambda: _waiting("rundesk:capture"))
        call = ModelCall.objects.get(pk=copy.model_call_id)
        assert lease.publish_revision(
            1, "# Answer", is_final=False, model_call_actions=[call.action_id]
        )
        revision = AnswerRevision.objects.get(run=run, number=1)
        assert (revision.content, revision.model_call_actions) == ("# Answer", [call.action_id])
        assert not blocked.is_set()
    saver.join(10)
    assert EvidenceCopy.objects.filter(run=run).count() == 1


def _waiting(role: str) -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND application_name LIKE %s AND datname = current_database())",
            [f"{role}%"],
        )
        return cursor.fetchone()[0]


def test_full_queue_gives_gaps_and_never_makes_the_caller_wait(evidence, settings):
    settings.RUNDESK_CAPTURE_LOCK_TIMEOUT_MS = 30_000
    run, _, copy = evidence
    small = Capture(capacity=3)
    try:
        # The database is stalled for capture: its first write waits.
        with holding("LOCK TABLE evidence_source IN ACCESS EXCLUSIVE MODE") as stall:
            accepted = [submit(small, copy) for _ in range(10)]
            wait_for(lambda: _waiting("rundesk:capture"))
            # Every submit returned while the database was still stalled.
            assert stall.execute("SELECT 1").fetchone() == (1,)
        assert small.flush()
    finally:
        small.stop()
    lost = sum(count for reason, count in gaps(run) if reason == GapReason.QUEUE_FULL)
    assert accepted.count(False) == lost >= 6
    # The accepted ones were saved, once: a model call has one copy.
    assert EvidenceCopy.objects.filter(run=run).count() == 1
    stats = CaptureStats.objects.get(run=run)
    assert (stats.captured, stats.lost) == (1, lost)


def test_oversized_copy_is_a_gap_and_a_large_one_is_truncated_and_marked(
    evidence, writer, settings
):
    settings.RUNDESK_CAPTURE_MAX_BYTES = 1024
    run, _, copy = evidence
    assert not writer.submit(Copy(run.pk, copy.model_call_id, "x" * 20_000, ""))
    assert writer.submit(Copy(run.pk, copy.model_call_id, "é" * 1000, "ok"))
    assert writer.flush()
    assert gaps(run) == [(GapReason.TOO_LARGE, 1)]
    saved = EvidenceCopy.objects.get(run=run)
    assert saved.truncated and saved.input_bytes == 2000 and len(saved.input.encode()) <= 1024


def test_a_database_error_is_a_gap_not_a_save(evidence, writer):
    run, _, _ = evidence
    assert writer.submit(Copy(run.pk, 987_654, "i", "o"))
    assert writer.flush()
    assert gaps(run) == [(GapReason.DB_ERROR, 1)]
    gap = CaptureGap.objects.get(run=run)
    assert gap.model_call is None and gap.detail.startswith("copy of model call 987654: ")
    assert not EvidenceCopy.objects.exists()


def test_copies_still_queued_at_shutdown_become_gaps(evidence, settings):
    settings.RUNDESK_CAPTURE_LOCK_TIMEOUT_MS = 2000
    run, _, copy = evidence
    writer = Capture(capacity=10)
    with holding("LOCK TABLE evidence_source IN ACCESS EXCLUSIVE MODE"):
        for _ in range(4):
            submit(writer, copy)
        writer.stop(grace=0.2)
    # The copy in flight failed on its lock; the rest were still queued.
    assert GapReason.SHUTDOWN in [reason for reason, _ in gaps(run)]
    assert sum(count for _, count in gaps(run)) == 4
    assert not EvidenceCopy.objects.exists()


def test_a_run_records_its_sources_model_calls_and_copies(journal):
    run = submission.submit(question="Compare", documents=DOCS)
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    assert process_capture.flush()
    assert list(Source.objects.filter(run=run).values_list("path", flat=True)) == DOCS
    calls = ModelCall.objects.filter(run=run).order_by("id")
    assert [c.action.step_key for c in calls] == [
        "summarize:0",
        "summarize:1",
        "summarize:2",
        "compose",
    ]
    # Each revision names the calls it used, on its own row.
    draft, final = AnswerRevision.objects.filter(run=run).order_by("number")
    assert draft.model_call_actions == [calls[0].action_id]
    assert final.model_call_actions == [c.action_id for c in calls]
    assert [sorted(c.sources.values_list("path", flat=True)) for c in calls][-1] == sorted(DOCS)
    # No publication locks a model record any more: every call is captured.
    stats = CaptureStats.objects.get(run=run)
    assert (stats.captured, stats.lost) == (4, 0)
    assert EvidenceCopy.objects.filter(run=run).count() == 4
    assert not CaptureGap.objects.filter(run=run).exists()


def test_a_lost_database_connection_is_a_gap_and_the_writer_reconnects(evidence, writer):
    run, _, copy = evidence
    process_capture.stop()  # only this writer's connection is cut below
    assert submit(writer, copy) and writer.flush()
    with psycopg.connect(database_url(), autocommit=True) as other:
        other.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name = 'rundesk:capture' AND datname = current_database()"
        )
    assert submit(writer, copy) and writer.flush()  # the cut connection: a gap
    assert submit(writer, copy) and writer.flush()  # reconnected: no second gap
    assert gaps(run) == [(GapReason.DB_ERROR, 1)]
    assert EvidenceCopy.objects.filter(run=run).count() == 1  # one copy per model call


def test_a_run_that_then_waits_for_an_operator_keeps_the_copy_it_made(journal, settings):
    settings.RUNDESK_SETTLE_SECONDS = 1
    # The draft's publication is still in flight when the runtime stops
    # asking: the run waits for an operator.  Its model call's evidence was
    # handed to capture when the call completed, so it is saved anyway.
    fault = {"point": "drop_connection_at_commit", "write": "publication", "action": 1}
    run = submission.submit(
        question="q", documents=DOCS[:1], faults=[{**fault, "outcome": "late", "stall_ms": 3000}]
    )
    assert claim_and_drive(run.pk) == RunStatus.NEEDS_OPERATOR
    assert process_capture.flush()
    assert EvidenceCopy.objects.filter(run=run).count() == 1
    assert not CaptureGap.objects.filter(run=run).exists()


def test_evidence_tables_locked_for_the_whole_run_never_hold_the_run(journal, settings):
    # Another session holds the source table for the whole run: capture's
    # writes that need it give up after the lock timeout, the run does not
    # wait.  The two sources and the three copies (they lock their sources)
    # are gaps; the model records, which only link to sources, stand.  (Not
    # tried again here: tests/test_capture_retry.py is about that.)
    settings.RUNDESK_CAPTURE_RETRY_QUEUE = 0
    run = submission.submit(question="q", documents=DOCS[:2])
    with holding("LOCK TABLE evidence_source IN ACCESS EXCLUSIVE MODE"):
        assert claim_and_drive(run.pk) == RunStatus.COMPLETED
        assert process_capture.flush()
    assert not Source.objects.filter(run=run).exists()
    assert ModelCall.objects.filter(run=run).count() == 3
    stats = CaptureStats.objects.get(run=run)
    assert (stats.captured, stats.lost) == (0, 5)
    details = list(CaptureGap.objects.filter(run=run).values_list("detail", flat=True))
    assert sum(detail.startswith("source ") for detail in details) == 2
    assert executions(journal, run, "read:0") == 1


def test_stop_never_waits_on_a_full_queue(evidence, settings):
    settings.RUNDESK_CAPTURE_LOCK_TIMEOUT_MS = 30_000
    run, _, copy = evidence
    writer = Capture(capacity=2)
    with holding("LOCK TABLE evidence_source IN ACCESS EXCLUSIVE MODE"):
        assert submit(writer, copy)  # stuck in its lock wait
        wait_for(lambda: _waiting("rundesk:capture"))
        assert submit(writer, copy) and submit(writer, copy)  # the queue is full
        started = time.monotonic()
        stopper = threading.Thread(target=writer.stop, kwargs={"grace": 0.1})
        stopper.start()
        stopper.join(15)
        assert not stopper.is_alive(), "stop() waited on the full queue"
        assert time.monotonic() - started < 10
    # Once its lock is granted, the old writer saves the copy it was on,
    # stops, and leaves the queued ones as shutdown gaps.
    wait_for(lambda: gaps(run) == [(GapReason.SHUTDOWN, 2)])
    assert EvidenceCopy.objects.filter(run=run).count() == 1


def test_gaps_waiting_to_be_written_are_bounded_and_what_is_dropped_is_counted(
    evidence, monkeypatch
):
    run, _, _ = evidence
    monkeypatch.setattr(capture_module, "PENDING_GAP_KEYS", 2)
    writer = Capture(capacity=5)
    try:
        with holding("LOCK TABLE evidence_capturegap IN ACCESS EXCLUSIVE MODE"):
            for detail in ("a", "b", "c"):  # two kept with details, one collapsed
                writer.lose(run.pk, None, GapReason.DB_ERROR, detail)
            writer.lose(run.pk, None, GapReason.QUEUE_FULL, "d")  # collapsed: 4 keys
            writer.lose(run.pk, None, GapReason.SHUTDOWN, "e")  # no room: dropped
            writer.flush()  # the writer tries, and keeps them counted
            assert writer.dropped == 1
        assert writer.flush()
    finally:
        writer.stop()
    assert sorted(gaps(run)) == [
        ("db_error", 1),
        ("db_error", 1),
        ("db_error", 1),
        ("queue_full", 1),
    ]
    assert CaptureStats.objects.get(run=run).lost == 4
    assert CaptureGap.objects.filter(run=run, detail=capture_module.DETAIL_DROPPED).count() == 2


def test_evidence_statements_are_planned_once_per_connection(evidence):
    """A record's statements are prepared: a writer that saves many
    records plans each statement once, not once a record."""
    run, lease, copy = evidence
    for index in (1, 2):
        read_id = lease.record_boundary(
            step_key=f"read:{index}",
            kind="read_document",
            effect_class="read",
            input={"path": DOCS[index]},
        )
        record_source(run.pk, read_id, DOCS[index], "cd" * 32, 3)
        CopyTransaction(copy).save()  # the second time, the copy is there already
    with connection.cursor() as cursor:
        plans = """SELECT generic_plans + custom_plans FROM pg_prepared_statements
                   WHERE statement LIKE %s"""
        # One statement each, executed once per record (the evidence
        # fixture recorded the first source).
        cursor.execute(plans, ["%INSERT INTO evidence_source%"])
        assert cursor.fetchall() == [(3,)]
        cursor.execute(plans, ["%INSERT INTO evidence_evidencecopy %"])
        assert cursor.fetchall() == [(2,)]
    assert Source.objects.filter(run=run).count() == 3
    assert EvidenceCopy.objects.filter(run=run).count() == 1


def _records(
    lease: Lease, run: Run, first: int, count: int
) -> list[SourceRecord | ModelCallRecord]:
    """A document read and its model call, for `count` documents from
    `first`: what a live run hands to capture, in its order."""
    records: list[SourceRecord | ModelCallRecord] = []
    for index in range(first, first + count):
        path = DOCS[index % len(DOCS)] if index < len(DOCS) else f"doc-{index}.md"
        read = lease.record_boundary(
            step_key=f"read:{index}", kind="read_document", effect_class="read", input={"i": index}
        )
        lease.record_receipt(read, {"ok": index})
        call = lease.record_boundary(
            step_key=f"summarize:{index}",
            kind="model_call",
            effect_class="read",
            input={"messages": [index]},
        )
        lease.record_receipt(call, {"text": f"summary {index}"})
        records.append(SourceRecord(run.pk, read, path, "cd" * 32, 3))
        records.append(
            ModelCallRecord.of(
                run.pk, call, {"messages": [index]}, {"text": f"summary {index}"}, [path]
            )
        )
    return records


def _transactions(run: Run) -> int:
    """How many transactions wrote the run's evidence rows."""
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT count(DISTINCT x) FROM (
                   SELECT xmin::text AS x FROM evidence_source WHERE run_id = %(run)s
                   UNION ALL SELECT xmin::text FROM evidence_modelcall WHERE run_id = %(run)s
                   UNION ALL SELECT xmin::text FROM evidence_evidencecopy WHERE run_id = %(run)s
               ) written""",
            {"run": run.pk},
        )
        return cursor.fetchone()[0]


@pytest.fixture
def gathering():
    """A writer that waits for a flush to take what was handed to it: one
    batch."""
    capture = Capture(capacity=50, linger=30)
    yield capture
    capture.stop()


def write(capture: Capture, records: list[SourceRecord | ModelCallRecord]) -> None:
    for record in records:
        assert capture.submit(record)
    assert capture.flush()


def test_a_batch_of_new_records_is_saved_in_one_transaction_with_its_links(gathering):
    run = submission.submit(question="q", documents=DOCS[:1])
    lease = Lease.claim(run.pk, "owner")
    records = _records(lease, run, 0, 3)
    write(gathering, records)
    assert _transactions(run) == 1
    assert Source.objects.filter(run=run).count() == 3
    for call in ModelCall.objects.filter(run=run):
        copy = EvidenceCopy.objects.get(model_call=call)
        path = call.sources.get().path
        assert list(copy.sources.values_list("path", flat=True)) == [path]
        assert copy.output.startswith("summary")
    assert CaptureStats.objects.get(run=run).captured == 3
    # Handed over again (a resumed run): nothing is saved twice.
    write(gathering, records)
    assert EvidenceCopy.objects.filter(run=run).count() == 3
    assert CaptureStats.objects.get(run=run).captured == 3
    assert not CaptureGap.objects.filter(run=run).exists()


def test_a_model_call_whose_record_exists_takes_its_locks_on_its_own(gathering):
    """A resumed run's model call whose model record an owner that died
    had saved, without its copy: the batch leaves it to the path that takes
    its locks in order (so a publication's lock on it is a gap, as ever)."""
    run = submission.submit(question="q", documents=DOCS[:1])
    lease = Lease.claim(run.pk, "owner")
    source, call = _records(lease, run, 0, 1)
    record_source(run.pk, source.action_id, source.path, source.sha256, source.bytes)
    model_call = record_model_call(
        run.pk, call.action_id, "", call.input_digest, call.output_digest, list(call.paths)
    )
    with holding("SELECT 1 FROM evidence_modelcall WHERE id = %s FOR NO KEY UPDATE", model_call):
        write(gathering, [source, call])
        assert not EvidenceCopy.objects.filter(run=run).exists()
    assert gaps(run) == [(GapReason.LOCK_NOT_AVAILABLE, 1)]
    write(gathering, [call])
    assert EvidenceCopy.objects.get(run=run).model_call_id == model_call


def test_a_batch_that_cannot_take_a_lock_goes_one_by_one_and_loses_nothing_else(
    gathering, settings
):
    """The batch's transaction waits out the lock timeout and rolls back;
    its records are then saved one by one, as capture saved each before:
    what the lock holds up fails alone (here the link of a model call to
    the locked document: its model record and copy stand without it)."""
    settings.RUNDESK_CAPTURE_LOCK_TIMEOUT_MS = 200
    run = submission.submit(question="q", documents=DOCS[:1])
    lease = Lease.claim(run.pk, "owner")
    first = _records(lease, run, 0, 1)
    write(gathering, first)
    later = _records(lease, run, 1, 2)
    compare = lease.record_boundary(
        step_key="compare", kind="model_call", effect_class="read", input={"c": 1}
    )
    lease.record_receipt(compare, {"text": "compared"})
    uses_first = ModelCallRecord.of(run.pk, compare, {"c": 1}, {"text": "compared"}, [DOCS[0]])
    # A stranger about to delete the first document's row: linking a new
    # model call to it waits for its lock.
    locked = Source.objects.get(run=run, path=DOCS[0]).pk
    with holding("SELECT 1 FROM evidence_source WHERE id = %s FOR UPDATE", locked):
        write(gathering, [*later, uses_first])
    assert _transactions(run) > 2  # one by one
    copies = EvidenceCopy.objects.filter(run=run)
    assert copies.count() == 4
    assert not copies.get(model_call__action_id=compare).sources.exists()
    for record in later[1::2]:
        copy = copies.get(model_call__action_id=record.action_id)
        assert list(copy.sources.values_list("path", flat=True)) == list(record.paths)
    assert Source.objects.filter(run=run).count() == 3
    assert CaptureStats.objects.get(run=run).captured == 4


def test_a_gap_of_a_run_that_no_longer_exists_holds_up_no_others(evidence, writer):
    """Gaps waiting to be written are written in one statement: one of a
    run purged meanwhile is dropped, not a foreign-key error that would
    keep every other run's gaps from being written, for good."""
    run, _, _ = evidence
    writer.lose(run.pk + 1_000_000, None, GapReason.QUEUE_FULL, "a purged run's")
    writer.lose(run.pk, None, GapReason.QUEUE_FULL, "this run's")
    assert writer.flush()
    assert gaps(run) == [(GapReason.QUEUE_FULL, 1)]
    assert not CaptureGap.objects.exclude(run=run).exists()


@pytest.mark.parametrize(
    "input, result",
    [
        ({"path": "a.md"}, {"refused": "outside the corpus"}),
        ({"file": "a.md"}, {"sha256": "ab" * 32, "bytes": 10}),
    ],
)
def test_a_read_that_leaves_nothing_to_keep_makes_no_copy_and_raises_nothing(input, result):
    # Made where the tool's answer is settled, before its receipt: it must
    # not raise there (another agent's tool may be named read_document).
    assert RunCapture(1).copy_of(1, "read_document", input, result, []) is None


def test_a_read_leaves_its_source_as_read():
    copy = RunCapture(7).copy_of(
        3, "read_document", {"path": "a.md"}, {"sha256": "ab" * 32, "bytes": 10}, []
    )
    assert copy == SourceRecord(7, 3, "a.md", "ab" * 32, 10)

"""Capture: the optional copies of everything a run did, written off the
main path.  `RunCapture` is what a run's Dispatcher hands it, for every
agent alike.

Capture is observation.  The run hands each record (a source it read, a
model call with a bounded copy of it, a check of its sources on resume) to
a bounded in-process queue and never waits: no statement of the main path
reads, writes or locks an evidence table.  A background writer
(runs/background.py) drains the queue on its own connection
(application_name `rundesk:capture`): what was queued while it wrote the
last records and what came in the next LINGER seconds.  What a live run
hands over (documents read, model calls whose model record is new) is
saved in one short transaction of two statements for the whole batch
(`Capture._save_new`).  What that does not save (a resumed run's model
call, whose model record exists; or everything, when the batch's
transaction failed) is saved the careful way: a run's records in one
short transaction (new records join it for half the lock timeout at
most), each record in savepoints of its own.  Statements are prepared
once per connection, and every lock is bounded by `SET LOCAL
lock_timeout`.  A copy takes its locks in one fixed order: the copy's
sources, then its model record, the second with NOWAIT under the `nowait`
policy (the one production uses; NOWAIT alone would still wait behind a
table lock).  A lock that is not available at once rolls the record back
and ends its transaction there, which releases what it held, and leaves a
CaptureGap at once.  The record is kept in a bounded retry queue
(evidence/retries.py) and tried again later, with backoff, by this writer
between its batches, in a short transaction of its own: nothing waits
holding a lock, and the main path never waits on a try.  A try that saves
it marks its gap saved (`saved_at`, `attempts`) and takes it out of the
run's lost count; one that runs out of tries, or does not fit the retry
queue, or is still waiting when the process stops, stays a gap whose
detail says why (and `counts` says how many).  A full queue, an oversized
copy, a database error and shutdown each leave a gap with their reason.  A
gap is never reported as a save.

The `wait` policy (wait for the model-record lock, as capture did at the
incident) is kept only so `reproduce_contention` can show what it did.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import DatabaseError, OperationalError, connection, transaction

from evidence.models import GapReason
from evidence.records import bounded, record_model_call, record_new, record_source
from evidence.retries import Retries, Retry
from evidence.sources import SourceRefresh
from runs.background import GAP_INTERVAL as GAP_INTERVAL  # how soon a gap is written
from runs.background import SHUTDOWN, BackgroundWriter
from runs.models import digest
from runs.sql import (
    application_name,
    bounded_lock_waits,
    commit_asynchronously,
    connection_lost,
    lock_refused,
    server_cursor,
)
from runs.timeline import EventKind, timeline

logger = logging.getLogger(__name__)

POLICIES = ("nowait", "wait")
# Gaps waiting to be written (the database is down, or their tables are
# locked) are counted per (run, model call, reason, detail) up to this many
# keys, then per (run, reason); what does not fit either is only counted.
PENDING_GAP_KEYS = 10_000
# Records the writer takes at a time (and tries again at a time): what was
# queued while it wrote the last ones, and what comes in LINGER seconds
# (unless a run driven on its own ended, or someone waits for them: a
# flush).  The batch's new records share a transaction of two statements
# (Capture._save_new): per record, the writer then costs a small share of
# a step, and the commits a shared server runs out of first are one a
# batch.
BATCH = 500
LINGER = 0.2
# A transaction of them takes no new record once this share of the lock
# timeout is gone: another writer waiting for its rows (a run handed over,
# its evidence handed again) is answered before it gives up.
TRANSACTION_SHARE = 0.5
DETAIL_DROPPED = "(detail dropped: too many gaps waiting to be written)"


# -- what a run hands to capture: each record knows how to save itself ------------


@dataclass(frozen=True)
class Copy:
    """A copy of a model call; its sources are the model record's."""

    run_id: int
    model_call_id: int | None
    input: str
    output: str

    @property
    def size(self) -> int:
        return len(self.input.encode()) + len(self.output.encode())

    alone = False

    def describe(self) -> str:
        return f"copy of model call {self.model_call_id}"

    def save(self) -> None:
        CopyTransaction(self).save()


@dataclass(frozen=True)
class SourceRecord:
    """A document a run read (a read_document result), as it was when read."""

    run_id: int
    action_id: int
    path: str
    sha256: str
    bytes: int

    model_call_id = None
    size = 0
    alone = False

    def describe(self) -> str:
        return f"source {self.path}"

    def row(self) -> dict[str, Any]:
        """As records.record_new takes it."""
        return {
            "run": self.run_id,
            "path": self.path,
            "action": self.action_id,
            "digest": self.sha256,
            "bytes": self.bytes,
        }

    def save(self) -> None:
        record_source(self.run_id, self.action_id, self.path, self.sha256, self.bytes)


@dataclass(frozen=True)
class ModelCallRecord:
    """A model-call action's model record, linked to the sources it was
    given, and a bounded copy of its input and output."""

    run_id: int
    action_id: int
    provider: str
    input_digest: str
    output_digest: str
    paths: tuple[str, ...]
    input: str
    output: str

    model_call_id = None
    alone = False

    @classmethod
    def of(
        cls,
        run_id: int,
        action_id: int,
        input: dict[str, Any],
        output: dict[str, Any],
        paths: list[str],
        output_digest: str = "",
    ) -> ModelCallRecord:
        return cls(
            run_id=run_id,
            action_id=action_id,
            provider=str(output.get("provider", "")),
            input_digest=digest(input),
            output_digest=output_digest or digest(output),
            paths=tuple(paths),
            input=json.dumps(input.get("messages", input), ensure_ascii=False),
            output=str(output.get("text", "")),
        )

    @property
    def size(self) -> int:
        return len(self.input.encode()) + len(self.output.encode())

    def describe(self) -> str:
        return f"model call of action {self.action_id}"

    def row(self) -> dict[str, Any]:
        """As records.record_new takes it: the copy bounded as
        CopyTransaction bounds it."""
        return {
            "run": self.run_id,
            "action": self.action_id,
            "provider": self.provider,
            "input_digest": self.input_digest,
            "output_digest": self.output_digest,
            "paths": self.paths,
            **bounded_copy(self.input, self.output),
        }

    def save(self) -> None:
        model_call_id = record_model_call(
            self.run_id,
            self.action_id,
            self.provider,
            self.input_digest,
            self.output_digest,
            list(self.paths),
        )
        Copy(self.run_id, model_call_id, self.input, self.output).save()


@dataclass(frozen=True)
class SourceCheck:
    """Are a resumed run's documents still what it read?  The timeline says
    which changed (evidence/sources.py).  Saved alone, in a transaction of
    its own: it reads the files before it, and the timeline hears of a
    change only once it is committed."""

    run_id: int

    model_call_id = None
    size = 0
    alone = True

    def describe(self) -> str:
        return "check of the sources against the corpus"

    def save(self) -> None:
        for path in SourceRefresh(self.run_id).run():
            timeline.record(self.run_id, EventKind.SOURCE_CHANGED, f"{path} changed since read")


Record = Copy | SourceRecord | ModelCallRecord | SourceCheck
# run, model call, reason, detail, and the key of a gap whose record is
# kept to be tried again (evidence/retries.py), None for any other.
GapKey = tuple[int, int | None, str, str, uuid.UUID | None]


def _cap(text: str, limit: int) -> tuple[str, int, bool]:
    raw = text.encode()
    if len(raw) <= limit:
        return text, len(raw), False
    return raw[:limit].decode(errors="ignore"), len(raw), True


def bounded_copy(input: str, output: str) -> dict[str, Any]:
    """A copy's columns: its input and output cut to
    RUNDESK_CAPTURE_MAX_BYTES each, their sizes before, and whether either
    was cut."""
    limit = settings.RUNDESK_CAPTURE_MAX_BYTES
    input, input_bytes, cut_input = _cap(input, limit)
    output, output_bytes, cut_output = _cap(output, limit)
    return {
        "input": input,
        "output": output,
        "input_bytes": input_bytes,
        "output_bytes": output_bytes,
        "truncated": cut_input or cut_output,
    }


# -- one copy, one transaction: the storage entry point ---------------------------


class CopyTransaction:
    """The statements that save one copy, in their fixed order.  `save()`
    runs them in one transaction; `reproduce_contention` runs the same
    statements one at a time, to arrange contention on purpose."""

    def __init__(self, copy: Copy, policy: str = "nowait") -> None:
        if copy.model_call_id is None:
            raise ValueError("a copy needs its model record")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}")
        self.copy, self.policy = copy, policy

    def begin(self, cursor: Any) -> None:
        commit_asynchronously(
            cursor,
            application_name=application_name(Capture.role, self.copy.run_id),
            **(bounded_lock_waits() if self.policy == "nowait" else {}),
        )

    def lock_sources(self, cursor: Any) -> None:
        cursor.execute(
            """SELECT id FROM evidence_source WHERE id IN (
                   SELECT source_id FROM evidence_modelcall_sources WHERE modelcall_id = %s)
               ORDER BY id FOR SHARE""",
            [self.copy.model_call_id],
            prepare=True,
        )

    def lock_model_record(self, cursor: Any) -> None:
        nowait = " NOWAIT" if self.policy == "nowait" else ""
        cursor.execute(
            f"SELECT id FROM evidence_modelcall WHERE id = %s FOR SHARE{nowait}",
            [self.copy.model_call_id],
            prepare=True,
        )

    def insert(self, cursor: Any) -> None:
        # A model call has one copy: handed over again (a resumed run
        # re-submits what an owner that died may not have saved), it is
        # saved only if it is not there yet, and counted only then.
        cursor.execute(
            """WITH copy AS (
                   INSERT INTO evidence_evidencecopy (run_id, model_call_id, input, output,
                       input_bytes, output_bytes, truncated, created_at)
                   SELECT %(run)s, %(call)s, %(input)s, %(output)s, %(input_bytes)s,
                       %(output_bytes)s, %(truncated)s, now()
                   WHERE NOT EXISTS (
                       SELECT 1 FROM evidence_evidencecopy WHERE model_call_id = %(call)s)
                   RETURNING id),
               linked AS (
                   INSERT INTO evidence_evidencecopy_sources (evidencecopy_id, source_id)
                   SELECT copy.id, link.source_id FROM copy, evidence_modelcall_sources link
                   WHERE link.modelcall_id = %(call)s)
               INSERT INTO evidence_capturestats (run_id, captured, lost)
               SELECT %(run)s, count(*), 0 FROM copy
               ON CONFLICT (run_id) DO UPDATE
                   SET captured = evidence_capturestats.captured + EXCLUDED.captured""",
            {
                "run": self.copy.run_id,
                "call": self.copy.model_call_id,
                **bounded_copy(self.copy.input, self.copy.output),
            },
            prepare=True,
        )

    def save(self) -> None:
        with transaction.atomic(), server_cursor() as cursor:
            self.begin(cursor)
            self.lock_sources(cursor)
            self.lock_model_record(cursor)
            self.insert(cursor)


def gap_reason(error: BaseException) -> GapReason:
    """Why a copy that raised `error` was not saved."""
    if lock_refused(error):
        return GapReason.LOCK_NOT_AVAILABLE
    return GapReason.DB_ERROR


def record_gaps(gaps: Mapping[GapKey | tuple[int, int | None, str, str], int]) -> None:
    """Writes gaps (run, model call, reason, detail, and the retry key of a
    record kept to be tried again, if any) -> count, and the runs' lost
    counters, in one statement, bounded by the capture lock timeout like
    every capture write.  A model call that does not exist is named in the
    detail only (each record's detail names what was lost); a run that no
    longer exists (purged) has no gaps to keep, and its own are dropped
    rather than refusing everyone's."""
    rows = [(*key[:4], key[4] if len(key) > 4 else None, count) for key, count in gaps.items()]
    with bounded() as cursor:
        cursor.execute(
            """WITH gap AS (
                   INSERT INTO evidence_capturegap (run_id, model_call_id, reason, detail,
                       retry_key, count, created_at)
                   SELECT g.run, m.id, g.reason, g.detail, g.retry_key, g.count, now()
                   FROM unnest(%s::bigint[], %s::bigint[], %s::text[], %s::text[], %s::uuid[],
                           %s::int[])
                       AS g(run, call, reason, detail, retry_key, count)
                   JOIN runs_run r ON r.id = g.run
                   LEFT JOIN evidence_modelcall m ON m.id = g.call
                   RETURNING run_id, reason, count, created_at),
               hourly AS (
                   INSERT INTO evidence_capturegaphour (hour, reason, count)
                   SELECT date_trunc('hour', created_at), reason, sum(count) FROM gap
                   GROUP BY 1, 2
                   ON CONFLICT (hour, reason) DO UPDATE
                       SET count = evidence_capturegaphour.count + EXCLUDED.count)
               INSERT INTO evidence_capturestats (run_id, captured, lost)
               SELECT run_id, 0, sum(count) FROM gap GROUP BY run_id
               ON CONFLICT (run_id) DO UPDATE
                   SET lost = evidence_capturestats.lost + EXCLUDED.lost""",
            [list(column) for column in zip(*rows, strict=True)],
            prepare=True,
        )


def mark_saved(key: uuid.UUID, attempts: int) -> None:
    """The record of gap `key` was saved by a try again: the gap says so,
    and no longer counts as lost, for its run nor its hour.  In the try's
    transaction, so the two stand or fall together."""
    with bounded() as cursor:
        cursor.execute(
            """WITH gap AS (
                   UPDATE evidence_capturegap SET saved_at = now(), attempts = %s
                   WHERE retry_key = %s AND saved_at IS NULL
                   RETURNING run_id, reason, count, created_at),
               hourly AS (
                   UPDATE evidence_capturegaphour h SET count = greatest(h.count - gap.count, 0)
                   FROM gap
                   WHERE h.hour = date_trunc('hour', gap.created_at) AND h.reason = gap.reason)
               UPDATE evidence_capturestats s SET lost = greatest(s.lost - gap.count, 0)
               FROM gap WHERE s.run_id = gap.run_id""",
            [attempts, key],
            prepare=True,
        )


def note_given_up(ended: list[tuple[uuid.UUID, int, str]]) -> None:
    """Gaps (key, tries, why) whose records will not be tried again: each
    says why, after its detail."""
    with bounded() as cursor:
        cursor.execute(
            """UPDATE evidence_capturegap g
               SET attempts = e.attempts, detail = g.detail || ' (' || e.note || ')'
               FROM unnest(%s::uuid[], %s::int[], %s::text[]) AS e(key, attempts, note)
               WHERE g.retry_key = e.key AND g.saved_at IS NULL""",
            [list(column) for column in zip(*ended, strict=True)],
            prepare=True,
        )


# -- the queue and its writer ------------------------------------------------------


class Capture(BackgroundWriter[Record, GapKey]):
    """Records saved off the main path (runs/background.py): what is queued
    when the writer gets to it (up to BATCH records), a run's records in one
    transaction, each record in savepoints of its own (its statements'
    atomic blocks nest), so a record that fails takes no other with it.
    Lost records are counted per (run, model call, reason, detail), bounded
    (PENDING_GAP_KEYS), and become CaptureGaps; one that could not take its
    lock is kept to be tried again (the module docstring says how)."""

    role = "capture"

    def __init__(self, capacity: int | None = None, linger: float = LINGER) -> None:
        super().__init__(capacity or settings.RUNDESK_CAPTURE_QUEUE, batch=BATCH, linger=linger)
        # Gaps that fitted nowhere while they could not be written (and how
        # many of those the log has told of).
        self.dropped = 0
        self._dropped_told = 0
        self.retries = Retries()
        # Gaps of records that will not be tried again, whose rows are
        # written: (key, tries, why), said on their rows with the next gaps.
        self._given_up: list[tuple[uuid.UUID, int, str]] = []
        # What became of the records capture could not save at once, by
        # what: queue_full, too_large, retry_kept, saved_later,
        # retry_exhausted, retry_full, retry_shutdown.
        self.counts: Counter[str] = Counter()

    def submit(self, record: Record) -> bool:
        """Hands a record to the writer.  Never blocks, never raises; False
        when it became a gap instead (queue full, too large)."""
        if record.size > settings.RUNDESK_CAPTURE_MAX_BYTES * 16:
            self._ensure_thread()
            self._lose([record], GapReason.TOO_LARGE, f"{record.size} bytes")
            self._count(GapReason.TOO_LARGE.value)
            return False
        if self._put(record):
            return True
        self._count(GapReason.QUEUE_FULL.value)
        return False

    def retry_later(self, record: Record, detail: str) -> None:
        """A record that could not take its lock: its gap now, and, when it
        fits the retry queue, a try again later by the writer (the caller
        never waits for it).  Never blocks, never raises."""
        self._ensure_thread()
        reason = GapReason.LOCK_NOT_AVAILABLE
        if record.alone:  # a check of the sources: the next resume makes another
            self._lose([record], reason, detail)
            return
        key = uuid.uuid4()
        gap = (*self._lost_key(record, reason, detail)[:4], key)
        self._count_lost(Counter({gap: 1}))
        retry = Retry(record, gap, key)
        if self.retries.keep(retry, time.monotonic()):
            self._count("retry_kept")
        else:
            self._give_up(retry, "not tried again: the retry queue is full", "retry_full")

    def wait_for_retries(self, timeout: float) -> bool:
        """Waits until what was submitted so far is saved or a gap, and no
        record is kept to be tried again (each saved or given up, and its
        gap said so); False after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        if not self.flush(timeout):
            return False
        while len(self.retries) and time.monotonic() < deadline:
            time.sleep(0.01)
        return not len(self.retries) and self.flush(max(deadline - time.monotonic(), 0.1))

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def flush(self, timeout: float = 10.0) -> bool:
        """Waits until everything submitted so far is saved or a gap."""
        return super().flush(timeout)

    def lose(self, run_id: int, model_call_id: int | None, reason: str, detail: str) -> None:
        """Counts a record that will not be made; the writer records the gap
        within GAP_INTERVAL, busy or idle.  Never blocks, never raises."""
        self._ensure_thread()
        self._count_lost(Counter({(run_id, model_call_id, reason, detail[:500], None): 1}))

    def _lost_key(self, item: Record, reason: str, detail: str) -> GapKey:
        return (item.run_id, item.model_call_id, reason, f"{item.describe()}: {detail}"[:500], None)

    def _count_lost(self, lost: Counter[GapKey]) -> None:
        """Adds gaps to those waiting to be written, bounded (PENDING_GAP_KEYS;
        the gaps of records kept to be tried again are bounded by the retry
        queue, and keep their own rows: a try finds its gap by its key)."""
        with self._lock:
            for key, count in lost.items():
                if key not in self._lost and len(self._lost) >= PENDING_GAP_KEYS and not key[4]:
                    run_id, _, reason, _, _ = key
                    key = (run_id, None, reason, DETAIL_DROPPED, None)
                    if key not in self._lost and len(self._lost) >= 2 * PENDING_GAP_KEYS:
                        self.dropped += count
                        continue
                self._lost[key] += count

    def _write(self, batch: list[Record]) -> None:
        """The batch's new records in one transaction (`_save_new`); each
        run's records left (or all, when that failed) in order, in as few
        transactions as their failures and TRANSACTION_SHARE allow; what is
        left when the writer's grace to stop is over is lost to the
        shutdown."""
        runs: dict[int, deque[Record]] = {}
        for record in self._save_new(batch):
            runs.setdefault(record.run_id, deque()).append(record)
        for pending in runs.values():
            while pending and not self._out_of_time():
                if pending[0].alone:
                    self._save_alone(pending.popleft())
                else:
                    self._save_some(pending)
            self._lose(pending, SHUTDOWN, "stopping")

    def _save_new(self, batch: list[Record]) -> list[Record]:
        """Saves the batch's documents read and its model calls whose model
        record is new (what a live run hands over) in one short
        transaction of two statements (records.record_new), and returns
        the rest: the model calls whose record was there already (a resumed
        run's: they take their locks one by one), the checks of sources,
        and, when the transaction failed (a lock not granted within the
        lock timeout, an error, a record the database refuses), all of
        them, which then go one by one, so that what failed is the gap of
        that record alone.  Nothing here is lost."""
        sources = [each for each in batch if isinstance(each, SourceRecord)]
        calls = {each.action_id: each for each in batch if isinstance(each, ModelCallRecord)}
        if not sources and not calls:
            return batch
        try:
            with transaction.atomic(), server_cursor() as cursor:
                commit_asynchronously(
                    cursor, application_name=application_name(self.role), **bounded_lock_waits()
                )
                saved = record_new(
                    cursor,
                    [each.row() for each in sources],
                    [each.row() for each in calls.values()],
                )
        except Exception as error:
            if not isinstance(error, DatabaseError):
                logger.exception("capture: saving %s records at once failed", len(batch))
            logger.info("capture: %s records go one by one: %s", len(batch), error)
            if isinstance(error, OperationalError):
                connection.close_if_unusable_or_obsolete()
            return batch
        return [
            each
            for each in batch
            if not isinstance(each, SourceRecord)
            and not (isinstance(each, ModelCallRecord) and each.action_id in saved)
        ]

    def _save_alone(self, record: Record) -> None:
        try:
            record.save()
        except Exception as error:
            self._failed([record], error)

    def _save_some(self, pending: deque[Record]) -> None:
        """Saves records from the head of `pending` (one run's) in one
        transaction, which commits asynchronously, until one fails: that
        one is a gap, its savepoints rolled back (and the locks it took
        released), and the transaction ends there, so what it holds is
        released too; the rest wait for the next one.  It takes no more
        records once TRANSACTION_SHARE of the lock timeout is gone, nor one
        that is saved `alone`.  A failure that takes the transaction with
        it (the connection lost, the COMMIT refused) makes a gap of every
        record it saved (of the first it was for, when it failed before)."""
        saved: list[Record] = []
        failed: Record | None = None
        until = time.monotonic() + (
            TRANSACTION_SHARE * settings.RUNDESK_CAPTURE_LOCK_TIMEOUT_MS / 1000
        )
        try:
            with transaction.atomic(), server_cursor() as cursor:
                commit_asynchronously(
                    cursor, application_name=application_name(self.role, pending[0].run_id)
                )
                # A record's foreign keys are checked as it is saved, not at
                # COMMIT: a record that breaks one fails alone.
                cursor.execute("SET CONSTRAINTS ALL IMMEDIATE", prepare=True)
                while pending and not pending[0].alone and not self._out_of_time():
                    record = pending.popleft()
                    try:
                        record.save()
                    except Exception as error:
                        if connection.needs_rollback or connection_lost():
                            saved.append(record)
                            raise
                        failed = record
                        self._lost_to([record], error)
                        break
                    saved.append(record)
                    if time.monotonic() >= until:
                        break
        except Exception as error:  # the transaction is lost, with what it saved
            if not saved and failed is None:
                saved.append(pending.popleft())
            self._failed(saved, error)

    def _lost_to(self, records: list[Record], error: Exception) -> None:
        """Records that raised `error`: gaps, never a crash; kept to be
        tried again when it was a lock they could not take."""
        if not isinstance(error, DatabaseError):
            logger.exception("capture: %s failed", records[-1].describe())
        if gap_reason(error) == GapReason.LOCK_NOT_AVAILABLE:
            for record in records:
                self.retry_later(record, str(error).strip())
        else:
            self._lose(records, gap_reason(error), str(error).strip())

    def _failed(self, batch: list[Record], error: Exception) -> None:
        """Records whose transaction was lost (what it saved), or a record
        saved alone that raised: gaps.  A lost connection is closed, and
        the next statement opens another."""
        self._lost_to(batch, error)
        if isinstance(error, OperationalError):
            connection.close_if_unusable_or_obsolete()

    def _write_lost(self, lost: Counter[GapKey]) -> None:
        with self._lock:
            dropped, self._dropped_told = self.dropped - self._dropped_told, self.dropped
        if dropped:
            logger.warning("capture: %s gaps dropped: too many waiting to be written", dropped)
        record_gaps(lost)

    def _write_lost_now(self) -> None:
        """The gaps, then why the records of those written before will not
        be tried again (said once: a gap that cannot say it stays a gap)."""
        super()._write_lost_now()
        with self._lock:
            given_up, self._given_up = self._given_up, []
        if not given_up:
            return
        try:
            note_given_up(given_up)
        except Exception as error:  # the writer must outlive anything
            logger.warning("capture: %s gaps not told why they stay: %s", len(given_up), error)
            connection.close_if_unusable_or_obsolete()

    # -- tries again, in the writer thread -------------------------------------------

    def _between_batches(self) -> None:
        due = self.retries.due(time.monotonic(), BATCH)
        saved = True
        for taken, retry in enumerate(due):
            # Stopping, what is left stays for the shutdown; after a try that
            # failed, for a later pass: the lock that held it most likely
            # holds the rest, and the writer's new records must not queue
            # behind a pass of tries that each wait out the lock timeout.
            if self._out_of_time() or not saved:
                for left in due[taken:]:
                    self.retries.again(left, time.monotonic())
                return
            saved = self._try_again(retry)

    def _try_again(self, retry: Retry) -> bool:
        """One try: saved (True), or back in the queue for a later one, or,
        out of tries, given up."""
        retry.attempts += 1
        failure = self._save_again(retry)
        if failure is None:
            self.retries.done(retry)
            self._count("saved_later")
            return True
        if retry.attempts < settings.RUNDESK_CAPTURE_RETRY_TRIES:
            self.retries.again(retry, time.monotonic())
        else:
            self.retries.done(retry)
            tries = f"{retry.attempts} {'try' if retry.attempts == 1 else 'tries'}"
            self._give_up(retry, f"not saved after {tries}: {failure}"[:300], "retry_exhausted")
        return False

    def _save_again(self, retry: Retry) -> str | None:
        """Saves the record and marks its gap saved, in one transaction;
        None when it did, else why not.  A gap not written yet is not
        tried (the try would find no gap to mark): the gaps are written
        first, and if they cannot be, that try failed."""
        with self._lock:
            unwritten = retry.gap in self._lost
        if unwritten:
            self._write_lost_now()
            with self._lock:
                if retry.gap in self._lost:
                    return "its gap could not be written yet"
        try:
            with transaction.atomic():
                retry.record.save()
                mark_saved(retry.key, retry.attempts)
        except Exception as error:
            if not isinstance(error, DatabaseError):
                logger.exception("capture: trying %s again failed", retry.record.describe())
            elif isinstance(error, OperationalError):
                connection.close_if_unusable_or_obsolete()
            return str(error).strip() or type(error).__name__
        return None

    def _give_up(self, retry: Retry, why: str, what: str) -> None:
        """The record of `retry` will not be tried again: its gap says why
        (in its detail when it is not written yet, else on its row with the
        next gaps written)."""
        with self._lock:
            self.counts[what] += 1
            count = self._lost.pop(retry.gap, 0)
            if count:
                run_id, call, reason, detail, _ = retry.gap
                self._lost[(run_id, call, reason, f"{detail} ({why})"[:700], None)] += count
            else:
                self._given_up.append((retry.key, retry.attempts, why))

    def _lose_what_is_queued(self) -> None:
        """Stopping: what is queued is lost, and what waits to be tried
        again stays a gap."""
        super()._lose_what_is_queued()
        for retry in self.retries.drain():
            self._give_up(retry, "not tried again: the process stopped", "retry_shutdown")


capture = Capture()


class RunCapture:
    """What one run hands to capture, said once for every agent: the
    copies each completed action leaves (by its tool), and the check of
    its sources when an owner resumes it.  Never blocks, never raises: what
    capture cannot take becomes a gap."""

    def __init__(self, run_id: int, writer: Capture | None = None) -> None:
        self.run_id = run_id
        self.writer = writer or capture

    def completed(
        self,
        action_id: int,
        tool: str,
        input: dict[str, Any],
        result: dict[str, Any],
        sources: Sequence[str],
    ) -> None:
        """An action's result settled by its receipt, handed over again
        (the owner that wrote it may have died before capture saved it;
        capture saves each once)."""
        self.save(self.copy_of(action_id, tool, input, result, sources))

    def copy_of(
        self,
        action_id: int,
        tool: str,
        input: dict[str, Any],
        result: dict[str, Any],
        sources: Sequence[str],
        result_digest: str = "",
    ) -> Record | None:
        """What capture keeps of an action's result: a document read leaves
        its source; a model call its model record and a bounded copy,
        linked to the `sources` it was given; other tools nothing.
        `result_digest`: the result's digest, when its receipt has it."""
        # A refused read has neither digest nor size; another agent's tool
        # of that name may name no path.
        if (
            tool == "read_document"
            and isinstance(input.get("path"), str)
            and "sha256" in result
            and "bytes" in result
        ):
            return SourceRecord(
                self.run_id, action_id, input["path"], result["sha256"], result["bytes"]
            )
        if tool == "model_call":
            return ModelCallRecord.of(
                self.run_id, action_id, input, result, list(sources), result_digest
            )
        return None

    def save(self, record: Record | None) -> None:
        """Hands what `copy_of` made to capture (nothing: no copy)."""
        if record is not None:
            self.writer.submit(record)

    def resumed(self) -> None:
        """A new owner took the run over: are its documents still what it read?"""
        self.writer.submit(SourceCheck(self.run_id))

"""Evidence capture: everything a run leaves as evidence, written off the
main path.

Evidence is observation.  The run hands each record (a source it read, a
model call with a bounded copy of it, a check of its sources on resume) to
a bounded in-process queue and never waits: no statement of the main path
reads, writes or locks an evidence table.  A background writer drains the
queue on its own connection (application_name `rundesk:capture`), one short
transaction per record, every lock bounded by `SET LOCAL lock_timeout`.  A
copy takes its locks in one fixed order: the copy's sources, then its model
record, the second with NOWAIT under the `nowait` policy (the one
production uses; NOWAIT alone would still wait behind a table lock).  A lock
that is not available at once rolls the transaction back, which releases
what it held, and leaves a CaptureGap; it is never retried, so the wait
cannot come back.  A full queue, an oversized copy, a database error and
shutdown each leave a gap with their reason.  A gap is never reported as a
save.

The `wait` policy is the old behaviour (wait for the model-record lock),
kept only so `reproduce_contention` can show what it did.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import DatabaseError, OperationalError, connection, transaction

from evidence.models import GapReason
from evidence.records import bound_lock_waits, bounded, record_model_call, record_source
from evidence.sources import SourceRefresh
from runs.models import digest
from runs.timeline import EventKind, timeline

logger = logging.getLogger(__name__)

LOCK_NOT_AVAILABLE = "55P03"  # NOWAIT refusal and lock_timeout alike
GAP_INTERVAL = 0.5  # seconds: how soon a counted gap is written, busy or idle
POLICIES = ("nowait", "wait")
# Gaps waiting to be written (the database is down, or their tables are
# locked) are counted per (run, model call, reason, detail) up to this many
# keys, then per (run, reason); what does not fit either is only counted.
PENDING_GAP_KEYS = 10_000
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

    def describe(self) -> str:
        return f"source {self.path}"

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

    @classmethod
    def of(
        cls,
        run_id: int,
        action_id: int,
        input: dict[str, Any],
        output: dict[str, Any],
        paths: list[str],
    ) -> ModelCallRecord:
        return cls(
            run_id=run_id,
            action_id=action_id,
            provider=str(output.get("provider", "")),
            input_digest=digest(input),
            output_digest=digest(output),
            paths=tuple(paths),
            input=json.dumps(input.get("messages", input), ensure_ascii=False),
            output=str(output.get("text", "")),
        )

    @property
    def size(self) -> int:
        return len(self.input.encode()) + len(self.output.encode())

    def describe(self) -> str:
        return f"model call of action {self.action_id}"

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
    which changed (evidence/sources.py)."""

    run_id: int

    model_call_id = None
    size = 0

    def describe(self) -> str:
        return "check of the sources against the corpus"

    def save(self) -> None:
        for path in SourceRefresh(self.run_id).run():
            timeline.record(self.run_id, EventKind.SOURCE_CHANGED, f"{path} changed since read")


Record = Copy | SourceRecord | ModelCallRecord | SourceCheck


def _cap(text: str, limit: int) -> tuple[str, int, bool]:
    raw = text.encode()
    if len(raw) <= limit:
        return text, len(raw), False
    return raw[:limit].decode(errors="ignore"), len(raw), True


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
        cursor.execute(
            "SELECT set_config('application_name', %s, true)",
            [f"rundesk:capture:run-{self.copy.run_id}"],
        )
        if self.policy == "nowait":
            bound_lock_waits(cursor)

    def lock_sources(self, cursor: Any) -> None:
        cursor.execute(
            """SELECT id FROM evidence_source WHERE id IN (
                   SELECT source_id FROM evidence_modelcall_sources WHERE modelcall_id = %s)
               ORDER BY id FOR SHARE""",
            [self.copy.model_call_id],
        )

    def lock_model_record(self, cursor: Any) -> None:
        nowait = " NOWAIT" if self.policy == "nowait" else ""
        cursor.execute(
            f"SELECT id FROM evidence_modelcall WHERE id = %s FOR SHARE{nowait}",
            [self.copy.model_call_id],
        )

    def insert(self, cursor: Any) -> None:
        limit = settings.RUNDESK_CAPTURE_MAX_BYTES
        input, input_bytes, cut_input = _cap(self.copy.input, limit)
        output, output_bytes, cut_output = _cap(self.copy.output, limit)
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
                "input": input,
                "output": output,
                "input_bytes": input_bytes,
                "output_bytes": output_bytes,
                "truncated": cut_input or cut_output,
            },
        )

    def save(self) -> None:
        with transaction.atomic(), connection.cursor() as cursor:
            self.begin(cursor)
            self.lock_sources(cursor)
            self.lock_model_record(cursor)
            self.insert(cursor)


def gap_reason(error: BaseException) -> GapReason:
    """Why a copy that raised `error` was not saved."""
    if getattr(error.__cause__, "sqlstate", None) == LOCK_NOT_AVAILABLE:
        return GapReason.LOCK_NOT_AVAILABLE
    return GapReason.DB_ERROR


def record_gaps(gaps: Counter[tuple[int, int | None, str, str]]) -> None:
    """Writes gaps (run, model call, reason, detail) -> count, and the runs'
    lost counters, in one statement, bounded by the capture lock timeout
    like every capture write.  A model call that does not exist is named in
    the detail only (each record's detail names what was lost)."""
    rows = [
        (run, call, reason, detail, count) for (run, call, reason, detail), count in gaps.items()
    ]
    with bounded() as cursor:
        cursor.execute(
            """WITH gap AS (
                   INSERT INTO evidence_capturegap (run_id, model_call_id, reason, detail, count,
                       created_at)
                   SELECT g.run, m.id, g.reason, g.detail, g.count, now()
                   FROM unnest(%s::bigint[], %s::bigint[], %s::text[], %s::text[], %s::int[])
                       AS g(run, call, reason, detail, count)
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
        )


# -- the queue and its writer ------------------------------------------------------


class Capture:
    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity or settings.RUNDESK_CAPTURE_QUEUE
        self._queue: queue.Queue[Record | threading.Event | None] = queue.Queue(self.capacity)
        self._gaps: Counter[tuple[int, int | None, str, str]] = Counter()
        # Gaps that fitted nowhere while they could not be written (and how
        # many of those the log has told of).
        self.dropped = 0
        self._dropped_told = 0
        self._lock = threading.Lock()
        # The writer thread, and the event that tells it to stop: its own, so
        # a writer still stuck in a statement when stop() gives up on it
        # ends when it can, whatever writer comes after it.
        self._writer: tuple[threading.Thread, threading.Event] | None = None

    def submit(self, record: Record) -> bool:
        """Hands a record to the writer.  Never blocks, never raises; False
        when it became a gap instead (queue full, too large)."""
        self._ensure_thread()
        if record.size > settings.RUNDESK_CAPTURE_MAX_BYTES * 16:
            self._lose(record, GapReason.TOO_LARGE, f"{record.size} bytes")
            return False
        try:
            self._queue.put_nowait(record)
            return True
        except queue.Full:
            self._lose(record, GapReason.QUEUE_FULL, f"capacity {self.capacity}")
            return False

    def flush(self, timeout: float = 10.0) -> bool:
        """Waits until everything submitted so far is saved or a gap."""
        marker = threading.Event()
        self._ensure_thread()
        try:
            self._queue.put(marker, timeout=timeout)
        except queue.Full:
            return False
        return marker.wait(timeout)

    def stop(self, grace: float = 2.0) -> None:
        """Saves what it can within `grace` seconds; what is left becomes
        `shutdown` gaps.  Then closes the writer and its connection.  Never
        waits on a full queue, nor more than `grace` + 5 s on a writer stuck
        in a statement (it stops at its next record)."""
        with self._lock:
            writer, self._writer = self._writer, None
        if writer is None or not writer[0].is_alive():
            return
        thread, stopping = writer
        deadline = time.monotonic() + grace
        while not self._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        stopping.set()
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)  # wakes an idle writer at once
        thread.join(grace + 5)
        if thread.is_alive():
            # Stuck in a statement: what it holds may go with the process.
            with self._lock:
                pending = sum(self._gaps.values())
            logger.warning(
                "capture: the writer did not stop in time; %s records queued and %s gaps "
                "counted may be lost with this process",
                self._queue.qsize(),
                pending,
            )

    def lose(self, run_id: int, model_call_id: int | None, reason: str, detail: str) -> None:
        """Counts a record that will not be made; the writer records the gap
        within GAP_INTERVAL, busy or idle.  Never blocks, never raises."""
        self._ensure_thread()
        self._count_gaps(Counter({(run_id, model_call_id, reason, detail[:500]): 1}))

    def _lose(self, record: Record, reason: str, detail: str) -> None:
        """A record lost, counted: the writer (running, or stopping and about
        to write what it counted) records it.  Starts no writer."""
        key = (record.run_id, record.model_call_id, reason, f"{record.describe()}: {detail}"[:500])
        self._count_gaps(Counter({key: 1}))

    def _count_gaps(self, gaps: Counter[tuple[int, int | None, str, str]]) -> None:
        """Adds gaps to those waiting to be written, bounded (PENDING_GAP_KEYS)."""
        with self._lock:
            for key, count in gaps.items():
                if key not in self._gaps and len(self._gaps) >= PENDING_GAP_KEYS:
                    run_id, _, reason, _ = key
                    key = (run_id, None, reason, DETAIL_DROPPED)
                    if key not in self._gaps and len(self._gaps) >= 2 * PENDING_GAP_KEYS:
                        self.dropped += count
                        continue
                self._gaps[key] += count

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._writer is None or not self._writer[0].is_alive():
                stopping = threading.Event()
                thread = threading.Thread(
                    target=self._drain, args=(stopping,), name="capture", daemon=True
                )
                self._writer = (thread, stopping)
                thread.start()

    def _drain(self, stopping: threading.Event) -> None:
        with _own_connection():
            written_at = time.monotonic()
            while not stopping.is_set():
                try:
                    item = self._queue.get(timeout=GAP_INTERVAL)
                except queue.Empty:
                    item = threading.Event()  # idle: time to write the gaps
                if item is None:
                    break
                if isinstance(item, threading.Event):
                    self._write_gaps()
                    written_at = time.monotonic()
                    item.set()
                    continue
                self._save(item)
                if time.monotonic() - written_at >= GAP_INTERVAL or self._queue.empty():
                    self._write_gaps()
                    written_at = time.monotonic()
            # What is left is a shutdown gap, unless a newer writer took over
            # (this one was stuck when stop() gave up on it).
            if self._writer is None:
                self._drain_as_shutdown()
            self._write_gaps()

    def _save(self, record: Record) -> None:
        try:
            record.save()
        except Exception as error:  # the writer must outlive anything: a gap, never a crash
            if not isinstance(error, DatabaseError):
                logger.exception("capture: %s failed", record.describe())
            self._lose(record, gap_reason(error), str(error).strip())
            if isinstance(error, OperationalError):
                connection.close_if_unusable_or_obsolete()

    def _drain_as_shutdown(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, threading.Event):
                item.set()
            elif item is not None:
                self._lose(item, GapReason.SHUTDOWN, "stopping")

    def _write_gaps(self) -> None:
        with self._lock:
            gaps, self._gaps = self._gaps, Counter()
            dropped, self._dropped_told = self.dropped - self._dropped_told, self.dropped
        if dropped:
            logger.warning("capture: %s gaps dropped: too many waiting to be written", dropped)
        if not gaps:
            return
        try:
            record_gaps(gaps)
        except Exception as error:
            # Kept (counted) until the database answers again.
            logger.warning("capture: %s gaps not recorded yet: %s", sum(gaps.values()), error)
            self._count_gaps(gaps)
            with contextlib.suppress(Exception):
                connection.close_if_unusable_or_obsolete()


@contextmanager
def _own_connection() -> Iterator[None]:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SET application_name = 'rundesk:capture'")
    except DatabaseError as error:
        logger.warning("capture: cannot name its connection: %s", error)
        connection.close()
    try:
        yield
    finally:
        connection.close()


capture = Capture()

"""Evidence capture: bounded copies of model calls, written off the main path.

Capture is an observation.  The caller (the agent, at the model-call
boundary) hands a copy to a bounded in-process queue and never waits.  A
background writer drains the queue on its own connection (application_name
`rundesk:capture`), one short transaction per copy, taking its locks in one
fixed order: the copy's sources, then its model record.  Under the `nowait`
policy (the one production uses) every lock is bounded by
`SET LOCAL lock_timeout` and the model-record lock is taken with NOWAIT
(NOWAIT alone would still wait behind a table lock).  A lock that is not
available at once rolls the transaction back, which releases what it held,
and leaves a CaptureGap; it is never retried, so the wait cannot come back.
A full queue, an oversized copy, a database error and shutdown each leave a
gap with their reason.  A gap is never reported as a save.

The `wait` policy is the old behaviour (wait for the model-record lock),
kept only so `reproduce_contention` can show what it did.
"""

from __future__ import annotations

import contextlib
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
from evidence.records import bound_lock_waits, bounded

logger = logging.getLogger(__name__)

LOCK_NOT_AVAILABLE = "55P03"  # NOWAIT refusal and lock_timeout alike
GAP_INTERVAL = 0.5  # seconds: how soon a counted gap is written, busy or idle
POLICIES = ("nowait", "wait")


@dataclass(frozen=True)
class Copy:
    """A copy of a model call; its sources are the model record's."""

    run_id: int
    model_call_id: int
    input: str
    output: str


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
        cursor.execute(
            """WITH copy AS (
                   INSERT INTO evidence_evidencecopy (run_id, model_call_id, input, output,
                       input_bytes, output_bytes, truncated, created_at)
                   VALUES (%s, %s, %s, %s, %s, %s, %s, now()) RETURNING id),
               linked AS (
                   INSERT INTO evidence_evidencecopy_sources (evidencecopy_id, source_id)
                   SELECT copy.id, link.source_id FROM copy, evidence_modelcall_sources link
                   WHERE link.modelcall_id = %s)
               INSERT INTO evidence_capturestats (run_id, captured, lost) VALUES (%s, 1, 0)
               ON CONFLICT (run_id) DO UPDATE
                   SET captured = evidence_capturestats.captured + 1""",
            [
                self.copy.run_id,
                self.copy.model_call_id,
                input,
                output,
                input_bytes,
                output_bytes,
                cut_input or cut_output,
                self.copy.model_call_id,
                self.copy.run_id,
            ],
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
    the detail only."""
    rows = [
        (run, call, reason, detail, count) for (run, call, reason, detail), count in gaps.items()
    ]
    with bounded() as cursor:
        cursor.execute(
            """WITH gap AS (
                   INSERT INTO evidence_capturegap (run_id, model_call_id, reason, detail, count,
                       created_at)
                   SELECT g.run, m.id, g.reason,
                       CASE WHEN m.id IS NULL AND g.call IS NOT NULL
                            THEN 'model call ' || g.call || ': ' || g.detail ELSE g.detail END,
                       g.count, now()
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
        self._queue: queue.Queue[Copy | threading.Event | None] = queue.Queue(self.capacity)
        self._gaps: Counter[tuple[int, int | None, str, str]] = Counter()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def submit(self, *, run_id: int, model_call_id: int, input: str, output: str) -> bool:
        """Hands a copy to the writer.  Never blocks, never raises; False
        when it became a gap instead (queue full, too large)."""
        size = len(input.encode()) + len(output.encode())
        if size > settings.RUNDESK_CAPTURE_MAX_BYTES * 16:
            self.lose(run_id, model_call_id, GapReason.TOO_LARGE, f"{size} bytes")
            return False
        self._ensure_thread()
        try:
            self._queue.put_nowait(Copy(run_id, model_call_id, input, output))
            return True
        except queue.Full:
            self.lose(run_id, model_call_id, GapReason.QUEUE_FULL, f"capacity {self.capacity}")
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
        `shutdown` gaps.  Then closes the writer and its connection."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None or not thread.is_alive():
            return
        deadline = time.monotonic() + grace
        while not self._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        self._stopping.set()
        self._queue.put(None)
        thread.join(grace + 5)
        self._stopping.clear()

    def lose(self, run_id: int, model_call_id: int | None, reason: str, detail: str) -> None:
        """Counts a copy that will not be made; the writer records the gap
        within GAP_INTERVAL, busy or idle.  Never blocks, never raises."""
        self._ensure_thread()
        with self._lock:
            self._gaps[(run_id, model_call_id, reason, detail)] += 1

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._drain, name="capture", daemon=True)
                self._thread.start()

    def _drain(self) -> None:
        with _own_connection():
            written_at = time.monotonic()
            while True:
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
                if self._stopping.is_set():
                    self.lose(item.run_id, item.model_call_id, GapReason.SHUTDOWN, "stopping")
                else:
                    self._save(item)
                if time.monotonic() - written_at >= GAP_INTERVAL or self._queue.empty():
                    self._write_gaps()
                    written_at = time.monotonic()
            self._drain_as_shutdown()
            self._write_gaps()

    def _save(self, copy: Copy) -> None:
        try:
            CopyTransaction(copy).save()
        except Exception as error:  # the writer must outlive anything: a gap, never a crash
            if not isinstance(error, DatabaseError):
                logger.exception("capture: copy of model call %s failed", copy.model_call_id)
            detail = str(error).strip()[:500]
            self.lose(copy.run_id, copy.model_call_id, gap_reason(error), detail)
            if isinstance(error, OperationalError):
                connection.close_if_unusable_or_obsolete()

    def _drain_as_shutdown(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Copy):
                self.lose(item.run_id, item.model_call_id, GapReason.SHUTDOWN, "stopping")
            elif isinstance(item, threading.Event):
                item.set()

    def _write_gaps(self) -> None:
        with self._lock:
            gaps, self._gaps = self._gaps, Counter()
        if not gaps:
            return
        try:
            record_gaps(gaps)
        except Exception as error:
            # Kept (counted) until the database answers again.
            logger.warning("capture: %s gaps not recorded yet: %s", sum(gaps.values()), error)
            with self._lock:
                self._gaps.update(gaps)
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

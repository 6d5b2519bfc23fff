"""The run timeline: RunEvents written off the main path.

Events are observations.  Recording one never blocks the caller and never
fails a protected write: it goes into a bounded in-process queue that a
background thread drains into the database on its own connection.  Events
that cannot be written (queue full, database error) are counted and, once
the database answers again, the run's timeline gets an `events_lost` event
saying how many are missing and why: an honest gap, never a silent one.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from django.db import DatabaseError, IntegrityError, connection
from django.utils import timezone

from runs.models import EventKind, RunEvent

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    event: RunEvent
    written: threading.Event | None = field(default=None)


class Timeline:
    def __init__(self, capacity: int = 10_000, batch: int = 500, linger: float = 0.05) -> None:
        self._queue: queue.Queue[_Pending | None] = queue.Queue(maxsize=capacity)
        self._batch = batch
        # Waiting a little for more events turns a commit per event into a
        # commit per batch: the writer then barely competes with the steps.
        self._linger = linger
        self._lost: Counter[tuple[int, str]] = Counter()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def record(
        self,
        run_id: int,
        kind: EventKind,
        message: str = "",
        *,
        action_id: int | None = None,
        **data: Any,
    ) -> None:
        """Queues one event.  Never blocks, never raises."""
        event = RunEvent(
            run_id=run_id,
            action_id=action_id,
            kind=kind,
            message=message,
            data=data,
            created_at=timezone.now(),
        )
        self._put(_Pending(event))

    def flush(self, timeout: float = 5.0) -> bool:
        """Waits until everything recorded so far is written (or lost)."""
        marker = _Pending(RunEvent(), threading.Event())
        if not self._put(marker):
            return False
        assert marker.written is not None
        return marker.written.wait(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Writes what is queued, then closes the thread and its connection."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            self._queue.put(None)
            thread.join(timeout)

    def _put(self, pending: _Pending) -> bool:
        self._ensure_thread()
        try:
            self._queue.put_nowait(pending)
            return True
        except queue.Full:
            if pending.written is None:
                with self._lock:
                    self._lost[(pending.event.run_id, "queue_full")] += 1
            return False

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._drain, name="timeline", daemon=True)
                self._thread.start()

    def _drain(self) -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SET application_name = 'rundesk:timeline'")
        except DatabaseError as error:
            logger.warning("timeline: cannot name its connection: %s", error)
        stopping = False
        while not stopping:
            batch: list[_Pending] = []
            item = self._queue.get()
            until = time.monotonic() + self._linger
            while item is not None:
                batch.append(item)
                if len(batch) >= self._batch or item.written is not None:
                    break
                try:
                    item = self._queue.get(timeout=max(0.0, until - time.monotonic()))
                except queue.Empty:
                    break
            stopping = item is None
            if batch:
                self._write(batch)
        connection.close()

    def _write(self, batch: list[_Pending]) -> None:
        events = [p.event for p in batch if p.written is None]
        with self._lock:
            gaps = [
                RunEvent(
                    run_id=run_id,
                    kind=EventKind.EVENTS_LOST,
                    message=f"{count} timeline events were not recorded ({reason})",
                    data={"count": count, "reason": reason},
                    created_at=timezone.now(),
                )
                for (run_id, reason), count in self._lost.items()
            ]
            self._lost.clear()
        try:
            try:
                RunEvent.objects.bulk_create(gaps + events)
            except DatabaseError:
                # One bad row (e.g. a run that no longer exists) must not
                # take the whole batch, or every later batch, down with it.
                connection.close_if_unusable_or_obsolete()
                self._write_each(gaps, events)
        finally:
            for pending in batch:
                if pending.written is not None:
                    pending.written.set()

    def _write_each(self, gaps: list[RunEvent], events: list[RunEvent]) -> None:
        lost = Counter[tuple[int, str]]()
        for row in gaps + events:
            try:
                RunEvent.objects.bulk_create([row])
            except IntegrityError as error:
                # The row can never be written (its run or action is gone):
                # said once in the log, not retried forever.
                logger.warning(
                    "timeline: dropped %s event of run %s: %s", row.kind, row.run_id, error
                )
            except DatabaseError as error:
                logger.warning(
                    "timeline: %s event of run %s not recorded: %s", row.kind, row.run_id, error
                )
                connection.close_if_unusable_or_obsolete()
                if row.kind == EventKind.EVENTS_LOST:
                    lost[(row.run_id, row.data["reason"])] += row.data["count"]
                else:
                    lost[(row.run_id, "db_error")] += 1
        with self._lock:
            self._lost.update(lost)


timeline = Timeline()

"""The run timeline: RunEvents written off the main path.

Events are observations.  Recording one never blocks the caller and never
fails a protected write: it goes into a bounded in-process queue that a
background thread (runs/background.py) drains into the database on its own
connection, a batch per COPY.  Events that cannot be written (queue full,
database error, shutdown) are counted and, once the database answers again,
the run's timeline gets an `events_lost` event saying how many are missing
and why: an honest gap, never a silent one.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections import Counter
from typing import Any, NamedTuple

from django.db import DatabaseError, IntegrityError, connection, models, transaction
from psycopg.types.json import Jsonb

from runs.background import BackgroundWriter
from runs.sql import bounded_lock_waits, commit_asynchronously, lock_refused, server_cursor

logger = logging.getLogger(__name__)


class EventKind(models.TextChoices):
    """What a timeline event says happened (RunEvent.kind)."""

    SUBMITTED = "submitted"
    LEASE_ACQUIRED = "lease_acquired"
    LEASE_RELEASED = "lease_released"
    LEASE_LOST = "lease_lost"
    RESUMED = "resumed"
    ACTION_DISPATCHED = "action_dispatched"
    ACTION_REDISPATCHED = "action_redispatched"
    ACTION_REUSED = "action_reused"  # a receipt existed: not dispatched again
    ACTION_COMPLETED = "action_completed"
    ACTION_FAILED = "action_failed"
    ACTION_UNKNOWN = "action_unknown"
    ACTION_REFUSED = "action_refused"  # its input refused before any boundary
    WRITE_FENCED = "write_fenced"  # a protected write changed 0 rows
    REVISION_PUBLISHED = "revision_published"
    REVISION_KEPT = "revision_kept"  # published before, otherwise written now: it stands
    PHASE_CHANGED = "phase_changed"
    NEEDS_OPERATOR = "needs_operator"
    RUN_COMPLETED = "run_completed"
    RUN_FAILED = "run_failed"
    RUN_CANCELLED = "run_cancelled"
    CHECKPOINT_SAVED = "checkpoint_saved"
    CHECKPOINT_FAILED = "checkpoint_failed"  # failed before write: handled locally
    CHECKPOINT_USED = "checkpoint_used"  # a resumed run continued from it
    CHECKPOINT_IGNORED = "checkpoint_ignored"  # its state disagreed with the receipts
    COMMIT_UNANSWERED = "commit_unanswered"  # outcome unknown, xid recorded
    OUTCOME_SETTLED = "outcome_settled"  # by pg_xact_status or a probe
    OUTCOME_OPEN = "outcome_open"  # left for an operator
    FAULT_INJECTED = "fault_injected"
    SOURCE_CHANGED = "source_changed"  # a document differs from what the run read
    CANCEL_REQUESTED = "cancel_requested"  # by an operator
    RUN_REQUEUED = "run_requeued"  # back in the queue: settled, or its owner died
    DECISION = "decision"  # an operator's or the system's, on an item or the run
    EVENTS_LOST = "events_lost"  # an honest gap in this timeline


COPY_EVENTS = "COPY runs_runevent (run_id, action_id, kind, message, data, created_at) FROM STDIN"


class Event(NamedTuple):
    """One RunEvent row, cheap to make on the caller's thread."""

    run_id: int
    action_id: int | None
    kind: str
    message: str
    data: dict[str, Any]
    created_at: dt.datetime


class Timeline(BackgroundWriter[Event, tuple[int, str]]):
    """Events written off the main path (runs/background.py): a batch of
    them per COPY, row by row when a row of it is refused.  Lost events are
    counted per (run, reason) and become an `events_lost` event."""

    role = "timeline"

    def __init__(self, capacity: int = 10_000, batch: int = 1_000, linger: float = 0.2) -> None:
        # Waiting a little for more events turns a commit per event into one
        # COPY per batch: the writer then barely competes with the steps.
        super().__init__(capacity, batch, linger)

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
        self._put(Event(run_id, action_id, str(kind), message, data, dt.datetime.now(dt.UTC)))

    def stop(self, timeout: float = 5.0) -> None:
        """Writes what is queued within `timeout` seconds (what is left then
        is an `events_lost` gap), then closes the thread and its connection."""
        super().stop(timeout)

    def _lost_key(self, item: Event, reason: str, detail: str) -> tuple[int, str]:
        return (item.run_id, reason)

    def _write_lost(self, lost: Counter[tuple[int, str]]) -> None:
        now = dt.datetime.now(dt.UTC)
        self._write(
            [
                Event(
                    run_id,
                    None,
                    EventKind.EVENTS_LOST.value,
                    f"{count} timeline events were not recorded ({reason})",
                    {"count": count, "reason": reason},
                    now,
                )
                for (run_id, reason), count in lost.items()
            ]
        )

    def _write(self, batch: list[Event]) -> None:
        try:
            self._copy(batch)
        except DatabaseError as error:
            connection.close_if_unusable_or_obsolete()
            if lock_refused(error):
                # A stranger holds the table (or a row its keys check):
                # every row would wait the same, so the batch is a gap now.
                logger.warning("timeline: %s events not recorded: %s", len(batch), error)
                lost = Counter[tuple[int, str]]()
                for row in batch:
                    _add_lost(lost, row, "lock_not_available")
                self._count_lost(lost)
                return
            # One bad row (e.g. a run that no longer exists) must not take
            # the whole batch, or every later batch, down with it.
            self._write_each(batch)
        except (TypeError, ValueError):
            self._write_each(batch)

    def _write_each(self, rows: list[Event]) -> None:
        lost = Counter[tuple[int, str]]()
        for row in rows:
            try:
                self._copy([row])
            except (IntegrityError, TypeError, ValueError) as error:
                # The row can never be written (its run or action is gone, or
                # its data is not JSON): said once in the log, not retried.
                logger.warning(
                    "timeline: dropped %s event of run %s: %s", row.kind, row.run_id, error
                )
            except DatabaseError as error:
                logger.warning(
                    "timeline: %s event of run %s not recorded: %s", row.kind, row.run_id, error
                )
                connection.close_if_unusable_or_obsolete()
                _add_lost(lost, row, _reason(error))
        self._count_lost(lost)

    @staticmethod
    def _copy(rows: list[Event]) -> None:
        with transaction.atomic(), server_cursor() as cursor:
            commit_asynchronously(cursor, **bounded_lock_waits())
            with cursor.copy(COPY_EVENTS) as copy:
                for row in rows:
                    copy.write_row(row._replace(data=Jsonb(row.data)))


def _reason(error: DatabaseError) -> str:
    """Why a write failed, as an `events_lost` event says it."""
    return "lock_not_available" if lock_refused(error) else "db_error"


def _add_lost(lost: Counter[tuple[int, str]], row: Event, reason: str) -> None:
    """Counts an event not written: an `events_lost` one as the events it
    counted, for their own reason."""
    if row.kind == EventKind.EVENTS_LOST:
        lost[(row.run_id, row.data["reason"])] += row.data["count"]
    else:
        lost[(row.run_id, reason)] += 1


timeline = Timeline()

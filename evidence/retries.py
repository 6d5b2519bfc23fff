"""Capture's retry queue: records that could not take their lock
(`lock_not_available`), kept to be tried again later by the capture writer
(evidence/capture.py), never by the main path.

Each record's gap is written at once, as for any record capture could not
save; the record waits here, bounded in records and in bytes, for its next
try, each one later than the last (RETRY_FIRST seconds, doubled each try up
to RETRY_LONGEST).  Nothing waits here holding a lock: a try is a short
transaction of its own, whose locks are NOWAIT or bounded like every
capture write's.  What does not fit stays a gap at once; what runs out of
tries, or is still here when the process stops, stays a gap and says why.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

RETRY_FIRST = 0.5  # seconds before the first try: the gap is written by then
RETRY_LONGEST = 8.0  # seconds between tries at most
# What a kept record costs beyond its copy's bytes (the entry, its key).
ENTRY_BYTES = 256


@dataclass
class Retry:
    """A record kept to be tried again, with the key of its gap row."""

    record: Any  # an evidence.capture.Record
    gap: tuple[Any, ...]  # its gap's key, as capture counts it (ends with `key`)
    key: uuid.UUID
    attempts: int = 0
    due: float = 0.0

    @property
    def size(self) -> int:
        return self.record.size + ENTRY_BYTES

    def later(self, now: float) -> None:
        """After a try that failed: when the next one is due."""
        self.due = now + min(RETRY_FIRST * 2**self.attempts, RETRY_LONGEST)


@dataclass
class Retries:
    """The bounded queue of records to try again, soonest due first
    (RUNDESK_CAPTURE_RETRY_QUEUE records, RUNDESK_CAPTURE_RETRY_BYTES bytes,
    read as each is kept).  Safe from any thread; `keep` never blocks beyond
    a short lock.  A record counts against the bounds from `keep` until
    `done`, including while the writer tries it."""

    _due: list[tuple[float, int, Retry]] = field(default_factory=list)
    _held: int = 0
    _held_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _order: itertools.count[int] = field(default_factory=itertools.count)

    def keep(self, retry: Retry, now: float) -> bool:
        """Keeps `retry` for its first try; False when it does not fit."""
        with self._lock:
            if (
                self._held + 1 > settings.RUNDESK_CAPTURE_RETRY_QUEUE
                or self._held_bytes + retry.size > settings.RUNDESK_CAPTURE_RETRY_BYTES
            ):
                return False
            self._held += 1
            self._held_bytes += retry.size
            retry.later(now)
            heapq.heappush(self._due, (retry.due, next(self._order), retry))
            return True

    def due(self, now: float, limit: int) -> list[Retry]:
        """Up to `limit` records whose try is due, taken out for it."""
        taken: list[Retry] = []
        with self._lock:
            while self._due and self._due[0][0] <= now and len(taken) < limit:
                taken.append(heapq.heappop(self._due)[2])
        return taken

    def again(self, retry: Retry, now: float) -> None:
        """Puts back a record whose try failed, for a later one."""
        retry.later(now)
        with self._lock:
            heapq.heappush(self._due, (retry.due, next(self._order), retry))

    def done(self, retry: Retry) -> None:
        """A record saved, or given up: its room is free again."""
        with self._lock:
            self._held -= 1
            self._held_bytes -= retry.size

    def drain(self) -> list[Retry]:
        """Every record waiting for a try, taken out and given up."""
        with self._lock:
            waiting = [entry[2] for entry in self._due]
            self._due.clear()
            self._held -= len(waiting)
            self._held_bytes -= sum(retry.size for retry in waiting)
        return waiting

    def __len__(self) -> int:
        with self._lock:
            return self._held

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._held_bytes


def retry_window(tries: int) -> float:
    """How long after its gap a record that needs every one of `tries`
    tries is tried for the last time."""
    return sum(min(RETRY_FIRST * 2**attempt, RETRY_LONGEST) for attempt in range(tries))

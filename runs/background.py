"""A background writer: what the main path hands over is written off it.

The run timeline (runs/timeline.py) and evidence capture
(evidence/capture.py) are both one: a subclass says what an item is, how a
batch of items is written, by what lost items are counted and how that count
is written.  The contract they share, kept here:

- Handing an item over never blocks and never raises: it goes into a bounded
  in-process queue, or, when the queue is full, is counted as lost.  It is
  an append under a lock, and a wake-up only for a writer that sleeps
  (`queue.Queue` cost ten Python calls an item, a tenth of the executor's
  own work per action went to handing over).
- One daemon thread drains the queue on its own database connection, named
  in pg_stat_activity (`application_name(role)`), and closed when the
  thread ends.  What it writes is optional: its transactions commit
  asynchronously (`runs.sql.commit_asynchronously`).  It is started when
  something is handed over and none is running.
- It takes a batch at a time: up to `batch` items, gathered for `linger`
  seconds unless someone waits for them (flush, stop).
- It outlives anything: what it cannot write is counted as lost, never
  raised, and the count becomes honest gap rows, written within
  GAP_INTERVAL seconds, busy or idle, and before a flush returns.  A count
  it cannot write is kept until the database answers again.
- `flush()` waits until everything handed over before it is written or
  counted as lost, and that count written.
- `stop(grace)` lets the writer empty the queue, and finish the batch it
  took, for `grace` seconds, then tells it to stop through its own stop
  event (`Stopping`): a writer stuck in a statement when stop() gives up
  on it ends when it can, whatever writer comes after it.  What is still
  queued then is lost to the shutdown.  It never waits on a full queue,
  nor more than `grace` + STOP_WAIT seconds.

Nothing here imports runs.models, runs.timeline or evidence: both writers
import this module.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

from django.db import DatabaseError, connection

from runs.sql import close_named, name_connection

GAP_INTERVAL = 0.5  # seconds: how soon a counted loss is written, busy or idle
STOP_WAIT = 5.0  # seconds stop() waits, after its grace, for a writer stuck in a statement

# Why the base counts an item as lost.
QUEUE_FULL = "queue_full"
SHUTDOWN = "shutdown"
WRITER_ERROR = "writer_error"


class Stopping(threading.Event):
    """What tells a writer thread to stop, with the moment its grace ends;
    and whether the thread has ended, in which process it was started."""

    deadline = 0.0
    ended = False
    pid = 0


Item = TypeVar("Item")  # what is handed over
Key = TypeVar("Key", bound=Hashable)  # what lost items are counted by


class BackgroundWriter(ABC, Generic[Item, Key]):
    """A bounded queue and the thread that writes it (the module docstring
    says what it promises).  Subclasses set `role` and implement `_write`,
    `_lost_key` and `_write_lost`; they may override `_failed` (what a
    batch that raised is lost as) and `_count_lost` (to bound the count)."""

    role: str  # names the thread, its connection and its log lines

    def __init__(self, capacity: int, batch: int = 1, linger: float = 0.0) -> None:
        self.capacity = capacity
        # Items, flush markers (threading.Event) and None (stop); markers
        # and None go in whatever the capacity: one per caller waiting.
        self._queue: deque[Item | threading.Event | None] = deque()
        self._queue_lock = threading.Lock()
        self._sleeping = False  # the writer waits for `_wake`
        self._wake = threading.Event()
        self._batch = batch
        self._linger = linger
        self._hurry = threading.Event()  # someone waits: no lingering
        self._lost: Counter[Key] = Counter()
        self._lock = threading.Lock()
        # The writer thread, and the event that tells it to stop: its own, so
        # a writer still stuck in a statement when stop() gives up on it
        # ends when it can, whatever writer comes after it.
        self._writer: tuple[threading.Thread, Stopping] | None = None
        self._thread = threading.local()  # in a writer thread: its stop event
        self._logger = logging.getLogger(type(self).__module__)

    @property
    def queued(self) -> int:
        """Items handed over and not taken by the writer yet: at most
        `capacity`, and a marker for each flush waiting and the stop."""
        return len(self._queue)

    def hurry(self) -> None:
        """The writer takes what is queued now, without lingering for more
        (a run that ends hands over its last records).  Never waits."""
        self._hurry.set()

    def flush(self, timeout: float = 5.0) -> bool:
        """Waits until everything handed over so far is written or counted
        as lost, and that count written (or kept for later).  With no
        writer running and nothing handed over, there is nothing to wait for."""
        with self._lock:
            idle = self._writer is None or not self._writer[0].is_alive()
            if idle and not self._queue and not self._lost:
                return True
        marker = threading.Event()
        self._ensure_thread()
        self._hand_over(marker)
        self._hurry.set()
        return marker.wait(timeout)

    def stop(self, grace: float = 2.0) -> None:
        """Writes what it can within `grace` seconds; what is left is lost
        to the shutdown (and counted so).  Then closes the writer and its
        connection.  Never waits on a full queue, nor more than `grace` +
        STOP_WAIT seconds on a writer stuck in a statement (it stops after
        that statement)."""
        with self._lock:
            writer, self._writer = self._writer, None
        if writer is None or not writer[0].is_alive():
            return
        thread, stopping = writer
        stopping.deadline = time.monotonic() + grace
        while self._queue and time.monotonic() < stopping.deadline:
            time.sleep(0.01)
        stopping.set()
        self._hand_over(None)  # wakes an idle writer at once
        self._hurry.set()
        thread.join(grace + STOP_WAIT)
        if thread.is_alive():
            # Stuck in a statement: what it holds may go with the process.
            with self._lock:
                lost = sum(self._lost.values())
            self._logger.warning(
                "%s: the writer did not stop in time; %s items queued and %s lost ones "
                "counted may be lost with this process",
                self.role,
                len(self._queue),
                lost,
            )

    # -- handing over: never blocks, never raises -----------------------------------

    def _put(self, item: Item) -> bool:
        """Queues an item for the writer (started if need be) without
        waiting; False when the queue is full: then it is counted as lost."""
        self._ensure_thread()
        with self._queue_lock:
            full = len(self._queue) >= self.capacity
            if not full:
                self._queue.append(item)
        if full:
            self._lose([item], QUEUE_FULL, f"capacity {self.capacity}")
            return False
        if self._sleeping:
            self._wake.set()
        return True

    def _hand_over(self, signal: threading.Event | None) -> None:
        """Queues a flush marker or the stop signal, whatever the capacity,
        and wakes the writer."""
        with self._queue_lock:
            self._queue.append(signal)
        self._wake.set()

    def _lose(self, items: Iterable[Item], reason: str, detail: str) -> None:
        """Items lost, counted: the writer (running, or stopping and about
        to write what it counted) writes the count.  Starts no writer."""
        self._count_lost(Counter(self._lost_key(item, reason, detail) for item in items))

    def _count_lost(self, lost: Counter[Key]) -> None:
        """Adds to the lost items waiting to be written."""
        with self._lock:
            self._lost.update(lost)

    def _ensure_thread(self) -> None:
        writer = self._writer
        if writer is not None and not writer[1].ended and writer[1].pid == os.getpid():
            # Once per event, from every run's thread: no lock, no look at
            # the thread (Thread.is_alive is five Python calls).  A forked
            # child, whose threads are gone, looks.
            return
        with self._lock:
            if self._writer is None or not self._writer[0].is_alive():
                stopping = Stopping()
                stopping.pid = os.getpid()
                thread = threading.Thread(
                    target=self._run, args=(stopping,), name=self.role, daemon=True
                )
                self._writer = (thread, stopping)
                thread.start()

    # -- the writer thread ---------------------------------------------------------

    def _run(self, stopping: Stopping) -> None:
        self._thread.stopping = stopping
        try:
            self._drain(stopping)
        finally:
            try:
                close_named()
            finally:
                stopping.ended = True

    def _out_of_time(self) -> bool:
        """In the writer thread: whether it was told to stop and its grace
        is over (a `_write` that saves its batch item by item stops between
        items then; within the grace it finishes the batch it took)."""
        stopping = self._thread.stopping
        return stopping.is_set() and time.monotonic() >= stopping.deadline

    def _set_up(self, session: object) -> object:
        """This thread's connection, named once per session (a lost one is
        replaced, and the new one named too)."""
        if connection.connection is not None and connection.connection is session:
            return session
        try:
            name_connection(self.role)
        except DatabaseError as error:
            self._logger.warning("%s: cannot name its connection: %s", self.role, error)
            close_named()
            return None
        return connection.connection

    def _drain(self, stopping: Stopping) -> None:
        written_at = time.monotonic()
        session = self._set_up(None)
        while not stopping.is_set():
            items = self._take()
            markers = [item for item in items if isinstance(item, threading.Event)]
            batch = [
                item for item in items if item is not None and not isinstance(item, threading.Event)
            ]
            if batch:
                session = self._set_up(session)
                try:
                    self._write(batch)
                except Exception as error:  # the writer must outlive anything
                    self._failed(batch, error)
            # Idle, asked to flush or stop, caught up, or GAP_INTERVAL gone
            # by: time to write what was lost.
            if (
                markers
                or not batch
                or not self._queue
                or time.monotonic() - written_at >= GAP_INTERVAL
            ):
                self._write_lost_now()
                written_at = time.monotonic()
            self._between_batches()
            for marker in markers:
                marker.set()
            if None in items:
                break
        # What is left is lost to the shutdown, unless a newer writer took
        # over (this one was stuck when stop() gave up on it).
        if self._writer is None:
            self._lose_what_is_queued()
        self._write_lost_now()
        with self._lock:
            unrecorded = sum(self._lost.values()) if self._writer is None else 0
        if unrecorded:
            # The database refused even the count (its table locked, or the
            # database gone): this log line is all that is left of it.
            self._logger.warning(
                "%s: %s lost items could not be recorded and end with this process",
                self.role,
                unrecorded,
            )

    def _take(self) -> list[Item | threading.Event | None]:
        """The next batch, or [] after GAP_INTERVAL seconds idle."""
        if not self._queue:
            # Said before the queue is looked at again: an item handed over
            # after this look finds the writer sleeping and wakes it.
            self._sleeping = True
            if not self._queue:
                self._wake.wait(GAP_INTERVAL)
            self._sleeping = False
            self._wake.clear()
            if not self._queue:
                return []
        # Let items gather (without waking up for each one) unless someone
        # waits for them.
        if self._hurry.wait(self._linger):
            self._hurry.clear()
        with self._queue_lock:
            return [self._queue.popleft() for _ in range(min(self._batch, len(self._queue)))]

    def _lose_what_is_queued(self) -> None:
        with self._queue_lock:
            items = list(self._queue)
            self._queue.clear()
        for item in items:
            if isinstance(item, threading.Event):
                item.set()
            elif item is not None:
                self._lose([item], SHUTDOWN, "stopping")

    def _write_lost_now(self) -> None:
        with self._lock:
            lost, self._lost = self._lost, Counter()
        if not lost:
            return
        try:
            self._write_lost(lost)
        except Exception as error:
            # Kept (counted) until the database answers again.
            self._logger.warning(
                "%s: %s lost items not recorded yet: %s", self.role, sum(lost.values()), error
            )
            self._count_lost(lost)
            with contextlib.suppress(Exception):
                connection.close_if_unusable_or_obsolete()

    # -- what a subclass says ------------------------------------------------------

    @abstractmethod
    def _write(self, batch: list[Item]) -> None:
        """Writes a batch; raises (for `_failed`) what it cannot handle."""

    def _between_batches(self) -> None:
        """The writer's own work between batches (capture's tries again),
        at least every GAP_INTERVAL seconds, after the lost items' count
        is written.  Must not raise."""

    def _failed(self, batch: list[Item], error: Exception) -> None:
        """`_write` raised: the batch is counted as lost."""
        self._logger.exception("%s: writer failed", self.role)
        self._lose(batch, WRITER_ERROR, str(error).strip())

    @abstractmethod
    def _lost_key(self, item: Item, reason: str, detail: str) -> Key:
        """What a lost item is counted by."""

    @abstractmethod
    def _write_lost(self, lost: Counter[Key]) -> None:
        """Writes the count of lost items as gap rows; raises when it cannot
        (the count is then kept for the next try)."""

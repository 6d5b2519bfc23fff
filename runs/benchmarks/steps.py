"""`bench` (the default): what a step of the real agent path costs -- the
durable commits and WAL syncs it makes, counted by the server, and its time
against a single-row INSERT + COMMIT on the same database -- and the same
for a no-op step alone.  `count_path` and `drive_run` drive any agent's
runs so (`bench --support-path`, support_path.py, counts the support
agent's with them).

Counting is server-side: `pg_stat_database.xact_commit` of this database
(every transaction, read-only ones too) and `pg_stat_wal.wal_sync` (every
WAL flush of the whole server: the durable commits, group commits merged).
A backend reports its counts when idle, at most once a second (an idle
one that reported less than a second ago waits ten), so each count first
makes every backend of the bench report: its own (pg_stat_force_next_flush),
and the timeline's and capture's writers, by ending their connections (a
backend reports as it exits).  Then it
waits STATS_SETTLE seconds for the server's own processes.  The server's
noise is an idle window counted the same way."""

from __future__ import annotations

import contextlib
import math
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.management.base import CommandError
from django.db import DatabaseError

from evidence.capture import capture
from runs import lifecycle, registry
from runs.agents.tools import NOOP
from runs.benchmarks import ServerCounts, p50
from runs.dispatch import Dispatcher
from runs.leases import Lease, PendingReceipt, WriteRefused, new_owner_name
from runs.models import Checkpoint, Run, RunStatus
from runs.renewal import renewals
from runs.sql import server_cursor
from runs.submission import submit
from runs.timeline import timeline

# Seconds for every backend to report its counts (PostgreSQL 15 reports
# at most once a second, when idle).
STATS_SETTLE = 1.5


def counts_now() -> ServerCounts:
    """The server's counts once every backend of this bench has reported."""
    for writer in (timeline, capture):
        writer.flush()
        writer.stop()
    with server_cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
    time.sleep(STATS_SETTLE)
    with server_cursor() as cursor:
        return ServerCounts.read(cursor)


def report(steps: int) -> dict[str, Any]:
    counted = agent_path(steps)
    samples = measure(steps)
    return {"agent_path": counted, "noop_step": noop_report(steps, samples)}


def agent_path(steps: int) -> dict[str, Any]:
    """A research run of about `steps` steps (two per document, then the
    composition and the delivery) through the real agent path, as the
    executor drives it: its commits and WAL syncs counted alone, then
    another such run timed step by step, each step followed by a bare
    commit on the same connection."""
    count_run, timed_run = runs = [_long_run(steps) for _ in range(2)]
    with cancelled_if_left(runs):
        counted = count_path([count_run])
        samples: dict[str, list[float]] = {"step": [], "writes": [], "commit": []}
        with commit_table():
            drive_run(timed_run, _timed_dispatcher(samples))
    commit = statistics.median(samples["commit"])
    return {
        "steps": counted.steps,
        "documents": len(count_run.documents),
        **counted.per_step(),
        "checkpoints": Checkpoint.objects.filter(run=count_run, state__isnull=False).count(),
        "step_ms_p50": p50(samples["step"]),
        "commit_ms_p50": p50(samples["commit"]),
        "step_over_commit": round(statistics.median(samples["step"]) / commit, 2),
        # The part of a step no tool work or bookkeeping can shorten: its
        # fenced writes (the boundary, with the previous read's receipt),
        # with the agent's payloads.
        "writes_ms_p50": p50(samples["writes"]),
        "writes_over_commit": round(statistics.median(samples["writes"]) / commit, 2),
    }


def _long_run(steps: int) -> Run:
    corpus = sorted(
        p.name for p in settings.RUNDESK_CORPUS_DIR.glob("*.md") if p.name != "README.md"
    )
    documents = [corpus[i % len(corpus)] for i in range(max(1, math.ceil((steps - 2) / 2)))]
    return submit(
        question="bench: compare", documents=documents, action_budget=2 * len(documents) + 2
    )


@dataclass(frozen=True)
class PathCounts:
    """What the server counted while runs went through the real agent path."""

    steps: int
    used: ServerCounts
    seconds: float
    # The WAL syncs of an idle window just before, per second.
    noise_wal_syncs_per_s: float

    def per_step(self) -> dict[str, float]:
        return {
            "commits_per_step": round(self.used.commits / self.steps, 3),
            "wal_syncs_per_step": round(self.used.wal_syncs / self.steps, 3),
            # What the rest of the server flushed meanwhile, at its idle rate.
            "noise_wal_syncs_per_step": round(
                self.noise_wal_syncs_per_s * self.seconds / self.steps, 3
            ),
        }


def count_path(runs: Sequence[Run]) -> PathCounts:
    """Drives `runs` (submitted: their submission is not counted) one
    after another through the real agent path, counted by the server as
    one stretch, after an idle second counted the same way."""
    idle = counts_now()
    started = time.monotonic()
    time.sleep(1.0)
    noise = counts_now() - idle
    noise_per_s = noise.wal_syncs / (time.monotonic() - started - STATS_SETTLE)

    before = counts_now()
    started = time.monotonic()
    taken = sum(drive_run(run, Dispatcher) for run in runs)
    seconds = time.monotonic() - started
    used = counts_now() - before
    return PathCounts(taken, used, seconds, noise_per_s)


def drive_run(run: Run, dispatcher_class: type[Dispatcher]) -> int:
    """Drives `run` with its agent as the executor does (drive()), with
    `dispatcher_class`; the steps it took.  Waits until its timeline and
    evidence are written.  A run that does not complete is ended as
    failed (no executor is to resume a bench's run) and raises
    CommandError saying why."""
    lease = Lease.claim(run.pk, new_owner_name())
    if lease is None:
        raise CommandError(f"could not claim bench run {run.pk}")
    with renewals.held(lease) as lost:
        dispatcher = dispatcher_class(lease, stop=threading.Event(), lease_lost=lost)
        try:
            dispatcher.run_agent(registry.agent_class(run.agent))
        except Exception as error:  # any way the agent stopped; said in the CommandError
            with contextlib.suppress(WriteRefused):
                dispatcher.finish(RunStatus.FAILED, f"bench: {error!r}")
            raise CommandError(
                f"bench run {run.pk} ({run.agent}) did not complete: {error!r}"
            ) from error
        if dispatcher.finish(RunStatus.COMPLETED, "bench") != RunStatus.COMPLETED:
            raise CommandError(f"bench run {run.pk} did not complete")
    timeline.flush()
    capture.flush()
    return dispatcher.progress.steps


@contextlib.contextmanager
def cancelled_if_left(runs: Sequence[Run]) -> Iterator[None]:
    """Cancels those of `runs` still queued when the bench stops early: an
    executor of the database is not to take a bench's run (a support run
    would mail the sample customers through its SMTP server)."""
    try:
        yield
    except BaseException:
        for run in runs:
            # The database may be what failed: its error is the one to see.
            with contextlib.suppress(DatabaseError):
                lifecycle.cancel(
                    run.pk,
                    "a benchmark",
                    "the benchmark stopped before this run",
                    [RunStatus.QUEUED],
                )
        raise


def _timed_dispatcher(samples: dict[str, list[float]]) -> type[Dispatcher]:
    """A Dispatcher that times each step, the statements it made through
    its lease (the boundary, with the previous read's receipt; an effect's
    receipt), and a bare commit after it."""
    writes = [0.0]

    class TimedLease(Lease):
        def _changes_rows(self, sql: str, **extra: Any) -> bool:
            start = time.perf_counter()
            try:
                return super()._changes_rows(sql, **extra)
            finally:
                writes[0] += time.perf_counter() - start

        def _fetch_one(self, sql: str, **extra: Any) -> tuple[Any, ...] | None:
            start = time.perf_counter()
            try:
                return super()._fetch_one(sql, **extra)
            finally:
                writes[0] += time.perf_counter() - start

    class Timed(Dispatcher):
        def __init__(self, lease: Lease, **kwargs: Any) -> None:
            super().__init__(TimedLease(lease.run_id, lease.owner, lease.epoch), **kwargs)

        def step(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            writes[0] = 0.0
            start = time.perf_counter()
            result = super().step(*args, **kwargs)
            samples["step"].append((time.perf_counter() - start) * 1000)
            samples["writes"].append(writes[0] * 1000)
            with server_cursor() as cursor:
                start = time.perf_counter()
                cursor.execute("INSERT INTO rundesk_bench_commit DEFAULT VALUES")
                samples["commit"].append((time.perf_counter() - start) * 1000)
            return result

    return Timed


def noop_report(steps: int, samples: dict[str, list[float]]) -> dict[str, Any]:
    commit = statistics.median(samples["commit"])
    return {
        "steps": steps,
        "step_ms_p50": p50(samples["step"]),
        "commit_ms_p50": p50(samples["commit"]),
        "step_over_commit": round(statistics.median(samples["step"]) / commit, 2),
        # Where a step's time goes: its two fenced writes alone, and a
        # round trip that writes nothing.
        "writes_ms_p50": p50(samples["writes"]),
        "writes_over_commit": round(statistics.median(samples["writes"]) / commit, 2),
        "roundtrip_ms_p50": p50(samples["roundtrip"]),
    }


@contextlib.contextmanager
def noop_run(steps: int) -> Iterator[Dispatcher]:
    """The Dispatcher of a claimed run for `steps` no-op reads
    (`noop_step`), finished on the way out."""
    run = submit(
        question=f"bench: {steps} no-op reads", documents=["(none)"], action_budget=2 * steps
    )
    lease = Lease.claim(run.pk, new_owner_name())
    if lease is None:
        raise CommandError(f"could not claim bench run {run.pk}")
    # Renewed as an executor's run is: on a busy machine the steps may
    # outlast the lease.
    with renewals.held(lease) as lost:
        dispatcher = Dispatcher(lease, stop=threading.Event(), lease_lost=lost, tools=[NOOP])
        yield dispatcher
        dispatcher.finish(RunStatus.COMPLETED, "bench")
    timeline.flush()


def noop_step(dispatcher: Dispatcher, i: int) -> object:
    """The run's i-th no-op read through the real executor path
    (Dispatcher.step: boundary, tool, receipt; timeline)."""
    return dispatcher.step(f"noop:{i}", "noop", {"i": i})


def measure(steps: int) -> dict[str, list[float]]:
    """Steps through the real executor path (lease, Dispatcher.step:
    boundary, tool, receipt; timeline), each followed by a single-row
    INSERT + COMMIT (autocommit: one round trip) on a logged table, on the
    same connection: both see the same machine at the same moment.  Each
    round also times the step's two fenced writes made through the lease
    alone (no dispatcher, timeline or tool): the boundary, with the
    receipt of the read before it; and a `SELECT 1`."""
    samples: dict[str, list[float]] = {"step": [], "commit": [], "writes": [], "roundtrip": []}
    previous: list[int | None] = [None]

    def timed(name: str, work: Callable[..., object], *args: Any) -> None:
        start = time.perf_counter()
        work(*args)
        samples[name].append((time.perf_counter() - start) * 1000)

    def bare(name: str, sql: str) -> None:
        # The thread's connection of the moment: a step gives its own back
        # to the pool before its tool runs (runs.sql.release_connection),
        # so no cursor is kept across one.
        with server_cursor() as cursor:
            timed(name, cursor.execute, sql)

    def writes(lease: Lease, i: int) -> None:
        receipts = [] if previous[0] is None else [PendingReceipt(previous[0], {"ok": True})]
        previous[0] = lease.record_boundary(
            step_key=f"writes:{i}",
            kind="noop",
            effect_class="read",
            input={"i": i},
            receipts=receipts,
        )

    with noop_run(steps) as dispatcher, commit_table():
        for i in range(steps):
            timed("step", noop_step, dispatcher, i)
            bare("commit", "INSERT INTO rundesk_bench_commit DEFAULT VALUES")
            timed("writes", writes, dispatcher.lease, i)
            bare("roundtrip", "SELECT 1")
        dispatcher.lease.record_receipt(previous[0], {"ok": True})
    return samples


@contextlib.contextmanager
def commit_table() -> Iterator[None]:
    """The logged table the bare commit inserts into, for the bench's life."""
    with server_cursor() as cursor:
        cursor.execute(
            "CREATE TABLE IF NOT EXISTS rundesk_bench_commit "
            "(id bigserial PRIMARY KEY, at timestamptz NOT NULL DEFAULT now())"
        )
    try:
        yield
    finally:
        with server_cursor() as cursor:
            cursor.execute("DROP TABLE rundesk_bench_commit")

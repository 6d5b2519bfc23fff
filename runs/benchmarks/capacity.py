"""`bench --capacity`: how many slow runs one executor process holds in
flight, on how few PostgreSQL sessions (issue 39).

Runs of the real research agent (three documents: 3 reads, 3 summaries,
compose, deliver = 8 actions) whose every tool takes TOOL_SECONDS (the
fault plan's `tool_delay`), so a run alone takes about 8 s and nearly all
of it is waiting, as real agents wait on models and remote tools.  One
`manage.py executor --concurrency N` process (N = the batch), warmed by
one such run alone (`one_run_s`, the yardstick), is given each batch of
10, 100 and 1,000 runs at once.  Per batch:

- `seconds` (by the database's clock: from the commit of the submission,
  when the runs can first be claimed, to the last run's finished_at),
  `over_one_run` (`seconds` / `one_run_s`, measured the same way; the goal
  is <= 2: the runs wait side by side), `runs_s`; `submit_s`, how long the
  bench's own submission took before that (one transaction: 1,000 runs
  take about 2 s, which are the bench's, not the executor's);
- `peak_sessions`: the most sessions of the database seen at once in
  pg_stat_activity (sampled every SAMPLE_SECONDS), the bench's own left
  out: the executor's pool (its runs, the lease renewal, the timeline and
  capture writers, the lock sampler) and anything else connected;
- `executor_cpu_s` and `executor_rss_mb` (its peak resident memory,
  VmHWM): the process's, over its life;
- `server_cpu_s` and `server_cpu_ms_per_action`: the CPU the PostgreSQL
  server spent on the database over the batch (its backends, the bench's
  own left out, and its WAL writer, checkpointer and background writer;
  None where the server is not on this machine).  The executor and the
  server share the machine's cores: a batch waits on whichever is short
  of CPU;
- `completed`, `reads_dispatched_twice` (read actions with more than one
  attempt: a document read twice), `leases_lost` (`lease_lost` or
  `write_fenced` events, or an epoch above 1); `capture_gaps` and
  `events_lost` (what the bounded capture and timeline queues could not
  take: counted as gaps, never waited for).

The runs go to a database of their own (`rundesk_bench_capacity`, made
empty here and dropped after), as DBOS's workflows do: both start from an
empty database, and nothing earlier benchmarks left in the configured one
(its rows, autovacuum cleaning them) weighs on either.

The peer: DBOS, the same workload as workflows of eight 1-s steps, started
all at once in a process of its own on a database of its own
(`rundesk_peer_capacity_dbos`, made and dropped here), with its own pool as
shipped: the same figures, sessions and the server's CPU counted on its
database.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import resource
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
from django.db import connection
from django.db.models import Sum
from django.db.models.functions import Coalesce
from psycopg import sql

from evidence.models import CaptureGap, EvidenceCopy
from runs.benchmarks import ServerCpu
from runs.benchmarks.pages import bench_database
from runs.benchmarks.peers import connection_params, sqlalchemy_url
from runs.benchmarks.throughput import (
    DOCUMENTS,
    ExecutorProcess,
    cancel_unfinished,
    executor_env,
    require_completed,
    submit,
    unfinished,
)
from runs.models import Action, Run, RunEvent
from runs.timeline import EventKind, timeline

BATCHES = (10, 100, 1000)
TOOL_SECONDS = 1.0
STEPS = 2 * len(DOCUMENTS) + 2  # a run's actions, a DBOS workflow's steps
SAMPLE_SECONDS = 0.05
BATCH_TIMEOUT = 300.0
DATABASE = "rundesk_bench_capacity"
DBOS_DATABASE = "rundesk_peer_capacity_dbos"
GOAL_SESSIONS = 20
GOAL_OVER_ONE_RUN = 2.0


def report(batches: Sequence[int] = BATCHES) -> dict[str, Any]:
    """Rundesk's figures for each batch, then DBOS's; RuntimeError saying
    what failed."""
    started = time.monotonic()
    with (
        bench_database(DATABASE, fresh=True),
        tempfile.TemporaryDirectory(prefix="rundesk-bench-capacity-") as folder,
        timeline_named_as_bench(),
    ):
        rundesk = [measure(n, Path(folder) / f"batch-{n}") for n in batches]
    dbos = measure_dbos(batches)
    largest = rundesk[-1]
    return {
        "database": DATABASE,
        "tool_s": TOOL_SECONDS,
        "actions_per_run": STEPS,
        "rundesk": rundesk,
        "dbos": dbos,
        "goal": {
            "runs": largest["runs"],
            "sessions_at_most": GOAL_SESSIONS,
            "over_one_run_at_most": GOAL_OVER_ONE_RUN,
            "met": largest["peak_sessions"] <= GOAL_SESSIONS
            and largest["over_one_run"] <= GOAL_OVER_ONE_RUN
            and largest["completed"] == largest["runs"]
            and largest["reads_dispatched_twice"] == 0
            and largest["leases_lost"] == 0,
        },
        "seconds": round(time.monotonic() - started, 1),
    }


# -- sessions -------------------------------------------------------------------


@contextlib.contextmanager
def timeline_named_as_bench() -> Iterator[None]:
    """This process's timeline writer (the runs' `submitted` events) names
    its session as the bench's, left out of the peak with the bench's own:
    named `rundesk:timeline` like the executor's, it was counted while it
    wrote them, the executor's first runs already stepping (18 sessions at
    100 runs, where the executor held 17)."""
    timeline.stop()
    timeline.role = "bench:timeline"
    try:
        yield
    finally:
        timeline.stop()
        del timeline.role


class SessionPeak:
    """The most sessions of `database` seen at once, sampled on a
    connection of its own (left out, with the bench's own connections)."""

    def __init__(self, database: str) -> None:
        self.database = database
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="session-peak", daemon=True)

    def _sample(self) -> None:
        with psycopg.connect(**connection_params(self.database), autocommit=True) as side:
            while not self._stop.wait(SAMPLE_SECONDS):
                (now,) = side.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
                    " AND pid <> pg_backend_pid()"
                    " AND coalesce(application_name, '') NOT LIKE 'rundesk:bench%%'",
                    (self.database,),
                ).fetchone()
                self.peak = max(self.peak, now)

    def __enter__(self) -> SessionPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class ServerSide:
    """The CPU the PostgreSQL server spent on `database` while the block
    ran (`cpu_s`, runs.benchmarks.ServerCpu: None where the server is not
    on this machine), read on a connection of its own to `admin` (by
    default `database` itself), named as the bench's: neither SessionPeak
    nor ServerCpu counts it."""

    def __init__(self, database: str, admin: str | None = None) -> None:
        self.database = database
        self.admin = admin or database
        self.cpu_s: float | None = None

    def __enter__(self) -> ServerSide:
        self._side = psycopg.connect(**connection_params(self.admin), autocommit=True)
        self._before = ServerCpu.read(self._side, self.database)
        return self

    def __exit__(self, *exc: object) -> None:
        with self._side:
            after = ServerCpu.read(self._side, self.database)
        if self._before is not None and after is not None:
            self.cpu_s = round(after.since(self._before), 2)


def rss_peak_mb(pid: int) -> float | None:
    """A process's peak resident memory (VmHWM), in MB (Linux)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


# -- Rundesk --------------------------------------------------------------------


def slow_runs(count: int, what: str) -> list[int]:
    return submit(count, what, faults=[{"point": "tool_delay", "ms": int(TOOL_SECONDS * 1000)}])


def wait_done(run_ids: list[int], executor: ExecutorProcess, timeout: float) -> None:
    done = unfinished(run_ids)
    deadline = time.monotonic() + timeout
    while not done():
        if executor.exited():
            raise RuntimeError(f"the executor exited: {executor.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(run_ids)} runs not done within {timeout:g} s")
        time.sleep(0.1)


def submitted(count: int, what: str) -> tuple[list[int], float, float]:
    """`count` slow runs, committed: their ids, the database's clock just
    after the commit (from when they can be claimed), and how long the
    submission took before it."""
    run_ids = slow_runs(count, what)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT extract(epoch FROM clock_timestamp()),"
            " extract(epoch FROM clock_timestamp() - min(created_at))"
            " FROM runs_run WHERE id = ANY(%s)",
            [run_ids],
        )
        committed, took = cursor.fetchone()
    return run_ids, float(committed), float(took)


def span(run_ids: list[int], since: float) -> float:
    """Seconds from `since` (the database's epoch) to the last run's end."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT extract(epoch FROM max(finished_at)) FROM runs_run WHERE id = ANY(%s)",
            [run_ids],
        )
        return float(cursor.fetchone()[0]) - since


def measure(runs: int, folder: Path) -> dict[str, Any]:
    """One executor process holding `runs` runs in flight (after one run
    alone, the yardstick)."""
    env = executor_env(folder)
    env["RUNDESK_ROLE"] = "executor"
    executor = ExecutorProcess(env, folder / "executor.log", concurrency=runs)
    batch: list[int] = []
    try:
        # Up, its imports and connections made, before anything is timed.
        warm = submit(1, "capacity: warm-up")
        wait_done(warm, executor, 120)
        alone, alone_since, _ = submitted(1, "capacity: one run alone")
        wait_done(alone, executor, 120)
        require_completed(alone)
        one_run = span(alone, alone_since)
        database = connection.settings_dict["NAME"]
        cpu_before = executor.cpu_seconds()
        with ServerSide(database) as server, SessionPeak(database) as sessions:
            batch, since, submit_s = submitted(runs, f"capacity: {runs} in flight")
            wait_done(batch, executor, BATCH_TIMEOUT)
        cpu = executor.cpu_seconds() - cpu_before
        rss = rss_peak_mb(executor.pid)
        captured_all(batch)
        executor.process.terminate()
        executor.process.wait(timeout=60)
    except BaseException:
        cancel_unfinished(batch)
        raise
    finally:
        executor.kill()
    seconds = span(batch, since)
    return {
        "runs": runs,
        "one_run_s": round(one_run, 2),
        "submit_s": round(submit_s, 2),
        "seconds": round(seconds, 2),
        "over_one_run": round(seconds / one_run, 2),
        "runs_s": round(runs / seconds, 1),
        "peak_sessions": sessions.peak,
        "executor_cpu_s": round(cpu, 2),
        "executor_cpu_ms_per_action": round(1000 * cpu / (runs * STEPS), 2),
        "executor_rss_mb": rss,
        "server_cpu_s": server.cpu_s,
        "server_cpu_ms_per_action": (
            None if server.cpu_s is None else round(1000 * server.cpu_s / (runs * STEPS), 2)
        ),
        **verdicts(batch),
    }


def captured_all(batch: list[int], timeout: float = 30.0) -> None:
    """Waits (up to `timeout`) until capture has saved, or made a gap of,
    what the batch handed it: a stopping executor turns what is still
    queued into `shutdown` gaps, which would be the bench's doing."""

    def saved() -> int:
        return (
            EvidenceCopy.objects.filter(run_id__in=batch).count()
            + CaptureGap.objects.filter(run_id__in=batch).count()
        )

    deadline = time.monotonic() + timeout
    last = -1
    while time.monotonic() < deadline and (now := saved()) != last:
        last = now
        time.sleep(1.0)


def verdicts(batch: list[int]) -> dict[str, int]:
    """Did every run complete, was any document read twice, any lease lost?
    And what did the timeline and capture drop (their queues are bounded:
    what does not fit is counted, never waited for)?"""
    lost_events = RunEvent.objects.filter(
        run_id__in=batch, kind__in=[EventKind.LEASE_LOST, EventKind.WRITE_FENCED]
    ).count()
    return {
        "completed": Run.objects.filter(pk__in=batch, status="completed").count(),
        "reads_dispatched_twice": Action.objects.filter(
            run_id__in=batch, kind="read_document", attempts__gt=1
        ).count(),
        "leases_lost": lost_events + Run.objects.filter(pk__in=batch, lease_epoch__gt=1).count(),
        "capture_gaps": CaptureGap.objects.filter(run_id__in=batch).aggregate(
            lost=Coalesce(Sum("count"), 0)
        )["lost"],
        "events_lost": RunEvent.objects.filter(
            run_id__in=batch, kind=EventKind.EVENTS_LOST
        ).count(),
    }


# -- DBOS -----------------------------------------------------------------------


@contextlib.contextmanager
def dbos_database() -> Iterator[str]:
    admin_params = connection_params(connection.settings_dict["NAME"])
    name = sql.Identifier(DBOS_DATABASE)
    with psycopg.connect(**admin_params, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(name))
        admin.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(name))
    try:
        yield DBOS_DATABASE
    finally:
        with psycopg.connect(**admin_params, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(name))


def measure_dbos(batches: Sequence[int]) -> list[dict[str, Any]] | dict[str, str]:
    """Each batch through DBOS, in a process of its own per batch."""
    try:
        import dbos  # noqa: F401
    except ImportError:
        return {"error": "bench --capacity's peer needs the bench extra: pip install -e '.[bench]'"}
    figures = []
    admin = connection.settings_dict["NAME"]
    with dbos_database() as database:
        url = sqlalchemy_url(database)
        for runs in [1, *batches]:
            with SessionPeak(database) as sessions:
                result = in_child(url, database, admin, runs)
            if runs == 1:
                one_run = result["seconds"]
                continue
            figures.append(
                {
                    "runs": runs,
                    "one_run_s": round(one_run, 2),
                    "seconds": round(result["seconds"], 2),
                    "over_one_run": round(result["seconds"] / one_run, 2),
                    "runs_s": round(runs / result["seconds"], 1),
                    "peak_sessions": sessions.peak,
                    "cpu_s": round(result["cpu_s"], 2),
                    "server_cpu_s": result["server_cpu_s"],
                    "rss_mb": round(result["rss_mb"], 1),
                    "completed": result["completed"],
                }
            )
    return figures


def in_child(url: str, database: str, admin: str, runs: int) -> dict[str, Any]:
    """`runs` DBOS workflows in a forked process (its CPU and memory its
    own) on `database`; what it measured (the server's CPU read on a
    connection to `admin`)."""
    connection.close()
    reader, writer = multiprocessing.Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(
        target=dbos_batch, args=(url, database, admin, runs, writer), daemon=True
    )
    child.start()
    writer.close()
    if not reader.poll(BATCH_TIMEOUT):
        child.kill()
        raise RuntimeError(f"DBOS: {runs} workflows not done within {BATCH_TIMEOUT:g} s")
    result = json.loads(reader.recv())
    child.join(30)
    if "error" in result:
        raise RuntimeError(f"DBOS: {result['error']}")
    return result


def dbos_batch(url: str, database: str, admin: str, runs: int, out: Any) -> None:
    """In the child: launches DBOS, starts `runs` workflows of STEPS steps of
    TOOL_SECONDS each at once, waits for them all; the server's CPU on
    `database` meanwhile, read before DBOS closes its connections."""
    try:
        from dbos import DBOS

        @DBOS.step()
        def rundesk_capacity_tool(i: int) -> int:
            time.sleep(TOOL_SECONDS)
            return i

        @DBOS.workflow()
        def rundesk_capacity_run(n: int) -> int:
            return sum(rundesk_capacity_tool(i) for i in range(STEPS))

        DBOS(
            config={
                "name": "rundesk-bench-capacity",
                "system_database_url": url,
                "log_level": "WARNING",
            }
        )
        DBOS.launch()
        with ServerSide(database, admin) as server:
            started = time.monotonic()
            handles = [DBOS.start_workflow(rundesk_capacity_run, n) for n in range(runs)]
            completed = sum(1 for handle in handles if handle.get_result() is not None)
            seconds = time.monotonic() - started
        usage = resource.getrusage(resource.RUSAGE_SELF)
        DBOS.destroy()
        out.send(
            json.dumps(
                {
                    "seconds": seconds,
                    "cpu_s": usage.ru_utime + usage.ru_stime,
                    "server_cpu_s": server.cpu_s,
                    "rss_mb": usage.ru_maxrss / 1024,
                    "completed": completed,
                }
            )
        )
    except BaseException as error:  # said to the parent, raised there
        out.send(json.dumps({"error": repr(error)}))

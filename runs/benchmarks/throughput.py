"""`bench --throughput`: runs/s and actions/s of `manage.py executor`
processes, against the commit ceiling of the same database, and the time
from an executor's death to another owner resuming its run.

Throughput.  For 1, 2 and 4 executors: that many `manage.py executor
--concurrency 1` processes (N processes of one worker thread, as N
machines would run them; on a small machine more threads per process would
only share the same cores), started fresh, warmed until each of them has
driven runs (imports, connections, prepared statements), then a batch of
100 new runs of the real research agent (three documents of the sample
corpus each: 3 reads, 3 summaries, compose, deliver = 8 actions) with the
offline model provider.  Executors poll every 0.2 s (RUNDESK_POLL_SECONDS),
so an idle one takes the batch's first run soon; the lease is the
configured one.  The batch's time is the database's own: from the
submission's transaction to the last run's `finished_at`.

Beside each figure, measured in the same run:

- `ceiling_commits_per_s`: single-row INSERT + COMMIT per second on a
  logged table of the same database, by as many clients as executors (each
  its own connection and thread, autocommit), for a few seconds, while the
  warmed executors wait idle;
- `commits_per_run`: the growth of pg_stat_database.xact_commit of the
  database over the batch, per run.  It counts every transaction that
  committed, read-only ones too (claims that found nothing, the sweep, the
  lock sampler, the timeline and capture writers, heartbeats).  A backend
  that goes idle less than a second after its last report of statistics
  keeps them until it is idle 10 s (PostgreSQL's PGSTAT_IDLE_INTERVAL;
  measured on 15): so the counter is read first when the warm-up's
  connections have been idle that long, and again once the executors have
  exited (a backend reports at exit).  The benchmark's own statements
  between the two readings (the submission and its polling) are taken off.
  `commits_per_s` is that count over the batch's time, `commits_of_ceiling`
  its share of the ceiling;
- `executor_cpu_ms_per_run` and `executor_cpu_ms_per_action`: CPU time
  (user + system, /proc) of the executor processes over the batch, per run
  and per action (tool latency none: the offline provider);
- `own_cpu_ms_per_action`: the same over a second batch, as large, of the
  research agent with tools that do nothing (runs/benchmarks/hollow.py:
  the same steps, publications and checkpoints, answers of the same
  sizes): what the executor itself costs per action.  The rest of
  `executor_cpu_ms_per_action` is the research agent's tools' own work
  (`tools_cpu_ms_per_action`: reading and decoding files, the offline
  model's text, an fsync'd file per report).

Failover.  Two executors with a short lease (RUNDESK_LEASE_SECONDS=2,
RUNDESK_POLL_SECONDS=0.2); a slow run (three documents, every tool call
delayed 250 ms: about 2 s of work); as soon as one executor holds it (its
pid in `Run.lease_owner`) and has completed an action (so the next owner
resumes from a receipt: a `resumed` event), that executor is SIGKILLed,
and the time until the run's lease epoch rises (another owner claimed it)
is one sample.  The killed executor is replaced before the next sample.
The owner renews every third of the time to live, so its lease has 2/3 to
all of it left at the kill (`lease_left_at_kill_s`); the rest of a sample
is the survivor's poll and claim.  The target is the lease's time to live
+ 1 s.

Runs go to the configured database (each batch its own new runs, marked
"bench --throughput:" in their question).  Executors take any claimable
run of it, so the benchmark refuses a database where runs are waiting to be
claimed or where other executors or workers are connected; on failure it
asks a cancel of its unfinished runs.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psycopg
from django.conf import settings
from django.db import connection, transaction
from django.test.utils import override_settings

from runs import submission
from runs.benchmarks import ServerCounts, p50, process_cpu_seconds
from runs.benchmarks.hollow import HOLLOW, HOLLOW_ENTRY
from runs.benchmarks.scale import worker_env
from runs.harness import GroupProcess
from runs.models import Action, Run, RunEvent, RunStatus
from runs.sql import application_name
from runs.timeline import EventKind, timeline

WORKER_COUNTS = (1, 2, 4)
BATCH = 100
DOCUMENTS = ["northwind-clean-energy.md", "meridian-world-equity.md", "crestline-short-treasury.md"]
POLL_SECONDS = 0.2  # RUNDESK_POLL_SECONDS of every executor here
CEILING_SECONDS = 3.0
# PostgreSQL's PGSTAT_IDLE_INTERVAL (10 s) and a margin: how long a
# connection's unreported statistics can wait once it is idle.
STATS_IDLE_SECONDS = 11.0
EXIT_SECONDS = 1.5  # for the backends of exited executors to end and report
FAILOVERS = 3
FAILOVER_LEASE_SECONDS = 2.0
TOOL_DELAY_MS = 250
BATCH_TIMEOUT = 300.0
QUESTION = "bench --throughput:"


def report(
    runs: int = BATCH,
    workers: Sequence[int] = WORKER_COUNTS,
    failovers: int = FAILOVERS,
    *,
    ceiling_seconds: float = CEILING_SECONDS,
    count_commits: bool = True,
) -> dict[str, Any]:
    """Throughput with each count of executors in `workers` on batches of
    `runs` runs, and `failovers` failover samples.  Without
    `count_commits`, no commits per run (and no 11 s wait per count for the
    statistics).  Raises RuntimeError saying what failed."""
    started = time.monotonic()
    refuse_shared_database()
    with tempfile.TemporaryDirectory(prefix="rundesk-bench-throughput-") as folder:
        measured = [
            measure(n, runs, Path(folder) / f"executors-{n}", ceiling_seconds, count_commits)
            for n in workers
        ]
        failover = measure_failover(failovers, Path(folder) / "failover") if failovers else None
    return {
        "database": connection.settings_dict["NAME"],
        "batch": runs,
        "documents_per_run": len(DOCUMENTS),
        "actions_per_run": actions_per_run(),
        "model_provider": "offline",
        "executor": {
            "concurrency": 1,
            "lease_ttl_s": settings.RUNDESK_LEASE_SECONDS,
            "poll_s": POLL_SECONDS,
            "debug": executor_debug() == "1",
        },
        "runs_s": {str(m["executors"]): m["runs_s"] for m in measured},
        "actions_s": {str(m["executors"]): m["actions_s"] for m in measured},
        "measured": measured,
        "failover": failover,
        "cpus": os.cpu_count(),
        "seconds": round(time.monotonic() - started, 1),
        "notes": [
            "commits_per_run: xact_commit growth of the database over the batch per run; "
            "it counts read-only transactions too (idle claims, sweeps, samplers, writers)",
            "ceiling_commits_per_s: single-row INSERT+COMMIT, as many autocommit clients as "
            "executors, measured while those executors were idle",
            f"failover: executors with RUNDESK_LEASE_SECONDS={FAILOVER_LEASE_SECONDS:g} and "
            f"RUNDESK_POLL_SECONDS={POLL_SECONDS:g}; the holder SIGKILLed once it held the run "
            "and had completed an action; measured until the run's lease epoch rose",
        ],
    }


def actions_per_run() -> int:
    return 2 * len(DOCUMENTS) + 2  # read and summarize each, compose, deliver


# -- executor processes ---------------------------------------------------------


class ExecutorProcess(GroupProcess):
    """`manage.py executor --concurrency 1` (or `concurrency`), its output in `log`."""

    def __init__(self, env: dict[str, str], log: Path, concurrency: int = 1) -> None:
        super().__init__(
            [sys.executable, "manage.py", "executor", "--concurrency", str(concurrency)], env, log
        )

    def tail(self, chars: int = 2000) -> str:
        try:
            return self.output()[-chars:]
        except OSError as error:
            return f"(no output: {error})"

    def cpu_seconds(self) -> float:
        """User and system CPU time it has used so far (Linux; -1 if unknown)."""
        used = process_cpu_seconds(self.pid)
        return -1.0 if used is None else used


def executor_debug() -> str:
    return os.environ.get("DEBUG") or ("1" if settings.DEBUG else "0")


def executor_env(folder: Path, lease_seconds: float | None = None) -> dict[str, str]:
    """The environment of an executor here: the database Django uses now,
    the offline provider, DEBUG as in this process, files under `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    installed = worker_env(folder)
    return {
        **installed,
        "RUNDESK_AGENTS": ",".join(filter(None, [installed.get("RUNDESK_AGENTS"), HOLLOW_ENTRY])),
        "DEBUG": executor_debug(),
        "RUNDESK_ROLE": "executor",
        "RUNDESK_LEASE_SECONDS": str(lease_seconds or settings.RUNDESK_LEASE_SECONDS),
        "RUNDESK_POLL_SECONDS": str(POLL_SECONDS),
    }


class Fleet:
    """Executor processes started here.  Whatever happens, none outlives
    the `with` block: left normally, they are stopped (SIGTERM), on an
    exception killed."""

    def __init__(self, env: dict[str, str], folder: Path) -> None:
        self.env, self.folder = env, folder
        self.processes: list[ExecutorProcess] = []  # alive, as far as we know
        self._all: list[ExecutorProcess] = []

    def start(self, count: int = 1) -> list[ExecutorProcess]:
        started = []
        for _ in range(count):
            log = self.folder / f"executor-{len(self._all)}.log"
            process = ExecutorProcess(self.env, log)
            self._all.append(process)
            self.processes.append(process)
            started.append(process)
        return started

    def kill(self, process: ExecutorProcess) -> None:
        self.processes.remove(process)
        process.kill()

    def stop(self) -> None:
        for process in self.processes:  # all at once, then each waited for
            if process.process.poll() is None:
                process.process.terminate()
        for process in self.processes:
            process.stop()

    def cpu_seconds(self) -> float:
        """CPU time used by the executors alive, together (-1 if unknown)."""
        each = [p.cpu_seconds() for p in self.processes]
        return -1.0 if any(c < 0 for c in each) else sum(each)

    def check(self) -> None:
        """RuntimeError if an executor thought alive has exited."""
        for process in self.processes:
            if process.exited():
                raise RuntimeError(
                    f"executor {process.pid} exited ({process.process.returncode}): "
                    f"{process.tail()}"
                )

    def tails(self) -> str:
        return "\n".join(f"executor {p.pid}: {p.tail(1000)}" for p in self.processes)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        try:
            if kind is None:
                self.stop()
        finally:
            for process in self._all:
                process.kill()


def wait_for(
    condition: Callable[[], object],
    fleet: Fleet,
    timeout: float,
    what: str,
    interval: float = 0.05,
) -> int:
    """Polls `condition` until true; RuntimeError (with the executors'
    output) if an executor exits or `timeout` passes.  Returns how many
    times it asked."""
    deadline = time.monotonic() + timeout
    asked = 1
    while not condition():
        fleet.check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not done within {timeout:g} s\n{fleet.tails()}")
        time.sleep(interval)
        asked += 1
    return asked


# -- runs -----------------------------------------------------------------------


def refuse_shared_database() -> None:
    """Executors take any claimable run of the database: the benchmark
    does not start where other runs wait to be claimed or other executors
    or workers are connected (their work would mix with the batches)."""
    waiting = list(
        Run.objects.claimable()
        .filter(is_drill=False, cancel_requested_at__isnull=True)
        .values_list("pk", flat=True)[:10]
    )
    if waiting:
        raise RuntimeError(
            f"runs {waiting} of database {connection.settings_dict['NAME']} wait to be claimed: "
            "the benchmark's executors would take them; let them finish or use another database"
        )
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND (application_name LIKE 'rundesk:executor%%'"
            " OR application_name LIKE 'rundesk:worker%%')"
        )
        (others,) = cursor.fetchone()
    if others:
        raise RuntimeError(
            f"{others} connections of executors or Celery workers use database "
            f"{connection.settings_dict['NAME']}: they would take the benchmark's runs"
        )


def submit(
    count: int, what: str, faults: list[dict[str, Any]] | None = None, agent: str = "research"
) -> list[int]:
    """`count` runs of the research agent (or of `agent`: the hollow one)."""
    hollow = {HOLLOW: HOLLOW_ENTRY.partition("=")[2]} if agent == HOLLOW else {}
    with (
        override_settings(RUNDESK_AGENTS={**settings.RUNDESK_AGENTS, **hollow}),
        transaction.atomic(),
    ):
        return [
            submission.submit(
                agent, question=f"{QUESTION} {what} {i}", documents=DOCUMENTS, faults=faults
            ).pk
            for i in range(count)
        ]


def cancel_unfinished(run_ids: Sequence[int]) -> None:
    """On failure: nothing of the benchmark stays claimable (a queued run
    ends at once; one a killed executor held, when it is next claimed or
    swept)."""
    with contextlib.suppress(Exception):
        for run in Run.objects.filter(
            pk__in=run_ids, status__in=[RunStatus.QUEUED, RunStatus.RUNNING]
        ):
            run.request_cancel(by="bench --throughput")


def unfinished(run_ids: Sequence[int]) -> Callable[[], bool]:
    active = Run.objects.filter(pk__in=run_ids, status__in=[RunStatus.QUEUED, RunStatus.RUNNING])
    return lambda: not active.exists()


def require_completed(run_ids: Sequence[int]) -> None:
    ended = Run.objects.filter(pk__in=run_ids).exclude(status=RunStatus.COMPLETED)
    if rows := list(ended.values_list("pk", "status", "status_reason")[:10]):
        raise RuntimeError(f"runs that did not complete: {rows}")


def owner_pids(run_ids: Sequence[int]) -> set[int]:
    """The executor processes that claimed these runs, as their
    `lease_acquired` events say (owner host:pid:token)."""
    messages = RunEvent.objects.filter(
        run_id__in=run_ids, kind=EventKind.LEASE_ACQUIRED
    ).values_list("message", flat=True)
    pids = set()
    for message in messages:
        parts = message.split(":")
        if len(parts) >= 3 and parts[-2].isdigit():
            pids.add(int(parts[-2]))
    return pids


def warm_up(fleet: Fleet, processes: Sequence[ExecutorProcess], timeout: float = 120) -> None:
    """Submits runs until each of `processes` has driven one: it is up,
    polling, its imports and connections made."""
    waiting = {p.pid for p in processes}
    run_ids: list[int] = []
    deadline = time.monotonic() + timeout
    while waiting:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"executors {sorted(waiting)} took no run within {timeout:g} s\n{fleet.tails()}"
            )
        batch = submit(2 * len(fleet.processes), "warm-up")
        run_ids += batch
        try:
            wait_for(unfinished(batch), fleet, timeout, "warm-up runs")
        except BaseException:
            cancel_unfinished(batch)
            raise
        require_completed(batch)
        # Their events are written off the main path, a little later.
        timeline.flush()
        seen_by = time.monotonic() + 2
        while waiting and time.monotonic() < seen_by:
            waiting -= owner_pids(run_ids)
            time.sleep(0.1)


# -- the database's own figures -------------------------------------------------


def side_connection(role: str) -> psycopg.Connection[Any]:
    params = connection.get_connection_params()
    params["application_name"] = application_name(role)
    return psycopg.connect(**params, autocommit=True)


def xact_commits() -> int:
    """pg_stat_database.xact_commit of this database, on a connection of
    its own (its own transactions are not in it yet)."""
    with side_connection("bench") as side:
        return ServerCounts.read(side).commits


def commit_ceiling(clients: int, seconds: float) -> float:
    """Single-row INSERT + COMMIT per second by `clients` concurrent
    autocommit connections (a thread each), on a logged table."""
    table = f"rundesk_bench_commit_{os.getpid()}"
    counts = [0] * clients
    ends = [0.0] * clients
    errors: list[BaseException] = []
    ready = threading.Barrier(clients + 1, timeout=60)
    start = [0.0]

    def client(i: int) -> None:
        try:
            with side_connection("bench-ceiling") as conn:
                ready.wait()
                ready.wait()  # the clock starts between the two
                end = start[0] + seconds
                insert = f"INSERT INTO {table} DEFAULT VALUES"
                while time.perf_counter() < end:
                    conn.execute(insert, prepare=True)
                    counts[i] += 1
                ends[i] = time.perf_counter()
        except BaseException as error:
            errors.append(error)
            ready.abort()

    with side_connection("bench-ceiling") as admin:
        admin.execute(
            f"CREATE TABLE {table}"
            " (id bigserial PRIMARY KEY, at timestamptz NOT NULL DEFAULT now())"
        )
        try:
            threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
            for thread in threads:
                thread.start()
            with contextlib.suppress(threading.BrokenBarrierError):
                ready.wait()
                start[0] = time.perf_counter()
                ready.wait()
            for thread in threads:
                thread.join()
        finally:
            admin.execute(f"DROP TABLE IF EXISTS {table}")
    if errors:
        raise RuntimeError(f"commit ceiling: {errors[0]!r}")
    return round(sum(counts) / (max(ends) - start[0]), 1)


# -- throughput -----------------------------------------------------------------


def measure(
    executors: int,
    runs: int,
    folder: Path,
    ceiling_seconds: float = CEILING_SECONDS,
    count_commits: bool = True,
) -> dict[str, Any]:
    """`executors` fresh executor processes, warmed; the commit ceiling
    with as many clients; then a batch of `runs` new runs, timed, and the
    commits it took."""
    env = executor_env(folder)
    batch: list[int] = []
    hollow: list[int] = []
    try:
        with Fleet(env, folder) as fleet:
            warm_up(fleet, fleet.start(executors))
            # The hollow batch first: its commits are not the batch's.
            cpu_warm = fleet.cpu_seconds()
            hollow = submit(runs, f"hollow batch of {executors} executors", agent=HOLLOW)
            wait_for(unfinished(hollow), fleet, BATCH_TIMEOUT, f"{runs} hollow runs", 0.1)
            fleet.check()
            cpu_hollow = fleet.cpu_seconds()
            warmed = time.monotonic()
            ceiling = commit_ceiling(executors, ceiling_seconds)
            before = 0
            if count_commits:
                # Every connection the warm-up left idle has reported.
                time.sleep(max(0.0, warmed + STATS_IDLE_SECONDS - time.monotonic()))
                connection.close()  # this process's connection reports at its end
                before = xact_commits()
            cpu_before = fleet.cpu_seconds()
            batch = submit(runs, f"batch of {executors} executors")
            # Polled at most 10 times a second: each poll is a transaction.
            polls = wait_for(unfinished(batch), fleet, BATCH_TIMEOUT, f"{runs} runs", 0.1)
            fleet.check()
            cpu_after = fleet.cpu_seconds()
        # The executors have exited: their backends report as they end.
        connection.close()
        commits = None
        if count_commits:
            time.sleep(EXIT_SECONDS)
            commits = xact_commits() - before - polls - 1  # less the polls and the submission
    except BaseException:
        cancel_unfinished(batch + hollow)
        raise
    require_completed(batch)
    require_completed(hollow)
    timeline.flush()
    figures = batch_figures(executors, batch, ceiling, commits)
    # CPU the executor processes used (all their threads), per run: at 1/runs_s
    # or more per core, they are what limits the batch.
    known = min(cpu_warm, cpu_hollow, cpu_before, cpu_after) >= 0
    used, own = cpu_after - cpu_before, cpu_hollow - cpu_warm
    actions = figures["actions"]
    per_action, own_per_action = used / actions, own / Action.objects.filter(run__in=hollow).count()
    figures["executor_cpu_ms_per_run"] = round(1000 * used / runs, 1) if known else None
    figures["executor_cpu_ms_per_action"] = round(1000 * per_action, 2) if known else None
    figures["own_cpu_ms_per_action"] = round(1000 * own_per_action, 2) if known else None
    figures["tools_cpu_ms_per_action"] = (
        round(1000 * (per_action - own_per_action), 2) if known else None
    )
    return figures


def batch_figures(
    executors: int, batch: list[int], ceiling: float, commits: int | None
) -> dict[str, Any]:
    """The batch's time by the database's clock: from the submission's
    transaction (every run's created_at) to the last run's finished_at."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT extract(epoch FROM max(finished_at) - min(created_at)) FROM runs_run"
            " WHERE id = ANY(%s)",
            [batch],
        )
        (seconds,) = cursor.fetchone()
    seconds = float(seconds)
    actions = Action.objects.filter(run_id__in=batch).count()
    runs = len(batch)
    figures: dict[str, Any] = {
        "executors": executors,
        "runs": runs,
        "actions": actions,
        "seconds": round(seconds, 2),
        "runs_s": round(runs / seconds, 1),
        "actions_s": round(actions / seconds, 1),
        "ceiling_commits_per_s": ceiling,
        "commits": commits,
        "commits_per_run": None,
        "commits_per_s": None,
        "commits_of_ceiling": None,
    }
    if commits is not None:
        figures["commits_per_run"] = round(commits / runs, 1)
        figures["commits_per_s"] = round(commits / seconds, 1)
        figures["commits_of_ceiling"] = round(commits / seconds / ceiling, 2)
    return figures


# -- failover -------------------------------------------------------------------


def pid_of(owner: str) -> int | None:
    parts = owner.split(":")
    return int(parts[-2]) if len(parts) >= 3 and parts[-2].isdigit() else None


def measure_failover(samples: int, folder: Path) -> dict[str, Any]:
    """Two executors with a short lease; `samples` times: a slow run, its
    holder SIGKILLed, the time until another owner claims it (a new
    epoch).  The killed executor is replaced before the next sample."""
    env = executor_env(folder, lease_seconds=FAILOVER_LEASE_SECONDS)
    measured: list[dict[str, float]] = []
    run_ids: list[int] = []
    try:
        with Fleet(env, folder) as fleet:
            warm_up(fleet, fleet.start(2))
            for i in range(samples):
                measured.append(failover_once(fleet, i, run_ids))
                if i < samples - 1:
                    warm_up(fleet, fleet.start(1))
        timeline.flush()
        resumed = RunEvent.objects.filter(run_id__in=run_ids, kind=EventKind.RESUMED).count()
    except BaseException:
        cancel_unfinished(run_ids)
        raise
    seconds = [m["failover_s"] for m in measured]
    target = FAILOVER_LEASE_SECONDS + 1
    return {
        "failover_s": seconds,
        "p50_s": p50(seconds),
        "max_s": max(seconds),
        "lease_ttl_s": FAILOVER_LEASE_SECONDS,
        "poll_s": POLL_SECONDS,
        "target_s": target,
        "within_target": max(seconds) <= target,
        # How much of its lease the killed owner had left: the wait the
        # lease imposes; the rest of a sample is the survivor's poll and claim.
        "lease_left_at_kill_s": [m["lease_left_s"] for m in measured],
        "resumed_events": resumed,
        "tool_delay_ms": TOOL_DELAY_MS,
    }


def failover_once(fleet: Fleet, i: int, run_ids: list[int]) -> dict[str, float]:
    """A slow run; once its holder has completed an action (so the next
    owner resumes from a receipt), the holder is SIGKILLed; returns the
    seconds until the run's epoch rose, and the lease left at the kill."""
    (run_id,) = submit(1, f"failover {i}", faults=[{"point": "tool_delay", "ms": TOOL_DELAY_MS}])
    run_ids.append(run_id)
    holder: tuple[ExecutorProcess, int, float] | None = None

    def held() -> bool:
        nonlocal holder
        with connection.cursor() as cursor:
            cursor.execute(
                """SELECT status, lease_owner, lease_epoch,
                       extract(epoch FROM lease_expires_at - clock_timestamp()),
                       EXISTS (SELECT 1 FROM runs_receipt WHERE run_id = runs_run.id)
                   FROM runs_run WHERE id = %s""",
                [run_id],
            )
            status, owner, epoch, left, receipt = cursor.fetchone()
        if status not in (RunStatus.QUEUED, RunStatus.RUNNING):
            raise RuntimeError(f"failover run {run_id} ended ({status}) before it could be caught")
        process = {p.pid: p for p in fleet.processes}.get(pid_of(owner) or 0)
        if status == RunStatus.RUNNING and process is not None and receipt:
            holder = (process, epoch, float(left))
            return True
        return False

    wait_for(held, fleet, 60, f"failover run {run_id}: no executor held it", 0.01)
    assert holder is not None
    process, epoch, left = holder
    killed_at = time.monotonic()
    fleet.kill(process)
    again = Run.objects.filter(pk=run_id, lease_epoch__gt=epoch)
    wait_for(
        again.exists,
        fleet,
        10 * FAILOVER_LEASE_SECONDS + 10,
        f"run {run_id}: no other owner took it after its executor {process.pid} was killed",
        0.01,
    )
    failover = time.monotonic() - killed_at
    wait_for(unfinished([run_id]), fleet, 60, f"resumed run {run_id}")
    require_completed([run_id])
    return {"failover_s": round(failover, 3), "lease_left_s": round(left, 3)}

"""Capacity (issue 39): many slow runs in flight through one executor
process, on a bounded number of PostgreSQL sessions.  A run waiting on its
tool holds no connection; the process's pool bounds what its runs, its
writers and its sampler hold, and the lease renewal adds one.

The processes checkpoint at production's cadence (RUNDESK_CHECKPOINT_EVERY
100), not after every action as the other tests' do: what is counted here
is sessions, and a checkpoint per action doubled each run's writes.  The
Celery worker polls its broker folder every 50 ms (`polled_often`) and is
killed once every run has completed: a warm stop waits for Celery's loop
to notice the SIGTERM, seconds later."""

from __future__ import annotations

import json
import signal
import threading

import psycopg
import pytest

from runs.benchmarks import ServerCpu
from runs.executor import Ending, Executor, run_threads
from runs.harness import database_url, wait_for
from runs.leases import Lease
from runs.models import Action, Run, RunEvent, RunStatus
from runs.submission import submit
from runs.timeline import EventKind
from tests.conftest import manage
from tests.processes import Worker, enqueue, polled_often, wait_until

# The filesystem broker's fixture.
from tests.processes import broker as broker

pytestmark = pytest.mark.django_db(transaction=True)

RUNS = 200
POOL = 6
# The pool, and the lease renewal's own connection.
SESSIONS = POOL + 1
DOCS = ["northwind-clean-energy.md", "meridian-world-equity.md"]
# Production's checkpoint cadence (dashboard/settings.py), not conftest's.
CHECKPOINT_EVERY = "100"


class SessionPeak:
    """The most sessions of the test database seen at once of processes
    of `role`."""

    def __init__(self, role: str = "executor") -> None:
        self.role = role
        self.peak = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        with psycopg.connect(database_url(), autocommit=True) as side:
            while not self.stop.wait(0.02):
                (now,) = side.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND application_name LIKE %s",
                    (f"rundesk:{self.role}%",),
                ).fetchone()
                self.peak = max(self.peak, now)


def test_two_hundred_slow_runs_in_flight_hold_no_more_sessions_than_the_pool(process_env, journal):
    runs = [
        submit(question=f"q{i}", documents=DOCS, faults=[{"point": "tool_delay", "ms": 300}]).pk
        for i in range(RUNS)
    ]
    env = {
        **process_env,
        "RUNDESK_ROLE": "executor",
        "RUNDESK_DB_POOL_SIZE": str(POOL),
        "RUNDESK_LEASE_SECONDS": "6",
        "RUNDESK_CHECKPOINT_EVERY": CHECKPOINT_EVERY,
        "DEBUG": "0",
        "SECRET_KEY": "test",
    }
    sessions = SessionPeak()
    sessions.thread.start()
    executor = manage("executor", "--concurrency", str(RUNS), "--json", env=env)
    try:
        # All of them in flight at once: far more runs than sessions.
        wait_for(
            lambda: Run.objects.filter(pk__in=runs, status=RunStatus.RUNNING).count() >= RUNS // 2,
            timeout=30,
        )
        wait_for(
            lambda: (
                not Run.objects.filter(
                    pk__in=runs, status__in=[RunStatus.QUEUED, RunStatus.RUNNING]
                ).exists()
            ),
            timeout=90,
        )
    finally:
        executor.send_signal(signal.SIGTERM)
        out, err = executor.communicate(timeout=60)
        sessions.stop.set()
        sessions.thread.join()
    endings = [json.loads(line)["outcome"] for line in out.splitlines()]
    assert endings.count("completed") == RUNS, err[-2000:]
    assert set(Run.objects.filter(pk__in=runs).values_list("status", flat=True)) == {"completed"}
    assert 0 < sessions.peak <= SESSIONS, sessions.peak
    # Each document read once, each lease kept from claim to finish.
    reads = journal.counts("read_document")
    assert len(reads) == RUNS * len(DOCS) and set(reads.values()) == {1}
    assert not Action.objects.filter(run_id__in=runs, attempts__gt=1).exists()
    assert set(Run.objects.filter(pk__in=runs).values_list("lease_epoch", flat=True)) == {1}
    assert not RunEvent.objects.filter(
        run_id__in=runs, kind__in=[EventKind.LEASE_LOST, EventKind.WRITE_FENCED]
    ).exists()


def test_a_celery_worker_holds_many_runs_in_flight_on_its_pool(
    process_env, journal, tmp_path, broker
):
    runs = 40
    env = {
        **process_env,
        "RUNDESK_ROLE": "worker",
        "RUNDESK_DB_POOL_SIZE": "4",
        "RUNDESK_LEASE_SECONDS": "6",
        "RUNDESK_CHECKPOINT_EVERY": CHECKPOINT_EVERY,
    }
    sessions = SessionPeak("worker")
    sessions.thread.start()
    worker = Worker(
        env, tmp_path / "worker.log", broker=polled_often(), pool="threads", concurrency=runs
    )
    try:
        # Submitted while the worker starts: nothing is handed to it yet.
        submitted = [
            submit(question=f"q{i}", documents=DOCS, faults=[{"point": "tool_delay", "ms": 300}]).pk
            for i in range(runs)
        ]
        worker.wait_ready()
        for run_id in submitted:
            enqueue(run_id)
        # The worker's threads take them all at once.
        wait_until(
            lambda: (
                Run.objects.filter(pk__in=submitted, status=RunStatus.RUNNING).count() >= runs // 2
            ),
            30,
            "runs not in flight side by side",
            worker,
        )
        wait_until(
            lambda: (
                not Run.objects.filter(
                    pk__in=submitted, status__in=[RunStatus.QUEUED, RunStatus.RUNNING]
                ).exists()
            ),
            90,
            "runs not done",
            worker,
        )
    finally:
        worker.kill()  # every run completed and committed: no warm stop (module docstring)
        sessions.stop.set()
        sessions.thread.join()
    assert set(Run.objects.filter(pk__in=submitted).values_list("status", flat=True)) == {
        "completed"
    }
    # The pool's four, and the lease renewal's own.
    assert 0 < sessions.peak <= 5, sessions.peak
    reads = journal.counts("read_document")
    assert len(reads) == runs * len(DOCS) and set(reads.values()) == {1}


def test_the_servers_cpu_is_what_the_backends_of_the_database_used():
    # bench --capacity says how much of the machine the server took beside
    # the executor: its backends' CPU, read from /proc (this machine's).
    with (
        psycopg.connect(database_url(), autocommit=True) as side,
        psycopg.connect(database_url(), autocommit=True, application_name="a client") as busy,
        psycopg.connect(
            database_url(), autocommit=True, application_name="rundesk:bench-throughput"
        ) as own,
    ):
        database = side.info.dbname
        before = ServerCpu.read(side, database)
        busy.execute("SELECT count(*) FROM generate_series(1, 3000000)")
        after = ServerCpu.read(side, database)
        assert before is not None and after is not None
        assert own.info.backend_pid not in after.seconds  # the bench's own left out
        assert after.since(before) >= 0.1
        assert busy.info.backend_pid in after.seconds


def test_an_executor_starts_its_run_threads_before_it_takes_a_run(monkeypatch):
    # One started as a thousand runs were handed over waited for the GIL
    # among the runs already stepping, and the claims waited with it.
    claim = Lease.claim_oldest.__func__
    threads_at_claims: list[int] = []

    def counted(cls, owner: str, most: int) -> list[Lease]:
        threads_at_claims.append(sum(t.name.startswith("run_") for t in threading.enumerate()))
        return claim(cls, owner, most)

    monkeypatch.setattr(Lease, "claim_oldest", classmethod(counted))
    run = submit(question="q", documents=DOCS[:1])
    assert Executor(concurrency=40).serve(once=True) == [(run.pk, Ending.COMPLETED)]
    assert threads_at_claims and threads_at_claims[0] == 40
    # Given back when it stops.
    assert not any(t.name.startswith("run_") for t in threading.enumerate())


def test_run_threads_the_system_cannot_start_are_said_at_once(monkeypatch):
    # Before any run is taken, and none of those started is left waiting.
    start = threading.Thread.start
    started: list[threading.Thread] = []

    def limited(thread: threading.Thread) -> None:
        if thread.name.startswith("run_") and len(started) == 3:
            raise RuntimeError("can't start new thread")
        start(thread)
        started.append(thread)

    monkeypatch.setattr(threading.Thread, "start", limited)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        run_threads(10)
    for thread in started:
        thread.join(5)
        assert not thread.is_alive()

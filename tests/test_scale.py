"""Scale-out on real brokers: many runs over several Celery worker
processes (and an executor beside them) against one PostgreSQL, and a
worker killed mid-run, on the filesystem broker, Redis and RabbitMQ.

However many processes race for the runs, the lease (runs/leases.py) keeps
one owner per run and runs/dispatch.py decides what may run again.  What
these tests hold them to, from the database and from outside it (the tool
journal, the outbox, the workers' own logs):

- every action has exactly one receipt, written by the epoch that
  dispatched it;
- with nobody killed, every action ran exactly once, every run was claimed
  once, completed once, by one process, and delivered one report (48 runs
  over four pool processes: each takes a dozen, all four racing for the
  queue and the database the whole time);
- with a worker killed mid-run, nothing with a receipt ran again, the
  delivery ran once, and only a read caught between its boundary and its
  receipt ran once more, under its own identity, by the next owner.

Each broker is a queue of the test's own (runs/benchmarks/scale.py:
`Broker`): on Redis (db 13 unless RUNDESK_TEST_REDIS_URL says otherwise)
keys under a prefix of its own, on RabbitMQ (RUNDESK_TEST_AMQP_URL) a queue
and exchange of its own; both are deleted afterwards.  A broker whose port
does not answer is skipped, or fails the test when CI is set.  The worker
processes use the prefork pool, as production does (README: `celery -A
dashboard worker --concurrency 4`; why not solo: runs/benchmarks/scale.py).

A test ends its worker nodes with SIGKILL once what it asserts is written
(`halt`): a warm shutdown takes Celery 2 to 5 s a node (it sees SIGTERM only
when its loop next wakes), longer than the runs themselves.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import signal
import socket
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.db.models.functions import Now

from runs import submission
from runs.benchmarks import scale
from runs.benchmarks.scale import FILESYSTEM, Broker
from runs.leases import Lease
from runs.models import Action, ActionState, AnswerRevision, Receipt, Run, RunEvent, RunStatus
from runs.models import action_identity as identity
from runs.timeline import EventKind
from tests.conftest import Journal, manage
from tests.processes import Worker, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

BROKERS = {
    "filesystem": FILESYSTEM,
    "redis": os.environ.get("RUNDESK_TEST_REDIS_URL", "redis://127.0.0.1:6379/13"),
    "rabbitmq": os.environ.get("RUNDESK_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//"),
}
# Redis gives back a message nobody acknowledged after this long (production
# waits hours and lets beat's sweep hand the run out: settings.py).  It must
# outlast a run of these tests, or a live worker's run is handed out twice
# (harmless: the copy finds the run leased, and gives up).
VISIBILITY_TIMEOUT = 5.0

# Runs spread over the four pool processes of two nodes.
MANY = 48

TWO_DOCS = ["northwind-clean-energy.md", "meridian-world-equity.md"]
THREE_DOCS = [*TWO_DOCS, "crestline-short-treasury.md"]
DONE = re.compile(r"execute_run\[([0-9a-f-]+)\] succeeded in [0-9.e-]+s: '(\w+)'")


@dataclass(frozen=True)
class OwnQueue(Broker):
    """A `Broker` queue whose worker nodes wait 1 s, not Celery's 10
    (worker_lost_wait), for a result a killed pool process might have sent
    before it died, before they reject its task back to the broker."""

    def celery_settings(self) -> dict[str, Any]:
        return {**super().celery_settings(), "worker_lost_wait": 1.0}


@pytest.fixture(params=list(BROKERS))
def celery_broker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Broker]:
    """A queue of this test's own on each broker in turn."""
    url = BROKERS[request.param]
    if reason := Broker.unreachable(url, timeout=0.5):
        message = f"the {request.param} broker does not answer ({reason})"
        if "CI" in os.environ:
            pytest.fail(f"{message}: CI is set, where every broker must run")
        pytest.skip(message)
    broker = OwnQueue.own(url, tmp_path / "broker", visibility_timeout=VISIBILITY_TIMEOUT)
    try:
        yield broker
    finally:
        broker.remove()


@pytest.fixture
def env(process_env: dict[str, str], celery_broker: Broker) -> dict[str, str]:
    """Worker and executor processes on the test database, the fast offline
    provider, leases of 10 s: long enough that no live owner loses one on a
    busy machine, so any second claim would be a fault."""
    return {
        **process_env,
        "CELERY_BROKER_URL": celery_broker.url,
        "RUNDESK_MODEL_PROVIDER": "offline",
        "RUNDESK_LEASE_SECONDS": "10",
    }


def start_node(
    env: dict[str, str], tmp_path: Path, broker: Broker, name: str, **options: object
) -> Worker:
    """A worker node: a prefork pool (`concurrency` processes), on `broker`."""
    return Worker(
        {**env, "RUNDESK_ROLE": "worker"},
        tmp_path / f"{name}.log",
        broker=broker,
        pool="prefork",
        name=name,
        **options,
    )


def ready(*nodes: Worker) -> list[Worker]:
    for each in nodes:
        each.wait_ready(60)
    return list(nodes)


def submit(count: int, documents: list[str], faults: list | None = None) -> list[int]:
    return [
        submission.submit(question=f"Compare, run {i}", documents=documents, faults=faults).pk
        for i in range(count)
    ]


def active(run_ids: list[int]) -> bool:
    return Run.objects.filter(
        pk__in=run_ids, status__in=[RunStatus.QUEUED, RunStatus.RUNNING]
    ).exists()


def completed_by_tasks(nodes: Iterable[Worker], tasks: dict[str, int]) -> Counter[int]:
    """Runs each worker's log says a task completed ("succeeded ...:
    'completed'"), by run (tasks: task id -> run id; a task sent by
    someone else, beat's sweep, counts under -1)."""
    return Counter(
        tasks.get(task_id, -1)
        for each in nodes
        for task_id, ending in DONE.findall(each.output())
        if ending == "completed"
    )


def wait_written(nodes: list[Worker], run_ids: list[int], tasks: dict[str, int]) -> None:
    """Waits until the nodes' logs say a task completed each of `run_ids`,
    and the timeline too: both are written just after a run's last commit,
    and the nodes are then killed (`halt`).  A count (at least one
    completion a run): the test asserts each run completed exactly once."""

    def written() -> bool:
        logged = sum(completed_by_tasks(nodes, tasks).values())
        ended = RunEvent.objects.filter(run_id__in=run_ids, kind=EventKind.RUN_COMPLETED)
        return logged >= len(run_ids) and ended.count() >= len(run_ids)

    alive = [each for each in nodes if not each.exited()]
    wait_until(written, 30, "the runs' completions not logged", *alive)


def halt(*nodes: Worker) -> None:
    """SIGKILLs the nodes (the module's docstring says why not SIGTERM)."""
    for each in nodes:
        each.kill()


def task_of(tasks: dict[str, int], run_id: int) -> str:
    (task_id,) = (task for task, run in tasks.items() if run == run_id)
    return task_id


def steps(documents: list[str]) -> list[str]:
    reading = [f"{kind}:{i}" for i in range(len(documents)) for kind in ("read", "summarize")]
    return [*reading, "compose", "deliver"]


def assert_each_action_ran_once_by_one_owner(
    run_ids: list[int], documents: list[str], journal: Journal, outbox: Path
) -> None:
    """Every run completed under one claim; each of its actions has one
    receipt and ran once, all in one process; one report was delivered."""
    keys = steps(documents)
    runs = Run.objects.filter(pk__in=run_ids)
    assert set(runs.values_list("status", "lease_epoch")) == {(RunStatus.COMPLETED, 1)}
    actions = Action.objects.filter(run_id__in=run_ids)
    assert actions.count() == len(run_ids) * len(keys)
    assert set(actions.values_list("state", "attempts", "epoch")) == {(ActionState.COMPLETED, 1, 1)}
    receipts = Receipt.objects.filter(run_id__in=run_ids)
    assert sorted(receipts.values_list("run_id", "step_key")) == sorted(
        (run_id, key) for run_id in run_ids for key in keys
    )
    assert set(receipts.values_list("epoch", flat=True)) == {1}

    # Outside the database: each identity executed once, and each run's
    # executions came from one process.
    entries = journal.entries()
    assert Counter(e["identity"] for e in entries) == Counter(
        identity(run_id, key) for run_id in run_ids for key in keys
    )
    processes: dict[str, set[int]] = {}
    for entry in entries:
        run = entry["identity"].split(":")[1]
        processes.setdefault(run, set()).add(entry["pid"])
    assert all(len(pids) == 1 for pids in processes.values()), processes

    finals = dict(
        AnswerRevision.objects.filter(run_id__in=run_ids, is_final=True).values_list(
            "run_id", "content"
        )
    )
    reports = {p.name: p.read_text() for p in outbox.iterdir() if not p.name.startswith(".")}
    assert len(finals) == len(reports) == len(run_ids)
    assert sorted(reports.values()) == sorted(finals.values())


def test_many_runs_over_4_worker_processes_each_action_runs_once_under_one_owner(
    celery_broker, env, journal, tmp_path
):
    # Two nodes (two machines) of two pool processes each.
    nodes = ready(
        *(start_node(env, tmp_path, celery_broker, f"node{i}", concurrency=2) for i in (0, 1))
    )
    try:
        run_ids = submit(MANY, TWO_DOCS)
        tasks = dict(zip(celery_broker.send(run_ids), run_ids, strict=True))
        wait_until(lambda: not active(run_ids), 120, "runs still active", *nodes)
        pools = set().union(*(pool_of(each) for each in nodes))
        wait_written(nodes, run_ids, tasks)
    finally:
        halt(*nodes)

    assert_each_action_ran_once_by_one_owner(run_ids, TWO_DOCS, journal, tmp_path / "outbox")
    # No run completed twice: one task each says so, and the timeline too.
    assert completed_by_tasks(nodes, tasks) == Counter(run_ids)
    ended = RunEvent.objects.filter(run_id__in=run_ids, kind=EventKind.RUN_COMPLETED)
    assert Counter(ended.values_list("run_id", flat=True)) == Counter(run_ids)
    # All four worker processes took runs: the pool processes of both nodes.
    assert len(pools) == 4 and {entry["pid"] for entry in journal.entries()} == pools


def test_celery_workers_and_an_executor_share_one_queue_of_runs(
    celery_broker, env, journal, tmp_path
):
    nodes = ready(start_node(env, tmp_path, celery_broker, "node0", concurrency=2))
    executor = manage("executor", "--concurrency", "2", "--json", env=env)
    try:
        # The executor is polling the queue before the runs come.
        wait_until(lambda: backends("rundesk:executor") > 0, 60, "executor not polling", *nodes)
        run_ids = submit(30, TWO_DOCS)
        # The executor takes the oldest run first; the tasks go newest first,
        # so the two meet in the middle.  Sent oldest first, the workers
        # (two tasks every 50 ms) could trail the executor over every run
        # and find each taken.
        newest_first = run_ids[::-1]
        tasks = dict(zip(celery_broker.send(newest_first), newest_first, strict=True))
        wait_until(lambda: not active(run_ids), 120, "runs still active", *nodes)
        executor.send_signal(signal.SIGTERM)
        out, err = executor.communicate(timeout=60)
        assert executor.returncode == 0, err
        by_executor = Counter(json.loads(line)["run_id"] for line in out.splitlines())
        # The workers' share: the runs the executor did not complete.
        wait_written(nodes, [run_id for run_id in run_ids if run_id not in by_executor], tasks)
    finally:
        executor.kill()
        halt(*nodes)

    assert_each_action_ran_once_by_one_owner(run_ids, TWO_DOCS, journal, tmp_path / "outbox")
    by_workers = completed_by_tasks(nodes, tasks)
    # Both took runs, and each run was completed once, by one of them: the
    # other's attempt found it leased or finished (its epoch stayed 1).
    assert by_executor and by_workers
    assert by_executor + by_workers == Counter(run_ids)
    assert {entry["pid"] for entry in journal.entries()} >= {executor.pid}


# -- a worker killed mid-run ----------------------------------------------------


@pytest.fixture
def kill_env(process_env: dict[str, str], celery_broker: Broker) -> dict[str, str]:
    """Leases of 2 s (process_env), so a dead owner's run is taken soon;
    beat's sweep, where it runs, every half second."""
    return {
        **process_env,
        "CELERY_BROKER_URL": celery_broker.url,
        "RUNDESK_MODEL_PROVIDER": "offline",
        "RUNDESK_SWEEP_SECONDS": "0.5",
    }


def slow_runs(count: int, ms: int = 250) -> list[int]:
    """Runs of three documents, each action `ms` long: a kill lands mid-run."""
    return submit(count, THREE_DOCS, faults=[{"point": "tool_delay", "ms": ms}])


def pool_of(worker: Worker) -> set[int]:
    """The processes `worker`'s process started: its pool (and its beat)."""
    pool = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):  # a process that ended meanwhile
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == worker.pid:
                pool.add(int(stat.parent.name))
    return pool


def holder(run_ids: list[int], worker: Worker) -> tuple[int, int] | None:
    """(run, pid): a run that a pool process of `worker` holds now, as its
    lease says (host:pid:...)."""
    pool = pool_of(worker)
    for run_id, owner in Run.objects.filter(pk__in=run_ids, status=RunStatus.RUNNING).values_list(
        "pk", "lease_owner"
    ):
        host, pid, _ = owner.split(":")
        if host == socket.gethostname() and int(pid) in pool:
            return run_id, int(pid)
    return None


def backends(name: str, *, state: str | None = None) -> int:
    """Connections of this test database named `name` (application_name),
    in `state` if given."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = %s AND state = coalesce(%s, state)",
            [name, state],
        )
        return cursor.fetchone()[0]


def kill_mid_read(run_ids: list[int], worker: Worker, *, whole_node: bool) -> tuple[int, dict]:
    """SIGKILLs a pool process of `worker` (or all of `worker`) while it
    holds a run between a read's boundary and its receipt.  Returns the run
    and the state of each of its actions at the kill.

    The holder is stopped (SIGSTOP) and looked at while it cannot move, once
    no statement of the worker's is in flight at the server (one the holder
    sent before it stopped still commits; the worker's pooled connections
    bear its name, not the run's): killed if a read of its run is
    dispatched without receipt, something completed before it, the report
    not yet composed (the delivery is far off); else let go on (SIGCONT)
    and caught again.
    """
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        worker.alive()
        if (held := holder(run_ids, worker)) is None:
            time.sleep(0.02)
            continue
        run_id, pid = held
        os.kill(pid, signal.SIGSTOP)
        wait_until(
            lambda: backends("rundesk:worker", state="active") == 0,
            10,
            "the worker's statements in flight",
            worker,
        )
        left = dict(Action.objects.filter(run_id=run_id).values_list("step_key", "state"))
        if (
            ActionState.DISPATCHED in left.values()
            and ActionState.COMPLETED in left.values()
            and "compose" not in left
        ):
            if whole_node:
                worker.kill()
            else:
                os.kill(pid, signal.SIGKILL)
            return run_id, left
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.02)
    raise AssertionError("no run caught between a read's boundary and its receipt")


@dataclass
class Kill:
    """Runs sent while a worker was killed, and what the kill left."""

    run_ids: list[int]
    tasks: dict[str, int]  # task id -> run id
    run: int  # the run whose owner was killed
    left: dict[str, str]  # the state of each of its actions at the kill
    executions: Counter[str]  # the tool journal at the kill


def kill_while_running(
    broker: Broker,
    journal: Journal,
    victim: Worker,
    survivor: Worker,
    *,
    whole_node: bool,
    runs: int,
) -> Kill:
    """Sends `runs` slow runs (each action 150 ms: a read is in flight most
    of the time), kills a pool process of `victim` (or all of it)
    mid-read, and waits until every run has ended and its completion is
    logged."""
    run_ids = slow_runs(runs, ms=150)
    tasks = dict(zip(broker.send(run_ids), run_ids, strict=True))
    run, left = kill_mid_read(run_ids, victim, whole_node=whole_node)
    kill = Kill(run_ids, tasks, run, left, journal.counts())
    wait_until(lambda: not active(run_ids), 60, "runs still active", survivor)
    wait_written([victim, survivor], run_ids, tasks)
    return kill


def assert_nothing_ran_twice_but_the_read_in_flight(kill: Kill, journal: Journal) -> None:
    """runs/dispatch.py's rules, as the next owner must have applied them:
    an action with a receipt is never dispatched again; a read with a
    boundary and no receipt is dispatched again under its own identity; an
    effect is dispatched once.  So every action has one receipt, written by
    the epoch of its last dispatch; the delivery ran once; the only action
    dispatched twice is the read the kill caught between boundary and
    receipt, and it ran once more than it had when its owner died (that
    owner may have died before or after the tool ran: the journal line is
    written when it has)."""
    counts, killed, left, before = journal.counts(), kill.run, kill.left, kill.executions
    # The agent dispatches one action at a time: one was caught in flight,
    # a read (reading a document or summarising it).
    (caught,) = (key for key, state in left.items() if state == ActionState.DISPATCHED)
    assert caught.split(":")[0] in ("read", "summarize")
    for action in Action.objects.filter(run_id__in=kill.run_ids).select_related("receipt"):
        n, name = counts[action.identity], action.identity
        assert action.state == ActionState.COMPLETED, name
        assert action.receipt.epoch == action.epoch, name
        if action.run_id == killed and action.step_key == caught:
            assert (action.attempts, action.epoch) == (2, 2), name
            assert before[name] in (0, 1) and n == before[name] + 1, name
        else:
            assert action.attempts == 1 and n == 1, name
        if action.run_id == killed and left.get(action.step_key) == ActionState.COMPLETED:
            assert action.epoch == 1, name  # its receipt was reused, not replaced
    assert counts[identity(killed, "deliver")] == 1
    keys = steps(THREE_DOCS)
    assert set(counts) == {identity(run_id, key) for run_id in kill.run_ids for key in keys}
    # The killed run was claimed once more, and completed once.
    run = Run.objects.get(pk=killed)
    assert (run.status, run.lease_epoch) == (RunStatus.COMPLETED, 2)
    assert run.events.filter(kind=EventKind.RUN_COMPLETED).count() == 1
    others = Run.objects.filter(pk__in=kill.run_ids).exclude(pk=killed)
    assert set(others.values_list("status", "lease_epoch")) == {(RunStatus.COMPLETED, 1)}


def test_a_pool_process_killed_mid_run_is_handed_back_by_reject_on_worker_lost(
    celery_broker, kill_env, journal, tmp_path
):
    # One node of two pool processes, no beat, no executor: when a pool
    # process dies, the node rejects its task back to the broker
    # (acks_late + reject_on_worker_lost), on every broker; nothing else
    # would ever execute the run again.
    (worker,) = ready(start_node(kill_env, tmp_path, celery_broker, "node0", concurrency=2))
    try:
        kill = kill_while_running(celery_broker, journal, worker, worker, whole_node=False, runs=4)
    finally:
        halt(worker)

    # The killed process's task came back to the node (its own task id) and
    # resumed the run once the dead owner's lease had expired (retrying
    # until then): each run's task completed it, once.
    assert worker.output().count(f"execute_run[{task_of(kill.tasks, kill.run)}] received") >= 2
    # The node's log says what else became of a run (released, requeued).
    assert completed_by_tasks([worker], kill.tasks) == Counter(kill.run_ids), worker.output()
    assert_nothing_ran_twice_but_the_read_in_flight(kill, journal)


def test_a_worker_node_killed_mid_run_its_run_goes_to_the_other_node(
    celery_broker, kill_env, journal, tmp_path
):
    # Two nodes of one pool process each, a run each; node 0 dies whole
    # (a machine lost).  RabbitMQ gives its unacknowledged task back when its
    # connection closes, Redis after the visibility timeout: no beat runs
    # then, so the task's own redelivery is what resumes the run.  The
    # filesystem broker has no acknowledgements, the task is lost with the
    # node: beat's sweep (embedded in node 1) requeues the run and sends a
    # new one.
    redelivers = celery_broker.gives_back_lost_consumers_messages
    dying, other = ready(
        start_node(kill_env, tmp_path, celery_broker, "dying"),
        start_node(kill_env, tmp_path, celery_broker, "other", beat=not redelivers),
    )
    try:
        kill = kill_while_running(celery_broker, journal, dying, other, whole_node=True, runs=2)
    finally:
        halt(dying, other)

    requeued = Run.objects.get(pk=kill.run).events.filter(kind=EventKind.RUN_REQUEUED).exists()
    redelivered = f"execute_run[{task_of(kill.tasks, kill.run)}] received" in other.output()
    assert (redelivered, requeued) == (redelivers, not redelivers)
    # Each run completed once: by its own task, or the killed one, on the
    # filesystem broker, by the task the sweep sent (an id not ours: -1).
    by_tasks = Counter(kill.run_ids)
    if not redelivers:
        by_tasks[kill.run], by_tasks[-1] = 0, 1
    assert completed_by_tasks([dying, other], kill.tasks) == +by_tasks
    assert_nothing_ran_twice_but_the_read_in_flight(kill, journal)


# -- bench --scale ----------------------------------------------------------------


def test_bench_scale_times_runs_through_real_worker_processes(tmp_path):
    broker = Broker.own(FILESYSTEM, tmp_path / "broker")
    measured = scale.measure(broker, 1, 5, tmp_path / "bench")
    assert (measured["workers"], measured["runs"]) == (1, 5) and measured["runs_per_s"] > 0
    batch = Run.objects.filter(question__startswith="bench --scale: batch")
    assert sorted(batch.values_list("status", flat=True)) == [RunStatus.COMPLETED] * 5


def test_bench_scale_says_when_its_broker_does_not_answer():
    with pytest.raises(CommandError, match="does not answer"):
        call_command("bench", "--scale", "--broker", "redis://127.0.0.1:1/0")


# -- beat's sweep behind a backlog ----------------------------------------------


@pytest.mark.parametrize("celery_broker", ["filesystem"], indirect=True)
def test_beats_sweep_ends_a_dead_owners_cancelled_run_while_the_workers_are_busy(
    celery_broker, kill_env, tmp_path
):
    # With Celery only (beat embedded, no executor), the sweep is what ends
    # the run of an owner that died after a cancel was asked (runs/sweep.py).
    # An executor sweeps "busy or idle: a backlog of runs never keeps
    # settled runs waiting" (Executor._sweep_if_due); beat runs its sweep
    # itself (runs.tasks.SweepingScheduler), so it does not wait behind the
    # backlog in the queue either.
    (worker,) = ready(start_node(kill_env, tmp_path, celery_broker, "node0", beat=True))
    try:
        backlog = slow_runs(4)  # about 9 s of work for the one pool process
        celery_broker.send(backlog)
        wait_until(lambda: holder(backlog, worker), 30, "the backlog did not start", worker)
        # From here on, a task sent now would wait behind three runs.
        dead = submission.submit(question="Compare", documents=THREE_DOCS)
        assert Lease.claim(dead.pk, "dead-owner") is not None
        assert dead.request_cancel(by="alice")
        Run.objects.filter(pk=dead.pk).update(lease_expires_at=Now() - dt.timedelta(seconds=1))
        expired = time.monotonic()
        ended = Run.objects.filter(pk=dead.pk, status=RunStatus.CANCELLED)
        wait_until(ended.exists, 60, "the dead owner's run was never ended", worker)
        waited, still_active = time.monotonic() - expired, active(backlog)
    finally:
        halt(worker)  # mid-backlog

    # Due every 0.5 s: ended within a few sweeps, not once the backlog is done.
    assert waited < 3 and still_active, f"ended {waited:.1f} s after its owner's lease expired"

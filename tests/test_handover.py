"""A run made runnable reaches a worker at once, in every deployment.

Every transition into `queued` (runs/lifecycle.py) hands the run to a Celery
worker once its transaction commits, whoever takes it: an operator's
decision or resume, a settlement, an owner whose item was settled while it
stopped, an owner that gives the run back, the sweep.  With only Celery
workers (and beat), the run no longer waits for the sweep's redelivery
(RUNDESK_REDELIVER_SECONDS, 60 s by default: left as it is here).

The workers look at the broker's folder every 50 ms (`polled_often`), and
are killed once what a test asserts is written: Celery notices a SIGTERM
only when its loop next wakes, 3 s later on this broker.
"""

from __future__ import annotations

import ast
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.db import connection, transaction

from runs import sweep
from runs.handover import INSTALLATION_QUEUE
from runs.leases import Lease
from runs.models import OperatorDecision, Receipt, Run, RunEvent, RunStatus
from runs.submission import submit
from runs.tasks import execute_run
from runs.timeline import EventKind
from tests.conftest import manage
from tests.processes import Worker, polled_often, wait_until
from tests.processes import broker as broker

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

DOCS = ["northwind-clean-energy.md", "meridian-world-equity.md", "crestline-short-treasury.md"]
# From the commit that made the run runnable to the run completed.
AT_ONCE = 5.0


@pytest.fixture
def fresh_producers(broker: Path) -> Iterator[None]:
    """This process's Celery producers made anew for `broker`: the app's
    pooled connections keep the broker folder of the test that made them (a
    harness need of this file only; tests/processes.enqueue opens a
    connection of its own instead, which a hand-over after commit cannot)."""
    _drop_producers()
    yield
    _drop_producers()


def _drop_producers() -> None:
    app = execute_run.app
    if app._pool is not None:
        app._pool.force_close_all()
    app._pool = None
    app.amqp._producer_pool = None


def handed_over(folder: Path) -> list[tuple[int, str]]:
    """The execute_run tasks waiting in the filesystem broker: (run id, queue)."""
    tasks = []
    for path in sorted(folder.iterdir()):
        message = json.loads(path.read_text())
        if message["headers"]["task"] == execute_run.name:
            (run_id,) = ast.literal_eval(message["headers"]["argsrepr"])
            tasks.append((run_id, path.name.split(".")[-2]))
    return tasks


def status(run: Run) -> str:
    return Run.objects.values_list("status", flat=True).get(pk=run.pk)


def waiting_run(**submitted: object) -> Run:
    """A run that waits for an operator and that no item holds: only a
    decision on the run lets it go on."""
    run = submit(question="q", documents=["northwind-clean-energy.md"], **submitted)
    lease = Lease.claim(run.pk, "first-owner")
    assert lease is not None
    assert lease.finish(RunStatus.NEEDS_OPERATOR, "waits for a person") == RunStatus.NEEDS_OPERATOR
    return run


def celery_only(process_env: dict[str, str]) -> dict[str, str]:
    """A worker's environment with the redelivery interval at its default."""
    env = {k: v for k, v in process_env.items() if k != "RUNDESK_REDELIVER_SECONDS"}
    assert env.get("RUNDESK_SWEEP_SECONDS") is None
    return env


def test_an_operators_decision_on_a_waiting_run_completes_it_within_seconds_with_only_celery(
    process_env, journal, tmp_path, broker, operator_user
):
    env = celery_only(process_env)
    run = waiting_run()
    worker = Worker(env, tmp_path / "worker.log", broker=polled_often(), beat=True)
    try:
        worker.wait_ready()
        decided = manage(
            "outcomes", "decide-run", str(run.pk), "--choice", "resume",
            "--reason", "checked with the receiver", "--as", operator_user.username, "--json",
            env=env,
        )  # fmt: skip
        out, err = decided.communicate(timeout=60)
        assert decided.returncode == 0, err
        assert json.loads(out)["run"]["status"] == RunStatus.QUEUED
        wait_until(lambda: status(run) == RunStatus.COMPLETED, 30, "run not completed", worker)
        wait_until(lambda: "'completed'" in worker.output(), 10, "task not logged", worker)
    finally:
        worker.kill()
    run.refresh_from_db()
    decision = OperatorDecision.objects.get(run=run)
    elapsed = (run.finished_at - decision.created_at).total_seconds()
    assert elapsed <= AT_ONCE, f"completed {elapsed:.1f} s after the decision"
    assert run.lease_epoch == 2 and "'completed'" in worker.output()


def test_a_run_an_executor_gives_back_as_it_stops_completes_within_seconds_on_celery(
    process_env, journal, tmp_path, broker
):
    env = celery_only(process_env)
    run = submit(
        question="Compare these funds", documents=DOCS, faults=[{"point": "tool_delay", "ms": 150}]
    )
    worker = Worker(env, tmp_path / "worker.log", broker=polled_often(), beat=True)
    executor = None
    try:
        worker.wait_ready()
        executor = manage("executor", "--run", str(run.pk), env=env, start_new_session=True)
        wait_until(
            lambda: Receipt.objects.filter(run=run).exists(), 40, "the executor did not start"
        )
        os.killpg(executor.pid, signal.SIGTERM)
        executor.communicate(timeout=60)
        released = RunEvent.objects.filter(run=run, kind=EventKind.LEASE_RELEASED)
        wait_until(released.exists, 10, "the executor did not give the run back")
        wait_until(lambda: status(run) == RunStatus.COMPLETED, 30, "run not completed", worker)
        claims = RunEvent.objects.filter(run=run, kind=EventKind.LEASE_ACQUIRED, data__epoch=2)
        wait_until(claims.exists, 10, "the worker's claim not on the timeline", worker)
    finally:
        if executor is not None and executor.poll() is None:
            os.killpg(executor.pid, signal.SIGKILL)
        worker.kill()
    # The worker claimed it (epoch 2) at once, not a redelivery interval later.
    claimed = claims.get()
    elapsed = (claimed.created_at - released.get().created_at).total_seconds()
    assert elapsed <= AT_ONCE, f"claimed by the worker {elapsed:.1f} s after it was given back"
    assert Run.objects.get(pk=run.pk).lease_epoch == 2


def test_every_way_into_the_queue_hands_the_run_over_once_committed(broker, fresh_producers):
    # An owner that gives the run back (autocommit: at once).
    released = submit(question="q", documents=["a.md"])
    Lease.claim(released.pk, "owner").release()
    assert handed_over(broker) == [(released.pk, INSTALLATION_QUEUE)]

    # A resume: only once its transaction commits, and not if it rolls back.
    resumed = waiting_run()
    with transaction.atomic():
        assert Run.objects.resume_if_settled(resumed.pk, "settled")
        assert (resumed.pk, INSTALLATION_QUEUE) not in handed_over(broker)
    assert (resumed.pk, INSTALLATION_QUEUE) in handed_over(broker)
    rolled_back = waiting_run()
    with pytest.raises(RuntimeError), transaction.atomic():
        assert Run.objects.resume_if_settled(rolled_back.pk, "settled")
        raise RuntimeError("the decision failed after it")
    assert rolled_back.pk not in dict(handed_over(broker))
    assert status(rolled_back) == RunStatus.NEEDS_OPERATOR

    # The sweep's requeue of a run whose owner stopped renewing its lease.
    abandoned = submit(question="q", documents=["a.md"])
    Lease.claim(abandoned.pk, "dead-owner")
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE runs_run SET lease_expires_at = now() - interval '1 second' WHERE id = %s",
            [abandoned.pk],
        )
    assert sweep.sweep().requeued == [abandoned.pk]
    assert (abandoned.pk, INSTALLATION_QUEUE) in handed_over(broker)
    assert len(handed_over(broker)) == 3


def test_a_drills_run_made_runnable_goes_to_its_labs_queue(broker, fresh_producers, settings):
    # Its queue, declared as the lab's worker declares it when it starts.
    app = execute_run.app
    with app.connection_for_write() as conn:
        app.amqp.queues[settings.RUNDESK_DRILL_QUEUE].bind(conn.default_channel).declare()
    drill = submit(question="q", documents=["a.md"], drill=True)
    settings.RUNDESK_DRILL_LAB = True
    Lease.claim(drill.pk, "lab-owner").release()
    assert handed_over(broker) == [(drill.pk, settings.RUNDESK_DRILL_QUEUE)]


def test_redelivery_refreshes_and_hands_out_only_the_runs_of_the_sweeps_own_kind(settings):
    installation = submit(question="q", documents=["a.md"])
    drill = submit(question="q", documents=["a.md"], drill=True)

    def queued_at() -> dict[int, object]:
        return dict(Run.objects.values_list("pk", "queued_at"))

    before = queued_at()
    assert Run.objects.waiting_in_queue(0) == [installation.pk]
    installations = queued_at()
    assert installations[installation.pk] > before[installation.pk]
    assert installations[drill.pk] == before[drill.pk]

    settings.RUNDESK_DRILL_LAB = True
    assert Run.objects.waiting_in_queue(0) == [drill.pk]
    labs = queued_at()
    assert labs[drill.pk] > before[drill.pk]
    assert labs[installation.pk] == installations[installation.pk]

"""Lock waits: the sampler sees who waits for whom among Rundesk's
connections (real concurrent sessions), and the contention reproduction
shows the old capture closing the cycle and the repaired one not."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from io import StringIO

import psycopg
import pytest
from django.core.management import call_command
from django.db import DatabaseError, connection

from evidence.locks import Edge, Graph, LockSampler, describe_application, sample
from evidence.models import CaptureGap, IncidentSource, LockIncident
from runs.submission import submit
from tests.conftest import database_url
from tests.faultruns import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def session(name: str) -> psycopg.Connection:
    conn = psycopg.connect(database_url(), application_name=name)
    conn.execute("SET deadlock_timeout = '30s'")  # the test, not the detector, watches
    return conn


def waiting(count: int) -> bool:
    return len(sample().edges) >= count


def test_roles_and_runs_are_read_from_application_name():
    assert describe_application("rundesk:capture:run-42") == ("capture", 42)
    assert describe_application("rundesk:executor") == ("executor", None)
    assert describe_application("psql") == ("psql", None)


def test_cycle_is_found_in_wait_for_order():
    graph = Graph(edges=[Edge(1, 2), Edge(2, 3), Edge(3, 1), Edge(4, 1)])
    assert graph.cycle() == [1, 2, 3]
    assert Graph(edges=[Edge(1, 2), Edge(2, 3)]).cycle() == []


def test_sampler_records_a_wait_with_roles_runs_and_the_lock_then_closes_it():
    run = submit(question="q", documents=["a.md"])
    holder = session(f"rundesk:executor:run-{run.pk}")
    waiter = session(f"rundesk:publication:run-{run.pk}")
    pids = (waiter.info.backend_pid, holder.info.backend_pid)
    holder.execute("UPDATE runs_run SET status_reason = 'held' WHERE id = %s", (run.pk,))
    blocked = threading.Thread(
        target=lambda: waiter.execute("SELECT 1 FROM runs_run WHERE id = %s FOR SHARE", (run.pk,))
    )
    blocked.start()
    try:
        wait_for(lambda: waiting(1))
        sampler = LockSampler(active=lambda: True)
        sampler.tick()
        sampler.tick()
    finally:
        holder.rollback()
        blocked.join(10)
        waiter.rollback()
    sampler.tick()  # nothing waits any more: the incident closes

    incident = LockIncident.objects.get(source=IncidentSource.SAMPLER)
    assert incident.ended_at is not None and not incident.has_cycle
    wait = incident.waits.get()
    assert (wait.waiter_role, wait.waiter_run_id, wait.blocker_role, wait.blocker_run_id) == (
        "publication",
        run.pk,
        "executor",
        run.pk,
    )
    assert (wait.waiter_pid, wait.blocker_pid) == pids
    assert wait.lock_type == "transactionid" and wait.mode == "ShareLock"
    assert "FOR SHARE" in wait.waiter_query
    holder.close()
    waiter.close()


def test_a_sampler_that_stops_during_a_wait_ends_its_incident():
    """Its executor stopped: the incident stayed open for good ("—")."""
    holder = session("psql")
    waiter = session("rundesk:executor:run-7")
    holder.execute("LOCK TABLE runs_receipt IN SHARE MODE")
    blocked = threading.Thread(
        target=lambda: waiter.execute("INSERT INTO runs_receipt SELECT * FROM runs_receipt")
    )
    blocked.start()
    stop = threading.Event()
    sampler = LockSampler(active=lambda: True, interval=0.05)
    serving = threading.Thread(target=sampler.serve, args=(stop,))
    try:
        wait_for(lambda: waiting(1))
        serving.start()
        wait_for(lambda: LockIncident.objects.filter(source=IncidentSource.SAMPLER).exists())
        stop.set()
        serving.join(10)
        incident = LockIncident.objects.get(source=IncidentSource.SAMPLER)
        assert incident.ended_at is not None and sampler.incident is None
    finally:
        stop.set()
        holder.close()
        blocked.join(10)
        waiter.close()


@pytest.mark.parametrize(
    ("held_by", "waits", "locked"),
    [
        (
            "LOCK TABLE runs_receipt IN SHARE MODE",
            "INSERT INTO runs_receipt SELECT * FROM runs_receipt WHERE false",
            "runs_receipt",
        ),
        (
            "SELECT pg_advisory_lock(9876543210123)",
            "SELECT pg_advisory_lock(9876543210123)",
            "advisory lock [{db},2299,2413396619,1]",
        ),
    ],
    ids=["table", "advisory-bigint"],
)
def test_a_stranger_keeps_its_own_name_and_the_lock_is_named_as_the_server_does(
    held_by, waits, locked
):
    """psql holding runs_receipt was shown as Rundesk's receipt writer, and
    a bigint advisory key by its low 32 bits alone."""
    stranger = psycopg.connect(database_url(), application_name="psql")
    waiter = session("rundesk:executor:run-7")
    stranger.execute(held_by)
    blocked = threading.Thread(target=lambda: waiter.execute(waits))
    blocked.start()
    try:
        wait_for(lambda: waiting(1))
        graph = sample()
    finally:
        stranger.close()
        blocked.join(10)
        waiter.close()
    (edge,) = graph.edges
    assert graph.processes[edge.blocker].role == "psql"
    with connection.cursor() as cursor:
        cursor.execute("SELECT oid FROM pg_database WHERE datname = current_database()")
        (db,) = cursor.fetchone()
    assert edge.locked == locked.format(db=db)


def test_a_sample_bounds_its_own_lock_waits_and_a_failed_one_leaves_the_incident_as_it_was(
    settings,
):
    settings.RUNDESK_CAPTURE_LOCK_TIMEOUT_MS = 100
    run = submit(question="q", documents=["a.md"])
    holder = session(f"rundesk:executor:run-{run.pk}")
    waiter = session(f"rundesk:publication:run-{run.pk}")
    holder.execute("UPDATE runs_run SET status_reason = 'held' WHERE id = %s", (run.pk,))
    blocked = threading.Thread(
        target=lambda: waiter.execute("SELECT 1 FROM runs_run WHERE id = %s FOR SHARE", (run.pk,))
    )
    blocked.start()
    sampler = LockSampler(active=lambda: True)
    try:
        wait_for(lambda: waiting(1))
        with session("psql") as other:
            # The sample makes its incident, then waits on its first wait's table.
            other.execute("LOCK TABLE evidence_lockwait IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            with pytest.raises(DatabaseError, match="lock timeout"):
                sampler.tick()
            assert time.monotonic() - started < 5
            other.rollback()
        assert sampler.incident is None and not LockIncident.objects.exists()
        sampler.tick()  # the next sample is stored, with a new incident
    finally:
        holder.rollback()
        blocked.join(10)
        waiter.rollback()
    assert LockIncident.objects.get().waits.count() == 1
    # The bound was the sample's own: the session keeps the server's setting.
    with connection.cursor() as cursor:
        cursor.execute("SELECT setting FROM pg_settings WHERE name = 'lock_timeout'")
        (server_default,) = cursor.fetchone()
        cursor.execute("SELECT current_setting('lock_timeout')")
        assert cursor.fetchone()[0] in (server_default, f"{server_default}ms")
    holder.close()
    waiter.close()


def test_sampler_detects_a_cycle_before_the_deadlock_detector_breaks_it():
    first = submit(question="q", documents=["a.md"])
    second = submit(question="q", documents=["a.md"])
    a, b = session("rundesk:capture:run-1"), session("rundesk:publication:run-2")
    pids = sorted([a.info.backend_pid, b.info.backend_pid])
    a.execute("UPDATE runs_run SET status_reason = 'a' WHERE id = %s", (first.pk,))
    b.execute("UPDATE runs_run SET status_reason = 'b' WHERE id = %s", (second.pk,))
    threads = [
        threading.Thread(
            target=_try,
            args=(a, "UPDATE runs_run SET status_reason = 'a' WHERE id = %s", second.pk),
        ),
        threading.Thread(
            target=_try, args=(b, "UPDATE runs_run SET status_reason = 'b' WHERE id = %s", first.pk)
        ),
    ]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: waiting(2))
        sampler = LockSampler(active=lambda: True)
        sampler.tick()
    finally:
        a.cancel()  # breaks the cycle
        for thread in threads:
            thread.join(10)
        a.rollback()
        b.rollback()
        a.close()
        b.close()
    incident = LockIncident.objects.get(source=IncidentSource.SAMPLER)
    assert incident.has_cycle and incident.processes == 2
    assert sorted(incident.cycle) == pids


def _try(conn: psycopg.Connection, sql: str, *params: object) -> None:
    with contextlib.suppress(psycopg.Error):
        conn.execute(sql, params)


def reproduce(policy: str, trials: int) -> dict:
    out = StringIO()
    call_command(
        "reproduce_contention",
        "--policy",
        policy,
        "--trials",
        str(trials),
        "--deadlock-timeout-ms",
        "200",
        "--json",
        stdout=out,
    )
    return json.loads(out.getvalue())


def test_the_old_capture_policy_really_deadlocks_with_publication():
    report = reproduce("wait", 2)
    assert report["deadlocks"] >= 1
    # The detector broke the cycle after deadlock_timeout: publication was its
    # victim, or waited that long.
    assert report["publications_failed"] >= 1 or report["publication_ms"]["max"] >= 200
    incident = LockIncident.objects.filter(source=IncidentSource.REPRODUCTION).first()
    assert incident is not None and incident.has_cycle and incident.processes == 3
    roles = set(incident.waits.values_list("waiter_role", flat=True))
    assert roles == {"capture", "publication", "source refresh"}


def test_the_repaired_capture_never_deadlocks_and_never_fails_a_publication():
    report = reproduce("nowait", 3)
    assert report["deadlocks"] == 0
    assert report["publications_failed"] == 0 and report["publications_committed"] == 3
    assert report["capture_saved"] + report["capture_saved_later"] + report["capture_gaps"] == 3
    # Each copy that could not take its lock left a gap at once; those a
    # try again saved once the contention passed say so.
    gaps = CaptureGap.objects.filter(run_id=report["run_id"], reason="lock_not_available")
    assert sum(gaps.values_list("count", flat=True)) == 3 - report["capture_saved"]
    assert gaps.filter(saved_at__isnull=False).count() == report["capture_saved_later"]
    assert report["copies_stored"] == report["capture_saved"] + report["capture_saved_later"]

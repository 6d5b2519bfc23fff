"""Deadlock reports, read from server logs (any log_line_prefix, with noise
around them) and from application output quoting a real deadlock."""

from __future__ import annotations

import contextlib
import json
import threading
import traceback
from io import StringIO

import psycopg
import pytest
from django.core.management import CommandError, call_command

from evidence import pglog
from evidence.models import IncidentSource, LockIncident
from tests.conftest import database_url

pytestmark = pytest.mark.django_db(transaction=True)

# log_line_prefix = '%m [%p] %q%u@%d ' (Debian's default), three processes,
# transaction and tuple locks, between unrelated lines.
THREE_WAY = """\
2026-11-29 10:00:00.123 UTC [4101] LOG:  checkpoint starting: time
2026-11-29 10:00:01.456 UTC [4102] rundesk@app ERROR:  deadlock detected
2026-11-29 10:00:01.456 UTC [4102] rundesk@app DETAIL:  Process 4102 waits for ShareLock on \
transaction 9001; blocked by process 4103.
\tProcess 4103 waits for ShareLock on transaction 9002; blocked by process 4104.
\tProcess 4104 waits for ExclusiveLock on tuple (0,7) of relation 16402 of database 16384; \
blocked by process 4102.
\tProcess 4102: SELECT id FROM evidence_modelcall WHERE id = 7 FOR SHARE
\tProcess 4103: UPDATE evidence_modelcall SET published_revision = 2 WHERE run_id = 3
\tProcess 4104: UPDATE evidence_source SET changed = false WHERE id = 5
2026-11-29 10:00:01.456 UTC [4102] rundesk@app HINT:  See server log for query details.
2026-11-29 10:00:01.456 UTC [4102] rundesk@app CONTEXT:  while locking tuple (0,7) in relation \
"evidence_modelcall"
2026-11-29 10:00:01.456 UTC [4102] rundesk@app STATEMENT:  SELECT id FROM evidence_modelcall \
WHERE id = 7 FOR SHARE
2026-11-29 10:00:02.000 UTC [4105] rundesk@app ERROR:  relation "missing" does not exist
2026-11-29 10:00:02.000 UTC [4105] rundesk@app STATEMENT:  SELECT * FROM missing
"""

# log_line_prefix = '%t ' (no pid): a relation lock and an advisory lock.
NO_PID = """\
2026-11-29 11:00:00 UTC LOG:  database system is ready to accept connections
2026-11-29 11:00:05 UTC ERROR:  deadlock detected
2026-11-29 11:00:05 UTC DETAIL:  Process 200 waits for AccessExclusiveLock on relation 16390 of \
database 16384; blocked by process 201.
\tProcess 201 waits for ExclusiveLock on advisory lock [16384,0,42,1]; blocked by process 200.
\tProcess 200: LOCK TABLE evidence_modelcall IN ACCESS EXCLUSIVE MODE
\tProcess 201: SELECT pg_advisory_xact_lock(42)
2026-11-29 11:00:05 UTC HINT:  See server log for query details.
2026-11-29 11:00:05 UTC STATEMENT:  LOCK TABLE evidence_modelcall IN ACCESS EXCLUSIVE MODE
2026-11-29 11:00:06 UTC LOG:  could not receive data from client: Connection reset by peer
"""


def test_three_process_cycle_with_tuple_and_transaction_locks():
    (report,) = pglog.parse(THREE_WAY)
    data = report.as_json()
    assert data["edges"] == [
        {"waiter": 4102, "blocker": 4103, "lock": "ShareLock", "on": "transaction 9001"},
        {"waiter": 4103, "blocker": 4104, "lock": "ShareLock", "on": "transaction 9002"},
        {
            "waiter": 4104,
            "blocker": 4102,
            "lock": "ExclusiveLock",
            "on": "tuple (0,7) of relation 16402 of database 16384",
        },
    ]
    assert data["cycle"] == [4102, 4103, 4104]
    assert report.reporter == 4102
    assert report.statement == "SELECT id FROM evidence_modelcall WHERE id = 7 FOR SHARE"
    assert report.context.startswith("while locking tuple (0,7)")
    queries = {p["pid"]: p["query"] for p in data["processes"]}
    assert queries[4104] == "UPDATE evidence_source SET changed = false WHERE id = 5"
    assert [e.lock_type for e in report.graph.edges] == ["transaction", "transaction", "tuple"]


def test_prefix_without_pid_relation_and_advisory_locks():
    (report,) = pglog.parse(NO_PID)
    assert report.reporter is None
    assert [(e.waiter, e.blocker, e.lock_type) for e in report.graph.edges] == [
        (200, 201, "relation"),
        (201, 200, "advisory"),
    ]
    assert report.graph.cycle() == [200, 201]
    assert report.graph.processes[201].query == "SELECT pg_advisory_xact_lock(42)"


def test_a_crafted_long_line_is_not_searched_at_length():
    crafted = "deadlock detected\nDETAIL:  Process 1 waits for X on " + "a" * 200_000 + "\n"
    assert pglog.parse(crafted) == []
    assert (
        pglog.parse("deadlock detected\nProcess 7 waits for X on y; blocked by process 7.\n") == []
    )


def test_several_reports_and_nothing_else_are_found():
    assert len(pglog.parse(THREE_WAY + NO_PID + THREE_WAY)) == 3
    assert pglog.parse("LOG:  no problems here\nERROR:  deadlock detected\n") == []
    assert pglog.parse("") == []


def test_a_real_deadlock_quoted_by_application_output():
    """Two sessions deadlock for real; the psycopg traceback is the input."""
    with psycopg.connect(database_url()) as setup:
        setup.execute("CREATE TABLE deadlock_demo (id int PRIMARY KEY)")
        setup.execute("INSERT INTO deadlock_demo VALUES (1), (2)")
        setup.commit()
    a, b = psycopg.connect(database_url()), psycopg.connect(database_url())
    try:
        a.execute("UPDATE deadlock_demo SET id = id WHERE id = 1")
        b.execute("UPDATE deadlock_demo SET id = id WHERE id = 2")
        outputs: list[str] = []

        def cross(conn: psycopg.Connection, row: int) -> None:
            try:
                conn.execute("UPDATE deadlock_demo SET id = id WHERE id = %s", (row,))
            except psycopg.errors.DeadlockDetected as error:
                outputs.append("".join(traceback.format_exception(error)))
                conn.rollback()

        threads = [
            threading.Thread(target=cross, args=(a, 2)),
            threading.Thread(target=cross, args=(b, 1)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        pids = sorted([a.info.backend_pid, b.info.backend_pid])
    finally:
        for conn in (a, b):
            with contextlib.suppress(psycopg.Error):
                conn.rollback()
            conn.close()
        with psycopg.connect(database_url()) as teardown:
            teardown.execute("DROP TABLE deadlock_demo")

    (output,) = outputs
    assert "Traceback (most recent call last)" in output
    (report,) = pglog.parse("unrelated line\n" + output + "more output\n")
    assert sorted(report.graph.cycle()) == pids
    assert {e.lock_type for e in report.graph.edges} == {"transaction"}


def test_import_pg_log_stores_incidents_and_prints_them(tmp_path):
    log = tmp_path / "postgresql.log"
    log.write_text(THREE_WAY + NO_PID)
    out = StringIO()
    call_command("import_pg_log", str(log), "--json", stdout=out)
    printed = json.loads(out.getvalue())["incidents"]
    assert [incident["cycle"] for incident in printed] == [[4102, 4103, 4104], [200, 201]]
    assert set(printed[0]) >= {"processes", "edges", "cycle"}
    incidents = LockIncident.objects.filter(source=IncidentSource.LOG).order_by("id")
    assert [(i.processes, i.has_cycle) for i in incidents] == [(3, True), (2, True)]
    wait = incidents[0].waits.get(waiter_pid=4104)
    assert (wait.blocker_pid, wait.mode, wait.lock_type) == (4102, "ExclusiveLock", "tuple")
    assert wait.waiter_query == "UPDATE evidence_source SET changed = false WHERE id = 5"


def test_import_pg_log_refuses_a_missing_file_with_a_clear_error(tmp_path):
    with pytest.raises(CommandError, match=r"cannot read .*missing\.log: No such file"):
        call_command("import_pg_log", str(tmp_path / "missing.log"))
    assert not LockIncident.objects.exists()

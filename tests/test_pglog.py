"""Deadlock reports, read from server logs (any log_line_prefix, with noise
around them) and from application output quoting a real deadlock; what a
report that cannot be read in full becomes; the import_pg_log command.
(Formats, languages, clients, noise and the pages have files of their own:
tests/test_pglog_*.py.)"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import traceback
from io import BytesIO, StringIO
from types import SimpleNamespace

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


def test_a_crafted_long_line_is_said_unread_in_bounded_time():
    line = "Process 1 waits for X on" + " Process 1 waits for X on" * 8_000
    crafted = f"deadlock detected\nDETAIL:  {line}\n"
    started = time.monotonic()
    (report,) = pglog.parse(crafted)
    assert time.monotonic() - started < 2
    assert report.graph.edges == []
    assert report.unread[0] == f"a line of {len(line)} characters was not read"


def test_a_waits_for_line_naming_its_own_process_is_left_out_and_said():
    (report,) = pglog.parse(
        "deadlock detected\nProcess 7 waits for X on y; blocked by process 7.\n"
    )
    assert report.graph.edges == []
    assert "process 7's waits-for line names itself: left out" in report.unread


def test_several_reports_are_found_and_a_report_without_detail_is_kept_and_said():
    assert len(pglog.parse(THREE_WAY + NO_PID + THREE_WAY)) == 3
    (bare,) = pglog.parse("LOG:  no problems here\nERROR:  deadlock detected\n")
    assert bare.graph.processes == {}
    assert bare.unread == [
        "the report has no DETAIL: which processes waited for what is not in the input"
    ]
    assert pglog.parse("") == []
    assert (
        pglog.parse("LOG:  retrying after deadlock detected\nERROR:  could not serialize\n") == []
    )


# A report cut short and garbled: 4508 is named as a blocker, its own line
# is missing; one line is not the server's; 4509's query is missing.
INCOMPLETE = """\
2026-11-29 12:00:00.000 UTC [4507] ERROR:  deadlock detected
2026-11-29 12:00:00.000 UTC [4507] DETAIL:  Process 4507 waits for ShareLock on transaction 31; \
blocked by process 4508.
\tProcess 4509 waits for ShareLock on transaction 32; blocked by process 4507.
\tProcess 4510 waits for ShareLock on transactio
\tProcess 4507: UPDATE accounts SET balance = 0 WHERE id = 1
\tProcess 4508: UPDATE accounts SET balance = 0 WHERE id = 2
"""


def test_a_report_not_read_in_full_keeps_what_it_could_and_lists_the_rest():
    (report,) = pglog.parse(INCOMPLETE)
    assert [(e.waiter, e.blocker) for e in report.graph.edges] == [(4507, 4508), (4509, 4507)]
    assert report.unread == [
        "DETAIL line not read: 'Process 4510 waits for ShareLock on transactio'",
        "process 4508's waits-for line not found",
        "the waits-for lines do not close a cycle",
        "process 4509's query not found",
    ]
    assert report.graph.processes[4508].query == "UPDATE accounts SET balance = 0 WHERE id = 2"


def test_a_query_over_several_lines_is_read_whole():
    log = THREE_WAY.replace(
        "\tProcess 4103: UPDATE evidence_modelcall SET published_revision = 2 WHERE run_id = 3\n",
        "\tProcess 4103: UPDATE evidence_modelcall\n\t    SET published_revision = 2\n"
        "\t    WHERE run_id = 3\n",
    )
    (report,) = pglog.parse(log)
    assert report.graph.processes[4103].query == (
        "UPDATE evidence_modelcall\n    SET published_revision = 2\n    WHERE run_id = 3"
    )
    assert report.unread == []


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
    assert report.context.startswith("while updating tuple")
    # A client is sent the report without the queries: said, not guessed.
    assert report.unread == [
        "no process's query is in the input (PostgreSQL sends clients the report without "
        "them; the server log has them)"
    ]


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


def test_a_log_imported_again_or_overlapping_the_last_stores_no_report_twice(tmp_path):
    """The rotated log an operator imports today holds yesterday's tail."""
    first, overlapping = tmp_path / "monday.log", tmp_path / "tuesday.log"
    first.write_text(THREE_WAY)
    overlapping.write_text(THREE_WAY + NO_PID)
    call_command("import_pg_log", str(first), stdout=StringIO())
    out = StringIO()
    call_command("import_pg_log", str(overlapping), "--json", stdout=out)
    printed = json.loads(out.getvalue())
    assert [incident["cycle"] for incident in printed["incidents"]] == [[200, 201]]
    assert printed["imported_before"] == 1
    out = StringIO()
    call_command("import_pg_log", str(overlapping), stdout=out)
    assert out.getvalue().splitlines() == [
        f"0 deadlock reports imported from {overlapping}",
        "  2 had been imported before (the same report, at the same time): not stored again.",
    ]
    assert LockIncident.objects.filter(source=IncidentSource.LOG).count() == 2


def test_a_report_with_no_time_imported_again_may_be_the_deadlock_again(tmp_path):
    log = tmp_path / "no-dates.log"
    log.write_text(THREE_WAY.replace("2026-11-29 ", ""))
    for _ in range(2):
        call_command("import_pg_log", str(log), stdout=StringIO())
    assert LockIncident.objects.filter(source=IncidentSource.LOG).count() == 2


def test_import_pg_log_prints_each_incident_with_what_it_could_not_read(tmp_path):
    log = tmp_path / "postgresql.log"
    log.write_text(THREE_WAY + INCOMPLETE)
    out = StringIO()
    call_command("import_pg_log", str(log), stdout=out)
    first, second = LockIncident.objects.order_by("id")
    assert out.getvalue().splitlines() == [
        f"2 deadlock reports imported from {log}",
        f"  incident {first.pk} (line 2): 4102 -> 4103 -> 4104 -> 4102, "
        "2026-11-29T10:00:01.456000+00:00",
        f"  incident {second.pk} (line 14): no cycle, 2026-11-29T12:00:00+00:00",
        "    not read: DETAIL line not read: 'Process 4510 waits for ShareLock on transactio'",
        "    not read: process 4508's waits-for line not found",
        "    not read: the waits-for lines do not close a cycle",
        "    not read: process 4509's query not found",
    ]
    assert first.unread == [] and len(second.unread) == 4
    assert (first.time_known, first.started_at.isoformat()) == (
        True,
        "2026-11-29T10:00:01.456000+00:00",
    )


def test_import_pg_log_refuses_a_missing_file_with_a_clear_error(tmp_path):
    with pytest.raises(CommandError, match=r"cannot read .*missing\.log: No such file"):
        call_command("import_pg_log", str(tmp_path / "missing.log"))
    assert not LockIncident.objects.exists()


def test_import_pg_log_refuses_input_not_in_its_format_and_imports_none_of_it(tmp_path):
    """A jsonlog file whose third line is cut: the report before it is not
    imported either, and the error says where and what to do."""
    entry = {"timestamp": "2026-11-29 10:00:01.456 UTC", "pid": 4102, "error_severity": "ERROR"}
    lines = [
        json.dumps({**entry, "message": "deadlock detected", "detail": NO_PID_DETAIL}),
        json.dumps({**entry, "error_severity": "LOG", "message": "checkpoint starting"}),
        '{"timestamp": "2026-11-29 10:00:02 UTC", "pid": 41',
    ]
    log = tmp_path / "postgresql.json"
    log.write_text("\n".join(lines) + "\n")
    with pytest.raises(CommandError, match=r"jsonlog line 3 is not JSON: .*nothing was imported"):
        call_command("import_pg_log", str(log))
    assert not LockIncident.objects.exists()
    # Read as text instead, the whole entries are still found.
    out = StringIO()
    call_command("import_pg_log", str(log), "--format", "stderr", "--json", stdout=out)
    (incident,) = json.loads(out.getvalue())["incidents"]
    assert incident["cycle"] == [200, 201]


def test_import_pg_log_reads_standard_input_and_refuses_an_unknown_format(monkeypatch):
    monkeypatch.setattr("sys.stdin", SimpleNamespace(buffer=BytesIO(THREE_WAY.encode())))
    out = StringIO()
    call_command("import_pg_log", "-", "--json", stdout=out)
    assert json.loads(out.getvalue())["incidents"][0]["cycle"] == [4102, 4103, 4104]
    with pytest.raises(CommandError, match="invalid choice: 'syslog'"):
        call_command("import_pg_log", "-", "--format", "syslog")


NO_PID_DETAIL = (
    "Process 200 waits for AccessExclusiveLock on relation 16390 of database 16384; "
    "blocked by process 201.\n"
    "Process 201 waits for ExclusiveLock on advisory lock [16384,0,42,1]; blocked by process 200."
)


# log_line_prefix = '%m ' (no pid): 101's first wait ended in its lock
# timeout, which names no process; later 101 deadlocks with 103 and 104,
# its new wait too short to be logged.  103's wait goes on to the report,
# past a checkpoint and 104's wait.
NO_PID_ENDED_WAIT = """\
2026-11-29 13:00:01.000 UTC LOG:  process 101 still waiting for ShareLock on transaction 7001 \
after 1000.100 ms
2026-11-29 13:00:01.000 UTC DETAIL:  Process holding the lock: 102. Wait queue: 101.
2026-11-29 13:00:02.000 UTC ERROR:  canceling statement due to lock timeout
2026-11-29 13:00:02.000 UTC CONTEXT:  while updating tuple (0,1) in relation "a"
2026-11-29 13:00:02.000 UTC STATEMENT:  UPDATE a SET x = 1 WHERE id = 1
2026-11-29 13:05:01.000 UTC LOG:  process 103 still waiting for ShareLock on transaction 7012 \
after 1000.200 ms
2026-11-29 13:05:01.000 UTC DETAIL:  Process holding the lock: 104. Wait queue: 103.
2026-11-29 13:05:01.200 UTC LOG:  checkpoint starting: time
2026-11-29 13:05:01.800 UTC LOG:  process 104 detected deadlock while waiting for ShareLock on \
transaction 7010 after 1000.300 ms
2026-11-29 13:05:01.800 UTC DETAIL:  Process holding the lock: 101. Wait queue: 104.
2026-11-29 13:05:01.800 UTC ERROR:  deadlock detected
2026-11-29 13:05:01.800 UTC DETAIL:  Process 104 waits for ShareLock on transaction 7010; \
blocked by process 101.
\tProcess 101 waits for ShareLock on transaction 7011; blocked by process 103.
\tProcess 103 waits for ShareLock on transaction 7012; blocked by process 104.
\tProcess 104: UPDATE a SET x = 4 WHERE id = 3
\tProcess 101: UPDATE a SET x = 1 WHERE id = 1
\tProcess 103: UPDATE a SET x = 3 WHERE id = 2
"""


def test_a_wait_a_message_naming_no_process_may_have_ended_is_no_lead_up_and_said():
    ((report, incident),) = pglog.import_log(NO_PID_ENDED_WAIT, "no-pid.log")
    assert [(w.waiter, w.holders) for w in report.lead_up] == [(103, [104]), (104, [101])]
    assert report.unread == [
        "process 101's lock wait (line 1) may have ended at line 3, whose message names no "
        "process (log_line_prefix has no %p): whether it still waited at the report cannot be "
        "told, so it is not stored"
    ]
    rows = incident.waits.filter(lead_up=True).order_by("id")
    assert [(w.waiter_pid, w.blocker_pid) for w in rows] == [(103, 104), (104, 101)]


# 201 waits for ShareLock on a table 200 writes (RowExclusiveLock) and 202
# reads (AccessShareLock, no conflict); 200 waits for AccessExclusiveLock,
# which every holder blocks.
SEVERAL_HOLDERS = """\
2026-11-29 14:00:01.000 UTC [201] LOG:  process 201 still waiting for ShareLock on relation \
16390 of database 16384 after 1000.000 ms
2026-11-29 14:00:01.000 UTC [201] DETAIL:  Processes holding the lock: 200, 202. Wait queue: 201.
2026-11-29 14:00:01.500 UTC [200] LOG:  process 200 detected deadlock while waiting for \
AccessExclusiveLock on relation 16391 of database 16384 after 1000.000 ms
2026-11-29 14:00:01.500 UTC [200] DETAIL:  Processes holding the lock: 201, 203. Wait queue: 200.
2026-11-29 14:00:01.500 UTC [200] ERROR:  deadlock detected
2026-11-29 14:00:01.500 UTC [200] DETAIL:  Process 200 waits for AccessExclusiveLock on relation \
16391 of database 16384; blocked by process 201.
\tProcess 201 waits for ShareLock on relation 16390 of database 16384; blocked by process 200.
\tProcess 200: LOCK TABLE b IN ACCESS EXCLUSIVE MODE
\tProcess 201: LOCK TABLE a IN SHARE MODE
"""


def test_a_wait_whose_holders_need_not_each_block_it_is_stored_and_said():
    ((report, incident),) = pglog.import_log(SEVERAL_HOLDERS, "holders.log")
    # Each holds the lock, and is stored; which of 201's blocked it the log does not say.
    assert report.unread == [
        "process 201's lock wait (line 1) names 2 processes holding the lock in modes the log "
        "does not give: not each of them need have blocked it"
    ]
    rows = incident.waits.filter(lead_up=True).order_by("id")
    assert [(w.waiter_pid, w.blocker_pid, w.mode) for w in rows] == [
        (201, 200, "ShareLock"),
        (201, 202, "ShareLock"),
        (200, 201, "AccessExclusiveLock"),
        (200, 203, "AccessExclusiveLock"),
    ]


def test_a_wait_a_pid_less_message_doubted_and_that_ended_leaves_no_doubt_on_later_ones():
    """The doubt is the wait's own: a later wait of other processes, logged
    after the doubted one was acquired and forgotten, is lead-up (it was
    once taken for the doubted one when the two shared an address)."""
    head = "2026-11-29 13:00:0{s}.000 UTC "
    for filler in range(12):
        log = (
            f"{head.format(s=1)}LOG:  process 101 still waiting for ShareLock on transaction 7001 "
            "after 1000.100 ms\n"
            f"{head.format(s=1)}DETAIL:  Process holding the lock: 102. Wait queue: 101.\n"
            f'{head.format(s=2)}ERROR:  duplicate key value violates unique constraint "u"\n'
            f"{head.format(s=3)}LOG:  process 101 acquired ShareLock on transaction 7001 after "
            "2000.100 ms\n"
            + "".join(f"{head.format(s=3)}LOG:  statement: SELECT {i}\n" for i in range(filler))
            + NO_PID_ENDED_WAIT.split("\n", 5)[5]
        )
        (report,) = pglog.parse(log)
        assert [w.waiter for w in report.lead_up] == [103, 104], filler
        assert report.unread == [], filler

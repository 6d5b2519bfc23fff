"""Noise around reports: other sessions' lines between a report's own,
duration and statement logging, several reports in one file, and the
log_lock_waits messages before a deadlock, which become the waits that led
to it, stored with its incident."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from evidence import pglog
from evidence.models import LockIncident

pytestmark = pytest.mark.django_db(transaction=True)

FIXTURES = Path(__file__).parent / "fixtures" / "pglog"


def at(clock: str) -> dt.datetime:
    return dt.datetime.fromisoformat(f"2026-11-29T{clock}+00:00")


def test_lead_up_waits_are_stored_with_their_incident_at_the_logs_times():
    ((_, incident),) = pglog.import_log((FIXTURES / "three_way.log").read_text(), "pg.log")
    assert (incident.time_known, incident.started_at) == (True, at("10:00:01.456"))
    edges = incident.waits.filter(lead_up=False).order_by("id")
    assert [(w.waiter_pid, w.blocker_pid, w.lock_type) for w in edges] == [
        (4102, 4103, "transaction"),
        (4103, 4104, "transaction"),
        (4104, 4102, "tuple"),
    ]
    lead_up = incident.waits.filter(lead_up=True).order_by("id")
    assert [
        (w.waiter_pid, w.blocker_pid, w.mode, w.locked, w.first_seen, w.last_seen, w.waited_ms)
        for w in lead_up
    ] == [
        (4103, 4104, "ShareLock", "transaction 9002", at("09:59:59.500"), at("10:00:00.500"), 1000),
        (
            4104,
            4102,
            "ExclusiveLock",
            "tuple (0,7) of relation 16402 of database 16384",
            at("10:00:00.100"),
            at("10:00:01.100"),
            1000,
        ),
        (4102, 4103, "ShareLock", "transaction 9001", at("10:00:00.455"), at("10:00:01.455"), 1000),
    ]
    # The queries the report gave are on the waits the log had before it.
    assert lead_up[1].waiter_query == "UPDATE evidence_source SET changed = false WHERE id = 5"
    assert incident.unread == []


TWO_DEADLOCKS = """\
2026-11-29 10:00:00.100 UTC [101] LOG:  process 101 still waiting for ShareLock on transaction 70 \
after 1000.000 ms
2026-11-29 10:00:00.100 UTC [101] DETAIL:  Process holding the lock: 102. Wait queue: 101.
2026-11-29 10:00:00.200 UTC [300] LOG:  process 300 still waiting for ShareLock on transaction 80 \
after 1000.000 ms
2026-11-29 10:00:00.200 UTC [300] DETAIL:  Process holding the lock: 301. Wait queue: 300.
2026-11-29 10:00:00.300 UTC [101] LOG:  process 101 acquired ShareLock on transaction 70 after \
1200.000 ms
2026-11-29 10:00:00.400 UTC [201] LOG:  process 201 still waiting for ExclusiveLock on \
relation 16390 of database 16384 after 1000.500 ms
2026-11-29 10:00:00.400 UTC [201] DETAIL:  Processes holding the lock: 200, 202. Wait queue: 201.
2026-11-29 10:00:00.450 UTC [205] LOG:  process 205 still waiting for ShareLock on transaction 90 \
after 1000.000 ms
2026-11-29 10:00:00.500 UTC [101] ERROR:  deadlock detected
2026-11-29 10:00:00.500 UTC [777] ERROR:  relation "missing" does not exist at character 15
2026-11-29 10:00:00.500 UTC [101] DETAIL:  Process 101 waits for ShareLock on transaction 71; \
blocked by process 102.
\tProcess 102 waits for ShareLock on transaction 72; blocked by process 101.
\tProcess 101: UPDATE a SET x = 1
\tProcess 102: UPDATE a SET x = 2
2026-11-29 10:00:00.500 UTC [777] STATEMENT:  SELECT * FROM missing
2026-11-29 10:00:00.500 UTC [101] HINT:  See server log for query details.
2026-11-29 10:00:00.900 UTC [888] LOG:  duration: 1.204 ms  statement: SELECT 1
2026-11-29 10:00:01.000 UTC [200] ERROR:  deadlock detected
2026-11-29 10:00:01.000 UTC [200] DETAIL:  Process 200 waits for ShareLock on transaction 73; \
blocked by process 201.
\tProcess 201 waits for ExclusiveLock on relation 16390 of database 16384; blocked by process 200.
\tProcess 205 waits for ShareLock on transaction 90; blocked by process 200.
\tProcess 200: UPDATE b SET x = 1
\tProcess 201: LOCK TABLE b
\tProcess 205: UPDATE b SET x = 3
"""


def test_several_reports_each_get_their_own_incident_and_the_waits_that_led_to_it():
    first, second = pglog.parse(TWO_DEADLOCKS)
    # 101's wait ended (acquired) before its deadlock: not a wait that led to it.
    assert first.graph.cycle() == [101, 102]
    assert first.lead_up == []
    assert first.statement == ""  # 777's STATEMENT, between, is not the report's
    assert second.graph.cycle() == [200, 201]
    # 300's wait belongs to no report; 205 waited and was part of the second.
    assert [(w.waiter, w.holders) for w in second.lead_up] == [(201, [200, 202]), (205, [])]
    # The server names every process holding the lock, in any mode: 202
    # may hold one that does not conflict with ExclusiveLock.
    assert second.unread == [
        "process 201's lock wait (line 6) names 2 processes holding the lock in modes the log "
        "does not give: not each of them need have blocked it",
        "process 205's lock wait (line 8) names no process holding the lock: it is not stored",
    ]
    imported = pglog.import_log(TWO_DEADLOCKS, "two.log")
    incidents = [incident for _, incident in imported]
    assert [i.processes for i in incidents] == [2, 3]
    rows = incidents[1].waits.filter(lead_up=True).order_by("id")
    # Two processes held 201's lock: one wait for each.
    assert [(w.waiter_pid, w.blocker_pid, w.waited_ms) for w in rows] == [
        (201, 200, 1000),
        (201, 202, 1000),
    ]
    assert incidents[1].unread == second.unread
    assert LockIncident.objects.count() == 2


def test_a_report_whose_log_gives_no_time_is_marked_unknown_never_dated_by_the_import():
    log = (FIXTURES / "three_way.log").read_text().replace("2026-11-29 ", "")
    ((report, incident),) = pglog.import_log(log, "no-dates.log")
    assert report.time is None
    assert incident.time_known is False
    assert incident.waits.filter(lead_up=True).count() == 3
    assert incident.unread == []

"""The lock graph as data: waits that share no process are laid out apart
(no arrow of one crosses another's), each label sits on its own arrow and
says who holds the lock, and the process PostgreSQL ended to break a
deadlock is named, on the figure and on the page.  Read from real server
logs (tests/fixtures/pglog) and from real waiting sessions."""

from __future__ import annotations

import importlib
import itertools
import math
import re
import threading
from pathlib import Path

import psycopg
import pytest
from django.db import connection

from evidence import charts, locks, pglog
from evidence.locks import Edge, Graph, Process
from evidence.models import IncidentSource, LockIncident
from runs.submission import submit
from tests.conftest import database_url
from tests.faultruns import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

FIXTURES = Path(__file__).parent / "fixtures" / "pglog"
# Real server logs of every format, in several languages, of 2 and 3 processes.
LOGS = [
    "three_way.log",
    "three_way.csv",
    "three_way.json",
    "lang/ja.log",
    "servers/verbose.log",
    "servers/query_quotes_a_report.csv",
    "servers/raised_fr.csv",
    "servers/truncated.json",
]

Point = tuple[float, float]


def drawn(figure: dict) -> tuple[dict[int, Point], dict[str, tuple[Point, Point]], dict]:
    """(each process's place, each wait's arrow (tail, head), each wait's
    label annotation), read from the figure the page draws."""
    (nodes,) = figure["data"]
    place = {
        pid: (x, y) for pid, x, y in zip(nodes["customdata"], nodes["x"], nodes["y"], strict=True)
    }
    notes = figure["layout"]["annotations"]
    arrows = {a["name"]: ((a["ax"], a["ay"]), (a["x"], a["y"])) for a in notes if a["showarrow"]}
    labels = {a["name"]: a for a in notes if not a["showarrow"]}
    assert arrows.keys() == labels.keys()
    return place, arrows, labels


def cross(p: Point, q: Point, r: Point, s: Point) -> bool:
    """Whether segments p-q and r-s meet (touching counts)."""

    def turn(a: Point, b: Point, c: Point) -> float:
        return (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0])

    def within(a: Point, b: Point, c: Point) -> bool:
        return min(a[0], b[0]) <= c[0] <= max(a[0], b[0]) and min(a[1], b[1]) <= c[1] <= max(
            a[1], b[1]
        )

    d1, d2, d3, d4 = turn(r, s, p), turn(r, s, q), turn(p, q, r), turn(p, q, s)
    if ((d1 > 0) != (d2 > 0)) and ((d3 > 0) != (d4 > 0)) and 0 not in (d1, d2, d3, d4):
        return True
    return any(
        d == 0 and within(a, b, c)
        for d, a, b, c in ((d1, r, s, p), (d2, r, s, q), (d3, p, q, r), (d4, p, q, s))
    )


def on_segment(point: Point, tail: Point, head: Point) -> float | None:
    """How far along tail-head `point` is (0 to 1), or None if not on it."""
    (px, py), (ax, ay), (bx, by) = point, tail, head
    length = math.hypot(bx - ax, by - ay)
    along = ((px - ax) * (bx - ax) + (py - ay) * (by - ay)) / length**2
    off = abs((bx - ax) * (py - ay) - (by - ay) * (px - ax)) / length
    return along if off < 1e-9 and 0 < along < 1 else None


def imported(name: str, text: str | None = None) -> list[LockIncident]:
    path = FIXTURES / name
    text = text if text is not None else pglog.decode(path.read_bytes(), "utf-8", limit=10**7)[0]
    return [incident for _, incident in pglog.import_log(text, path.name)]


def session(name: str) -> psycopg.Connection:
    conn = psycopg.connect(database_url(), application_name=name)
    conn.execute("SET deadlock_timeout = '30s'")
    return conn


# -- independent waits ------------------------------------------------------------------


def assert_apart(incident: LockIncident) -> None:
    """No two arrows of waits that share no process meet, and each set of
    waits has a band of its own (their processes' heights do not mix)."""
    figure = charts.lock_graph(incident)
    place, arrows, _ = drawn(figure)
    waits = {f"wait {w.pk}": w for w in incident.waits.filter(lead_up=False)}
    for (a, first), (b, second) in itertools.combinations(arrows.items(), 2):
        shared = {waits[a].waiter_pid, waits[a].blocker_pid} & {
            waits[b].waiter_pid,
            waits[b].blocker_pid,
        }
        if not shared:
            assert not cross(*first, *second), (waits[a], waits[b])
    for name, (tail, head) in arrows.items():  # each arrow joins its own two processes
        wait = waits[name]
        assert math.dist(tail, place[wait.waiter_pid]) < math.dist(tail, place[wait.blocker_pid])
        assert math.dist(head, place[wait.blocker_pid]) < math.dist(head, place[wait.waiter_pid])
    groups = charts.wait_groups(list(waits.values()), incident.cycle)
    heights = [[place[pid][1] for pid in group] for group in groups]
    for upper, lower in itertools.pairwise(heights):
        assert min(upper) > max(lower)


def test_two_independent_waits_of_real_sessions_do_not_cross():
    first, second = (submit(question=q, documents=["a.md"]) for q in "ab")
    conns, blocked = [], []
    try:
        for run in (first, second):
            holder = session(f"rundesk:executor:run-{run.pk}")
            waiter = session(f"rundesk:publication:run-{run.pk}")
            conns += [holder, waiter]
            holder.execute("UPDATE runs_run SET status_reason = 'held' WHERE id = %s", (run.pk,))
            thread = threading.Thread(
                target=lambda w=waiter, pk=run.pk: w.execute(
                    "SELECT 1 FROM runs_run WHERE id = %s FOR SHARE", (pk,)
                )
            )
            thread.start()
            blocked.append(thread)
        wait_for(lambda: len(locks.sample().edges) >= 2)
        graph = locks.sample()
    finally:
        for conn in conns[::2]:
            conn.rollback()
        for thread in blocked:
            thread.join(10)
        for conn in conns:
            conn.close()
    incident = locks.store(IncidentSource.SAMPLER, graph)
    assert len(charts.wait_groups(list(incident.waits.all()), [])) == 2
    assert_apart(incident)


@pytest.mark.parametrize(
    "pairs",
    [
        [(1, 3), (2, 4)],  # the old circle put 1, 2, 3, 4 round it: a crossing
        [(5, 1), (2, 6), (3, 7), (8, 4)],
        [(10, 30), (20, 40), (30, 50)],  # a chain and an independent wait
    ],
    ids=["two", "four", "chain-and-one"],
)
def test_independent_waits_are_drawn_apart_whatever_their_pids(pairs):
    edges = [Edge(w, b, "ShareLock", "transactionid", f"transaction {900 + w}") for w, b in pairs]
    pids = {pid for pair in pairs for pid in pair}
    graph = Graph({pid: Process(pid, "executor") for pid in pids}, edges)
    assert_apart(locks.store(IncidentSource.SAMPLER, graph))


def test_independent_waits_beside_an_imported_deadlock_are_drawn_apart():
    (incident,) = imported("three_way.log")
    graph = Graph({p: Process(p, "psql") for p in (7001, 7002)}, [Edge(7001, 7002, "ShareLock")])
    for wait in locks.store(IncidentSource.SAMPLER, graph).waits.all():
        wait.incident = incident
        wait.save()
    assert_apart(incident)


# -- labels on their arrows -------------------------------------------------------------


@pytest.mark.parametrize("log", LOGS)
def test_each_label_sits_on_its_own_arrow_and_covers_no_other(log):
    for incident in imported(log):
        place, arrows, labels = drawn(charts.lock_graph(incident))
        waits = {f"wait {w.pk}": w for w in incident.waits.filter(lead_up=False)}
        assert arrows.keys() == waits.keys()
        boxes = {}
        for name, label in labels.items():
            tail, head = arrows[name]
            along = on_segment((label["x"], label["y"]), tail, head)
            assert along is not None, (log, name)
            assert f"held by process {waits[name].blocker_pid}" in label["text"]
            boxes[name] = charts.Box.around(
                label["x"], label["y"], *charts.text_size(label["text"])
            )
        for first, second in itertools.combinations(boxes.values(), 2):
            assert not first.overlaps(second)
        for (name, box), (other, (tail, head)) in itertools.product(boxes.items(), arrows.items()):
            pair = {waits[name].waiter_pid, waits[name].blocker_pid}
            if {waits[other].waiter_pid, waits[other].blocker_pid} != pair:
                assert not box.crosses(tail, head), (log, name, other)
        for name, box in boxes.items():  # no label covers a process
            for pid, (x, y) in place.items():
                assert not box.overlaps(charts.Box.around(x, y, 0.1, 0.1)), (log, name, pid)


def test_the_transactions_lock_is_labelled_on_the_arrow_to_its_owner():
    """The issue's case: "ShareLock on transaction 9001" is 4103's (the
    blocker's) transaction, and its label is on 4102's arrow to it, saying so."""
    owner = submit(question="the publication", documents=["a.md"])
    text = (FIXTURES / "three_way.csv").read_text().replace("run-2", f"run-{owner.pk}")
    (incident,) = imported("three_way.csv", text)
    _, arrows, labels = drawn(charts.lock_graph(incident))
    wait = incident.waits.get(lead_up=False, locked="transaction 9001")
    assert (wait.waiter_pid, wait.blocker_pid, wait.blocker_run_id) == (4102, 4103, owner.pk)
    label = labels[f"wait {wait.pk}"]
    assert f"held by process 4103 · run {owner.pk}" in label["text"]
    assert on_segment((label["x"], label["y"]), *arrows[f"wait {wait.pk}"]) is not None


# -- the victim ---------------------------------------------------------------------------


def test_the_victim_is_the_process_whose_log_line_carries_the_report():
    victim_run, other_run = (submit(question=q, documents=["a.md"]) for q in "vo")
    text = (FIXTURES / "three_way.csv").read_text()
    # At once: one after the other, run-3 made run-210 and then run-2 took its start.
    ids = {"3": victim_run.pk, "2": other_run.pk}
    text = re.sub(r"run-([23])\b", lambda match: f"run-{ids[match.group(1)]}", text)
    (incident,) = imported("three_way.csv", text)
    assert incident.victim_pid == 4102
    assert locks.victim_of(incident) == locks.Victim(4102, "capture", victim_run.pk)

    (nodes,) = charts.lock_graph(incident)["data"]
    marked = {
        pid: (symbol, name)
        for pid, symbol, name in zip(
            nodes["customdata"], nodes["marker"]["symbol"], nodes["text"], strict=True
        )
    }
    assert marked[4102] == (
        "circle-x",
        f"capture 4102 · run {victim_run.pk}<br>ended by PostgreSQL",
    )
    assert all(symbol == "circle" for pid, (symbol, _) in marked.items() if pid != 4102)


@pytest.mark.parametrize("log", LOGS)
def test_every_real_report_names_its_victim_among_its_waiters(log):
    for incident in imported(log):
        assert incident.victim_pid in incident.waits.filter(lead_up=False).values_list(
            "waiter_pid", flat=True
        )


def test_a_report_whose_log_names_no_process_names_no_victim(viewer):
    from tests.test_pglog import NO_PID

    ((_, incident),) = pglog.import_log(NO_PID, "client.log")
    assert incident.victim_pid is None and locks.victim_of(incident) is None
    (nodes,) = charts.lock_graph(incident)["data"]
    assert set(nodes["marker"]["symbol"]) == {"circle"}
    assert "PostgreSQL ended" not in viewer.get(f"/locks/{incident.pk}/").content.decode()


def test_the_lock_page_names_the_victim_and_its_run(viewer):
    victim_run = submit(question="the capture", documents=["a.md"])
    text = (FIXTURES / "three_way.json").read_text().replace("run-3", f"run-{victim_run.pk}")
    (incident,) = imported("three_way.json", text)
    page = viewer.get(f"/locks/{incident.pk}/").content.decode()
    assert (
        f'PostgreSQL ended process 4102 (<a href="/runs/{victim_run.pk}/">run {victim_run.pk}</a>)'
        " to break the cycle"
    ) in page


def test_reports_imported_before_the_victim_was_kept_get_it_from_their_summary():
    (incident,) = imported("three_way.log")
    (other,) = imported("servers/verbose.log")
    LockIncident.objects.update(victim_pid=None)
    migration = importlib.import_module("evidence.migrations.0008_lock_incident_victim")
    with connection.cursor() as cursor:
        cursor.execute(migration.VICTIMS_OF_EARLIER_IMPORTS)
    incident.refresh_from_db()
    other.refresh_from_db()
    assert (incident.victim_pid, other.victim_pid) == (4102, 19294)

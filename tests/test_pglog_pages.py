"""The lock pages for imported reports: the upload with its format choice,
"time unknown" rather than the import's time, what could not be read, the
waits logged before a deadlock; and the incident's graph, whose labels
cover no arrow and no other label."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import math
import re
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone

from evidence import charts, pglog
from evidence.models import IncidentSource, LockIncident, LockWait
from tests.test_pglog_clients import detail

pytestmark = pytest.mark.django_db(transaction=True)

FIXTURES = Path(__file__).parent / "fixtures" / "pglog"


def upload(client, name: str, text: str, **fields: str):
    file = SimpleUploadedFile(name, text.encode())
    return client.post("/locks/import/", {"log": file, **fields}, follow=True)


def test_upload_reads_the_format_its_content_says_or_the_one_chosen(operator):
    csv_text = (FIXTURES / "three_way.csv").read_text()
    page = upload(operator, "pg.csv", csv_text).content.decode()
    assert "1 deadlock reports imported from pg.csv." in page
    assert LockIncident.objects.get().waits.count() == 6  # 3 edges, 3 waits before them
    refused = upload(operator, "pg.csv", csv_text, format="jsonlog").content.decode()
    assert "pg.csv: jsonlog line 1 is not JSON" in refused
    assert "Nothing was imported." in refused
    assert LockIncident.objects.count() == 1
    assert operator.post("/locks/import/", {"format": "syslog"}).status_code == 400
    form = operator.get("/locks/").content.decode()
    assert '<option value="auto" selected>as its content says</option>' in form
    assert '<option value="jsonlog">jsonlog</option>' in form


def test_upload_reads_a_log_in_its_servers_encoding_and_log_timezone(operator):
    """What import_pg_log's --encoding and --log-timezone say, the form
    says: a LATIN1 server's French log; a log whose times say PST, written
    by a server in Asia/Manila."""
    servers = FIXTURES / "servers"
    latin1 = (servers / "fr_latin1.log").read_bytes()

    def send(name, raw, **fields):
        file = SimpleUploadedFile(name, raw)
        return operator.post("/locks/import/", {"log": file, **fields}, follow=True)

    page = send("fr.log", latin1).content.decode()
    assert "some bytes are not utf-8 (the first at byte 70)" in page
    assert "the import form&#x27;s Encoding" in page
    # As `SHOW server_encoding` names it, or as Python does.
    page = send("fr.log", latin1, encoding="LATIN1").content.decode()
    assert "1 deadlock reports imported from fr.log." in page and "U+FFFD" not in page
    assert LockIncident.objects.get().cycle == [20628, 20629]

    verbose = (servers / "verbose.log").read_bytes()
    page = send("pst.log", verbose, log_timezone="Asia/Manila").content.decode()
    assert "1 deadlock reports imported from pst.log." in page
    incident = LockIncident.objects.latest("id")
    assert incident.time_known and incident.unread == []
    assert incident.started_at == dt.datetime(2026, 12, 1, 13, 49, 53, tzinfo=dt.UTC)
    for fields, said in [
        ({"log_timezone": "Mars/Olympus"}, "not a time zone this server knows"),
        ({"encoding": "klingon"}, "not an encoding a PostgreSQL server writes its log in"),
        # Python's codecs no server writes a log in: one raises on any
        # input, one decodes in quadratic time.
        ({"encoding": "undefined"}, "not an encoding a PostgreSQL server writes its log in"),
        ({"encoding": "punycode"}, "not an encoding a PostgreSQL server writes its log in"),
    ]:
        page = send("azure.log", (servers / "azure.log").read_bytes(), **fields).content.decode()
        assert said in page and "Nothing was imported." in page
    assert LockIncident.objects.count() == 2
    form = operator.get("/locks/").content.decode()
    assert 'name="encoding" value="utf-8"' in form and 'name="log_timezone"' in form


def test_a_report_without_a_time_says_time_unknown_and_what_was_not_read(operator):
    output = f"psycopg.errors.DeadlockDetected: deadlock detected\nDETAIL:  {detail(7, 8, 1, 2)}\n"
    page = upload(operator, "app.log", output).content.decode()
    assert "1 could not be read in full: their pages say what is missing." in page
    incident = LockIncident.objects.get()
    assert incident.time_known is False
    imported_at = timezone.localtime(incident.started_at).strftime("%Y-%m-%d %H:%M")
    listing = operator.get("/locks/").content.decode()
    assert "time unknown" in listing and "not all read" in listing
    assert imported_at not in listing
    detail_page = operator.get(f"/locks/{incident.pk}/").content.decode()
    assert "time unknown" in detail_page
    assert imported_at not in detail_page
    assert "<h2>Not read</h2>" in detail_page
    assert "no process&#x27;s query is in the input" in detail_page


def test_lock_page_lists_the_waits_before_the_report_apart_from_its_graph(viewer):
    ((_, incident),) = pglog.import_log((FIXTURES / "three_way.log").read_text(), "pg.log")
    page = viewer.get(f"/locks/{incident.pk}/").content.decode()
    assert "2026-11-29 10:00:01 UTC" in page
    assert "Waits logged before the report" in page
    assert "2026-11-29 09:59:59 UTC" in page  # 4103 waited from 1000 ms before its message
    graph = charts.lock_graph(incident)
    arrows = [a for a in graph["layout"]["annotations"] if a.get("showarrow")]
    assert len(arrows) == 3  # the report's edges only


# -- the graph's layout --------------------------------------------------------------


def incident_with(edges: list[tuple[int, int, str, str, int]], cycle: list[int]) -> LockIncident:
    incident = LockIncident.objects.create(
        source=IncidentSource.LOG, processes=len(cycle), has_cycle=True, cycle=cycle
    )
    for waiter, blocker, mode, locked, waited_ms in edges:
        LockWait.objects.create(
            incident=incident,
            waiter_pid=waiter,
            blocker_pid=blocker,
            waiter_role="capture",
            blocker_role="publication",
            mode=mode,
            lock_type=locked.split(" ")[0],
            locked=locked,
            waited_ms=waited_ms,
        )
    return incident


def test_text_from_a_log_or_a_session_reaches_the_graph_as_text_not_markup():
    link = '<a href="https://evil.example/">ext</a> <b>bold</b> & co'
    incident = incident_with([(101, 102, "ShareLock", f"relation {link}", 0)], [101, 102])
    LockWait.objects.filter(incident=incident).update(waiter_role=link, waiter_query=link)
    figure = json.dumps(charts.lock_graph(incident))
    assert "<a " not in figure and "<b>" not in figure
    assert '&lt;a href=\\"https://evil.example/\\"&gt;ext&lt;/a&gt;' in figure
    assert "&amp; co" in figure


TUPLE = "tuple (0,7) of relation 16402 of database 16384"
RELATION = "relation 16390 of database 16384"
CASES = {
    # three processes, and a second edge between the first two, the other way
    "3-cycle": (
        [
            (101, 102, "ShareLock", "transaction 9001", 0),
            (102, 103, "ShareLock", "transaction 9002", 1200),
            (103, 101, "ExclusiveLock", TUPLE, 0),
            (102, 101, "AccessExclusiveLock", RELATION, 0),
        ],
        [101, 102, 103],
    ),
    # four processes, and a second edge between two of them, the same way
    "4-cycle": (
        [
            (201, 202, "ShareLock", "transaction 9101", 0),
            (202, 203, "ShareLock", "transaction 9102", 0),
            (203, 204, "ExclusiveLock", TUPLE, 1500),
            (204, 201, "ShareLock", "transaction 9104", 0),
            (201, 202, "AccessExclusiveLock", RELATION, 20000),
        ],
        [201, 202, 203, 204],
    ),
}


def layout(figure: dict) -> tuple[list, list]:
    """The arrows (tail, head) and the label boxes of a lock graph, in the
    order of their waits."""
    notes = figure["layout"]["annotations"]
    arrows = [((a["ax"], a["ay"]), (a["x"], a["y"])) for a in notes if a["showarrow"]]
    labels = [
        charts.Box.around(a["x"], a["y"], *charts.text_size(a["text"]))
        for a in notes
        if not a["showarrow"]
    ]
    return arrows, labels


@pytest.mark.parametrize("case", CASES)
def test_graph_labels_cover_no_arrow_and_no_other_label(case):
    """A label sits on its own arrow (tests/test_lock_graph.py), where it
    covers no other, but those joining the same two processes beside it."""
    edges, cycle = CASES[case]
    figure = charts.lock_graph(incident_with(edges, cycle))
    arrows, labels = layout(figure)
    assert len(arrows) == len(labels) == len(edges)
    for first, second in itertools.combinations(labels, 2):
        assert not first.overlaps(second)
    pairs = [{waiter, blocker} for waiter, blocker, *_ in edges]
    for label, own, pair in zip(labels, arrows, pairs, strict=True):
        assert label.crosses(*own)
        for arrow, other in zip(arrows, pairs, strict=True):
            assert other == pair or not label.crosses(*arrow)
    # A label is as wide as its longest line at a generous width per letter.
    longest = max(
        len(line) for a in figure["layout"]["annotations"] for line in a["text"].split("<br>")
    )
    assert max(box.x1 - box.x0 for box in labels) * charts.GRAPH_SCALE >= 0.6 * 11 * longest
    # Everything is on the drawing, drawn at the scale the layout was made for.
    x0, x1 = figure["layout"]["xaxis"]["range"]
    y0, y1 = figure["layout"]["yaxis"]["range"]
    assert all(x0 <= b.x0 and b.x1 <= x1 and y0 <= b.y0 and b.y1 <= y1 for b in labels)
    margin = 2 * charts.GRAPH_MARGIN
    assert figure["layout"]["width"] - margin == pytest.approx(
        (x1 - x0) * charts.GRAPH_SCALE, abs=1
    )
    assert figure["layout"]["height"] - margin == pytest.approx(
        (y1 - y0) * charts.GRAPH_SCALE, abs=1
    )


@pytest.mark.parametrize("case", CASES)
def test_arrows_between_the_same_two_processes_are_drawn_apart(case):
    edges, cycle = CASES[case]
    arrows, _ = layout(charts.lock_graph(incident_with(edges, cycle)))
    first, second = arrows[0], arrows[-1]  # both join the cycle's first two processes
    middle = [((t[0] + h[0]) / 2, (t[1] + h[1]) / 2) for t, h in (first, second)]
    assert math.dist(*middle) >= 0.9 * charts.PARALLEL_GAP[0]
    # Side by side: parallel, so neither runs across the other.
    direction = [(h[0] - t[0], h[1] - t[1]) for t, h in (first, second)]
    cross = direction[0][0] * direction[1][1] - direction[0][1] * direction[1][0]
    assert cross == pytest.approx(0, abs=1e-9)


def test_the_graph_of_the_lock_page_is_the_laid_out_figure(viewer):
    incident = incident_with(*CASES["3-cycle"])
    page = viewer.get(f"/locks/{incident.pk}/").content.decode()
    data = re.search(r'id="chart-locks-data"[^>]*>(.*?)</script>', page, re.S)[1]
    assert json.loads(data)["layout"]["width"] == charts.lock_graph(incident)["layout"]["width"]

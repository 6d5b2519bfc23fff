"""A parameter a page cannot use answers 400 saying what was wrong (in the
site's layout: tests/test_bad_input_pages.py), never a 500 (PostgreSQL
refuses NUL in text) and never a page that quietly ignored it."""

from __future__ import annotations

import gzip
import html
import time

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from evidence import locks, pglog
from evidence.models import IncidentSource, LockIncident
from runs.models import Run, page_cursor
from runs.submission import submit
from tests.conftest import make_user, signed_in
from tests.test_pglog import THREE_WAY

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def viewer() -> Client:
    return signed_in(make_user("viewer"), raise_request_exception=False)


@pytest.fixture
def operator(operator_user) -> Client:
    return signed_in(operator_user, raise_request_exception=False)


@pytest.fixture
def run() -> Run:
    return submit(question="Which fund is cheapest?", documents=["a.md"])


@pytest.fixture
def incident() -> LockIncident:
    (report,) = pglog.parse(THREE_WAY)
    return locks.store(IncidentSource.LOG, report.graph, summary="imported")


def refused(response, says: str) -> bool:
    """Refused with the site's page (its header), saying `says`."""
    body = html.unescape(response.content.decode())
    return (
        response.status_code == 400
        and response["Content-Type"].startswith("text/html")
        and 'id="nav-inbox"' in body
        and (says in body)
    )


def test_nul_in_the_runs_search_is_400_with_a_message(viewer, run):
    response = viewer.get("/?q=%00abc")
    assert refused(response, "parameter 'q' holds a NUL character")
    found = viewer.get("/", {"q": "cheapest"})
    assert found.status_code == 200 and "Which fund is cheapest?" in found.content.decode()


@pytest.mark.parametrize(
    "url",
    [
        "/?status=%00",
        "/?unknown=1%00",
        "/?before=%00",
        "/?%00=1",
        "/runs/{run}/?events_before=%00",
        "/locks/?source=log%00",
        "/locks/{incident}/?x=%00",
        "/gaps/?x=%00",
    ],
)
def test_nul_in_any_page_parameter_is_400(viewer, run, incident, url):
    response = viewer.get(url.format(run=run.pk, incident=incident.pk))
    assert refused(response, "NUL character")


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("/?status=finished", "status='finished' is not one of: queued, running"),
        ("/?unknown=maybe", "unknown='maybe' is neither 1 (or true, yes, on) nor 0"),
        ("/?gaps=2", "gaps='2' is neither 1"),
        ("/?before=yesterday", "not a page cursor: 'yesterday'"),
        ("/?before=2026-01-01T00:00:00%2B00:00|x", "not a page cursor"),
        ("/runs/{run}/?events_before=junk", "not a page cursor: 'junk'"),
        ("/locks/?source=disk", "source='disk' is not one of: sampler"),
    ],
)
def test_parameters_a_page_cannot_use_are_400(viewer, run, url, says):
    assert refused(viewer.get(url.format(run=run.pk)), says)


def test_valid_parameters_still_answer(viewer, run, incident):
    cursor = page_cursor(Run.objects.order_by("-created_at", "-id").first())
    for url, params in [
        ("/", {"status": "queued", "unknown": "0", "gaps": "", "q": "fund"}),
        ("/", {"status": "", "unknown": "1", "gaps": "1"}),
        ("/", {"before": cursor}),
        (f"/runs/{run.pk}/", {"events_before": cursor}),
        ("/locks/", {"source": "log"}),
        ("/locks/", {"source": ""}),
    ]:
        assert viewer.get(url, params).status_code == 200, (url, params)


@pytest.mark.parametrize("offset", ["%2B16:00", "-23:59", "%2B23:59:59"])
def test_a_cursor_at_an_offset_postgresql_does_not_know_is_read_in_utc(viewer, run, offset):
    """Python reads offsets up to 23:59; PostgreSQL refused them (a 500)."""
    far = f"2030-01-01T00:00:00{offset}|{run.pk + 1}"
    for url in [f"/?before={far}", f"/runs/{run.pk}/?events_before={far}", f"/inbox/?after={far}"]:
        assert viewer.get(url).status_code == 200, url
    assert refused(viewer.get("/?before=0001-01-01T00:00:00%2B23:00|1"), "not a page cursor")


def test_nul_in_a_posted_form_value_is_400(operator, run):
    response = operator.post(f"/runs/{run.pk}/cancel/", {"note": "a\x00b"})
    assert refused(response, "parameter 'note' holds a NUL character")
    run.refresh_from_db()
    assert run.status == "queued"


def test_a_viewer_is_refused_before_their_input_is_looked_at(viewer, run):
    assert viewer.post(f"/runs/{run.pk}/cancel/", {"note": "\x00"}).status_code == 403


def test_nul_inside_an_uploaded_log_is_imported_not_a_500(operator):
    log = THREE_WAY.replace("UPDATE", "UPDATE\x00", 1).encode()
    assert b"\x00" in log
    response = operator.post(
        "/locks/import/", {"log": SimpleUploadedFile("pg.log", log)}, follow=True
    )
    assert response.status_code == 200
    assert "1 deadlock reports imported from pg.log" in response.content.decode()
    assert LockIncident.objects.filter(source=IncidentSource.LOG).count() == 1


def test_a_small_gz_upload_that_holds_a_huge_log_is_refused_at_once(operator):
    """A few hundred KB of gzip held 200 MB of log: the page decompressed
    and read it all while it waited (minutes, gigabytes)."""
    huge = gzip.compress(THREE_WAY.encode() + b"\n" * (6 * 1024 * 1024), mtime=0)
    assert len(huge) < 100_000
    started = time.monotonic()
    response = operator.post(
        "/locks/import/", {"log": SimpleUploadedFile("pg.log.gz", huge)}, follow=True
    )
    assert time.monotonic() - started < 5 and response.status_code == 200
    said = response.content.decode()
    assert "more than 5242880 bytes once decompressed" in said
    assert "manage.py import_pg_log" in said and "Nothing was imported." in said
    assert not LockIncident.objects.exists()


# A wait logged before the report, in the year 1: how long before it no
# date can say.
YEAR_ONE = """\
0001-01-01 00:00:00.100 UTC [21971] LOG:  process 21971 still waiting for ShareLock on \
transaction 767 after 1000.000 ms
0001-01-01 00:00:00.100 UTC [21971] DETAIL:  Process holding the lock: 21972. Wait queue: 21971.
0001-01-01 00:00:00.620 UTC [21972] ERROR:  deadlock detected
0001-01-01 00:00:00.620 UTC [21972] DETAIL:  Process 21972 waits for ShareLock on transaction \
766; blocked by process 21971.
\tProcess 21971 waits for ShareLock on transaction 767; blocked by process 21972.
\tProcess 21972: UPDATE t SET v = 1
\tProcess 21971: UPDATE t SET v = 2
"""


@pytest.mark.parametrize(
    ("log", "why"),
    [
        (THREE_WAY.replace("by process 4103.", "by process 99999999999."), "integer out of range"),
        (YEAR_ONE, "date value out of range"),
    ],
    ids=["pid-past-2^31", "year-one"],
)
def test_a_log_holding_a_value_no_row_can_is_refused_not_a_500(operator, log, why):
    response = operator.post(
        "/locks/import/", {"log": SimpleUploadedFile("pg.log", log.encode())}, follow=True
    )
    said = response.content.decode()
    assert response.status_code == 200 and why in said and "Nothing was imported." in said
    assert not LockIncident.objects.exists()

"""Bad input on a page gets the site's page, not a bare one: a 400 in the
layout (its header and navigation), saying what was not understood, with a
link back to the page without its parameters.  What a person plainly means
is understood (a status in capitals, `true` for a ticked box); the search
box takes no more than the page searches, and that fits in the request line
gunicorn reads.  The header's Admin link is shown only to whom the admin
lets in."""

from __future__ import annotations

import html
import re
import runpy
from urllib.parse import quote

import pytest
from django.contrib import admin
from django.contrib.auth.models import User
from django.template.loader import render_to_string
from django.test import Client, RequestFactory
from django.utils import timezone

from dashboard.params import SEARCH_MAX
from evidence import locks, pglog
from evidence.models import IncidentSource, LockIncident
from runs.models import Run, RunStatus
from runs.submission import submit
from tests.conftest import PASSWORD, ROOT, make_user, signed_in
from tests.test_pglog import THREE_WAY

pytestmark = pytest.mark.django_db


@pytest.fixture
def run() -> Run:
    return submit(question="Which fund is cheapest?", documents=["a.md"])


@pytest.fixture
def failed() -> Run:
    # Inserted failed: the lifecycle leads there only through an owner.
    return Run.objects.create(
        question="Which bond fund failed us?",
        documents=["a.md"],
        status=RunStatus.FAILED,
        finished_at=timezone.now(),
    )


@pytest.fixture
def incident() -> LockIncident:
    (report,) = pglog.parse(THREE_WAY)
    return locks.store(IncidentSource.LOG, report.graph, summary="imported")


def not_understood(response) -> tuple[str, str]:
    """(what the page says was not understood, where its link back goes),
    once it is checked to be the site's page: a 400 in the layout."""
    body = response.content.decode()
    assert response.status_code == 400
    assert response["Content-Type"].startswith("text/html")
    assert "<header>" in body and 'id="nav-inbox"' in body and ">Lock waits</a>" in body
    said = re.search(r'id="not-understood">(.*?)</p>', body, re.S)
    back = re.search(r'<a href="([^"]*)" id="back">', body)
    assert said and back, body
    return html.unescape(said[1]), html.unescape(back[1])


@pytest.mark.parametrize(
    ("url", "says", "back"),
    [
        ("/?status=bogus", "status='bogus' is not one of: queued, running", "/"),
        ("/?unknown=maybe", "unknown='maybe' is neither 1 (or true, yes, on)", "/"),
        ("/?before=yesterday", "not a page cursor: 'yesterday'", "/"),
        ("/?q=" + "x" * (SEARCH_MAX + 1), f"at most {SEARCH_MAX} are searched", "/"),
        ("/?q=%00", "parameter 'q' holds a NUL character", "/"),
        ("/inbox/?kind=bogus", "kind='bogus' is not one of: checkpoint", "/inbox/"),
        ("/inbox/?run=seven", "run='seven' is not a run number", "/inbox/"),
        ("/inbox/?after=junk", "after='junk' is not a page cursor", "/inbox/"),
        ("/locks/?source=disk", "source='disk' is not one of: sampler", "/locks/"),
        ("/locks/?origin=elsewhere", "origin='elsewhere' is not one of: here, imported", "/locks/"),
        ("/locks/{incident}/?x=%00", "parameter 'x' holds a NUL character", "/locks/{incident}/"),
        ("/gaps/?x=%00", "parameter 'x' holds a NUL character", "/gaps/"),
        ("/runs/{run}/?events_before=junk", "not a page cursor: 'junk'", "/runs/{run}/"),
    ],
)
def test_bad_input_gets_the_sites_page_saying_what_with_a_way_back(
    viewer, run, incident, url, says, back
):
    names = {"run": run.pk, "incident": incident.pk}
    said, link = not_understood(viewer.get(url.format(**names)))
    assert says in said
    assert link == back.format(**names)
    assert viewer.get(link).status_code == 200  # the way back works


def test_a_long_bad_value_is_quoted_short():
    said, _ = not_understood(signed_in(make_user("viewer")).get("/?status=" + "z" * 5000))
    assert "status='" + "z" * 60 + "…'" in said and len(said) < 200


def test_a_bad_form_value_links_back_to_the_page_it_came_from(operator_user, run):
    operator = signed_in(operator_user)
    page = f"http://testserver/runs/{run.pk}/"
    response = operator.post(f"/runs/{run.pk}/bundle/", {"no_evidence": "yes"}, HTTP_REFERER=page)
    said, back = not_understood(response)
    assert "no_evidence='yes' is not 1" in said and back == page
    elsewhere = operator.post(
        f"/runs/{run.pk}/bundle/", {"no_evidence": "yes"}, HTTP_REFERER="https://evil.example/"
    )
    assert not_understood(elsewhere)[1] == "/"


def rows(response) -> list[int]:
    assert response.status_code == 200
    return [
        int(n) for n in re.findall(r'<td><a href="/runs/(\d+)/">\1</a>', response.content.decode())
    ]


@pytest.mark.parametrize("spelled", ["failed", "FAILED", "Failed", " failed "])
def test_a_status_is_understood_in_any_case(viewer, run, failed, spelled):
    assert rows(viewer.get("/", {"status": spelled})) == [failed.pk]
    assert 'value="failed" selected' in viewer.get("/", {"status": spelled}).content.decode()


@pytest.mark.parametrize(("spelled", "ticked"), [("true", True), ("ON", True), ("no", False)])
def test_a_flag_is_understood_as_a_person_writes_it(viewer, run, spelled, ticked):
    drill = submit(question="A drill's run", documents=["a.md"])
    Run.objects.filter(pk=drill.pk).update(is_drill=True)
    assert rows(viewer.get("/", {"drills": spelled})) == ([drill.pk] if ticked else [run.pk])


def test_other_lists_understand_any_case(viewer, incident):
    assert viewer.get("/locks/", {"source": "LOG"}).status_code == 200
    assert viewer.get("/locks/", {"origin": "Here"}).status_code == 200
    assert viewer.get("/inbox/", {"kind": "Receipt"}).status_code == 200


def test_a_parameter_no_page_takes_is_left_alone(viewer, run):
    assert rows(viewer.get("/", {"stauts": "failed", "utm_source": "mail"})) == [run.pk]


def test_the_search_box_takes_what_the_page_searches_and_no_more(viewer, run):
    page = viewer.get("/").content.decode()
    assert f'name="q" value="" maxlength="{SEARCH_MAX}"' in page
    assert viewer.get("/", {"q": "c" * SEARCH_MAX}).status_code == 200


def test_the_longest_search_the_box_sends_fits_in_the_request_line_gunicorn_reads():
    """gunicorn answers a longer line with a bare 414, before any page:
    the box's longest search, in the characters that encode longest (3
    UTF-8 bytes, 9 characters percent-encoded; maxlength counts a 4-byte
    one as 2), with every other filter of the form, fits."""
    limit = runpy.run_path(str(ROOT / "dashboard" / "gunicorn.py"))["limit_request_line"]
    longest_status = max(RunStatus.values, key=len)
    query = f"status={longest_status}&unknown=1&gaps=1&drills=1&q=" + quote("日" * SEARCH_MAX)
    line = f"GET /?{query} HTTP/1.1"
    assert len(line) <= limit, (len(line), limit)


def test_the_admin_link_is_shown_only_to_whom_the_admin_lets_in(run):
    viewer = signed_in(make_user("viewer"))
    assert "/admin/" not in viewer.get("/").content.decode()
    assert viewer.get("/admin/").status_code == 302  # to the admin's own sign-in

    staff_user = User.objects.create_user("keeper", password=PASSWORD, is_staff=True)
    staff = signed_in(staff_user)
    assert 'href="/admin/" id="nav-admin"' in staff.get("/").content.decode()
    assert staff.get("/admin/").status_code == 200

    # Made inactive (a session Django has not yet ended, a page rendered
    # for them): the admin no longer lets them in, and the header does not
    # offer it.
    staff_user.is_active = False
    request = RequestFactory().get("/")
    request.user = staff_user
    assert not admin.site.has_permission(request)
    page = render_to_string("404.html", {"request_path": "/x"}, request=request)
    assert ">Lock waits</a>" in page and "/admin/" not in page


def test_the_page_of_a_malformed_request_django_refuses_is_in_the_layout(settings):
    """A request Django itself refuses (a host it does not serve) gets the
    same page, without a link it cannot know."""
    settings.DEBUG = False
    response = Client(raise_request_exception=False).get("/", HTTP_HOST="bad host")
    assert response.status_code == 400
    body = response.content.decode()
    assert "<header>" in body and "The server could not read the request." in body

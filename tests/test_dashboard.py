"""The operator pages: login everywhere, who may see and do what, htmx
partials, CSP, model output that is shown, never run, and the admin for
every model."""

from __future__ import annotations

import json
import re
import time
from collections import Counter

import psycopg
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import OperationalError, connection
from django.test import Client

from evidence import charts, locks, pglog
from evidence.capture import record_gaps
from evidence.models import BundleExport, IncidentSource, LockIncident
from runs.executor import claim_and_drive
from runs.leases import Lease
from runs.models import (
    Action,
    Drill,
    OperatorDecision,
    OutcomeItem,
    OutcomeKind,
    Run,
    RunStatus,
    page_cursor,
)
from runs.submission import submit
from runs.timeline import EventKind, timeline
from tests.conftest import PASSWORD, make_user, signed_in
from tests.test_pglog import THREE_WAY
from tests.test_run_page_words import section

pytestmark = pytest.mark.django_db(transaction=True)

PAGES = ["/", "/runs/{run}/", "/locks/", "/locks/{incident}/", "/gaps/"]

# A cancel as the run page sends it: a reason, and the confirmation ticked.
CANCELLING = {"reason": "asked by mistake", "confirm": "on"}


@pytest.fixture
def run() -> Run:
    run = submit(
        question="Compare <script>alert(1)</script>", documents=["northwind-clean-energy.md"]
    )
    claim_and_drive(run.pk)
    timeline.flush()
    return run


@pytest.fixture
def incident() -> LockIncident:
    (report,) = pglog.parse(THREE_WAY)
    return locks.store(IncidentSource.LOG, report.graph, summary="imported")


def urls(run: Run, incident: LockIncident) -> list[str]:
    return [page.format(run=run.pk, incident=incident.pk) for page in PAGES]


def test_every_page_needs_a_login(client, run, incident):
    for url in urls(run, incident):
        response = client.get(url)
        assert response.status_code == 302 and response["Location"].startswith("/login/"), url


@pytest.mark.parametrize("path", ["/", "/runs/1/", "/admin/"])
def test_anonymous_is_sent_to_sign_in(client, path):
    response = client.get(path)
    assert response.status_code == 302
    assert response["Location"].startswith(("/login/", "/admin/login/"))


def test_a_session_that_ended_sends_the_window_back_to_the_page_it_was_on(client, run):
    """A region's poll swapped the sign-in page into the region, and a
    form sent after the session ended came back, once signed in, to its
    POST-only address: a blank 405."""
    page = f"http://testserver/runs/{run.pk}/?events=2"
    poll = client.get(
        f"/runs/{run.pk}/live/", headers={"HX-Request": "true", "HX-Current-URL": page}
    )
    assert poll.status_code == 401
    assert poll["HX-Redirect"] == f"/login/?next=/runs/{run.pk}/%3Fevents%3D2"
    form = client.post(f"/runs/{run.pk}/cancel/", headers={"Referer": page})
    assert form.status_code == 302
    assert form["Location"] == f"/login/?next=/runs/{run.pk}/%3Fevents%3D2"
    # Another site's page is no page to come back to.
    elsewhere = client.post(f"/runs/{run.pk}/cancel/", headers={"Referer": "https://evil.test/x"})
    assert elsewhere["Location"] == "/login/?next=/"
    assert Run.objects.get(pk=run.pk).cancel_requested_at is None


def test_a_forms_address_opened_as_a_page_says_so(viewer, run):
    for address in ("/logout/", f"/runs/{run.pk}/cancel/"):
        response = viewer.get(address)
        assert response.status_code == 405 and "POST" in response["Allow"]
        page = response.content.decode()
        assert "This address takes a form" in page and "nothing was changed" in page
    assert viewer.get("/").status_code == 200  # still signed in


def test_sign_in_enforces_csrf():
    client = Client(enforce_csrf_checks=True)
    make_user("viewer")
    response = client.post("/login/", {"username": "viewer", "password": PASSWORD})
    assert response.status_code == 403
    page = response.content.decode()
    assert "This form could not be checked" in page and "Nothing was changed" in page


def test_a_form_from_another_origin_is_refused_saying_so():
    """Behind a proxy that does not say the site's address, every form
    fails the origin check: the page says that, not that it is old."""
    client = Client(enforce_csrf_checks=True)
    make_user("viewer")
    token = client.get("/login/").cookies["csrftoken"].value
    response = client.post(
        "/login/",
        {"username": "viewer", "password": PASSWORD, "csrfmiddlewaretoken": token},
        HTTP_ORIGIN="http://evil.example",
    )
    assert response.status_code == 403
    page = response.content.decode()
    assert "not this site&#x27;s as the server knows it" in page and "RUNDESK_TLS" in page
    assert "http://evil.example does not match any trusted origins" in page
    assert "older than your sign-in" not in page


def test_signing_in_while_the_database_cannot_answer_says_so(monkeypatch):
    def gone(*args: object, **kwargs: object) -> None:
        raise OperationalError("server closed the connection unexpectedly")

    make_user("viewer")
    monkeypatch.setattr("django.contrib.auth.backends.ModelBackend.authenticate", gone)
    response = Client().post("/login/", {"username": "viewer", "password": PASSWORD})
    assert response.status_code == 503
    page = response.content.decode()
    assert "The database did not answer" in page and "may have been carried out" in page


def test_viewers_read_every_page_with_security_headers(viewer, run, incident):
    for url in urls(run, incident):
        response = viewer.get(url)
        assert response.status_code == 200, url
        policy = response["Content-Security-Policy"]
        assert "script-src 'self'" in policy and "unsafe-eval" not in policy
        assert response["X-Frame-Options"] == "DENY"
        assert response["X-Content-Type-Options"] == "nosniff"
        assert response["Cache-Control"] == "private, no-store"
        html = response.content.decode()
        assert "<script>" not in html  # no inline script anywhere
        assert "/static/vendor/htmx" in html


def test_runs_list_shows_runs_to_a_signed_in_viewer(viewer, run):
    response = viewer.get("/")
    assert response.status_code == 200
    assert f'href="/runs/{run.pk}/"' in response.content.decode()
    assert "completed" in response.content.decode()


def test_run_page_shows_actions_revisions_and_timeline_escaped(viewer, run):
    page = viewer.get(f"/runs/{run.pk}/").content.decode()
    assert "read:0" in page and "deliver" in page and "Revision 2 (final)" in page
    # The documents its agent says it reads (Agent.documents).
    assert '<dd id="run-documents"><code>northwind-clean-energy.md</code></dd>' in page
    assert "<td>run completed</td>" in page and "run_completed" not in page
    assert "<script>alert(1)</script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_the_timeline_chart_shows_run_text_as_text_not_markup(run):
    link = '<a href="https://evil.example/">ext</a> & <b>bold</b>'
    actions = list(run.actions.order_by("id"))
    Action.objects.filter(pk=actions[0].pk).update(error=link)
    timeline.record(run.pk, EventKind.DECISION, link)
    timeline.flush()
    figure = json.dumps(charts.timeline(run, list(run.actions.order_by("id")), []))
    assert "<a " not in figure and "<b>" not in figure
    assert "&lt;a href=" in figure and "&amp; &lt;b&gt;" in figure


def test_pages_answer_head_as_they_answer_get(viewer, run, incident):
    """Uptime checks and link checkers ask with HEAD."""
    for url in urls(run, incident):
        assert viewer.head(url).status_code == viewer.get(url).status_code == 200, url


def test_pages_refuse_other_methods_and_unknown_ids(viewer, run, incident):
    for url in urls(run, incident):
        assert viewer.post(url).status_code == 405, url
    assert viewer.get("/runs/987654/").status_code == 404
    assert viewer.get("/locks/987654/").status_code == 404
    assert viewer.get(f"/runs/{run.pk}/cancel/").status_code == 405


def test_runs_list_columns_filters_and_keyset_pages(viewer, run):
    submit(question="Another fund question", documents=["a.md"])
    page = viewer.get("/").content.decode()
    assert f'href="/runs/{run.pk}/"' in page and ">completed</span>" in page
    assert "Another fund question" in viewer.get("/?status=queued").content.decode()
    assert "Another fund question" not in viewer.get("/?status=completed").content.decode()
    assert "Another fund" in viewer.get("/?q=another+FUND").content.decode()
    assert "No runs match" in viewer.get("/?unknown=1").content.decode()
    assert "No runs match" in viewer.get("/?gaps=1").content.decode()
    newest = Run.objects.order_by("-created_at", "-id").first()
    older = viewer.get("/", {"before": page_cursor(newest)}).content.decode()
    assert f'href="/runs/{newest.pk}/"' not in older and f'href="/runs/{run.pk}/"' in older
    assert viewer.get("/", {"before": "not-a-cursor"}).status_code == 400


def test_page_links_keep_every_parameter_whole(viewer, run, monkeypatch):
    monkeypatch.setattr("dashboard.views.PAGE_SIZE", 1)
    submit(question="Another fund question", documents=["a.md"])
    page = viewer.get("/?x%26status%3Dfailed%23=1&y=a%26b").content.decode()
    older = re.search(r'<a href="\?([^"]+)">older</a>', page).group(1).replace("&amp;", "&")
    assert older.startswith("x%26status%3Dfailed%23=1&y=a%26b&before=")


def test_runs_list_rows_partial_polls_while_runs_are_active_then_stops(viewer, run):
    queued = submit(question="waiting", documents=["a.md"])
    headers = {"HX-Request": "true", "HX-Target": "run-rows"}
    live = viewer.get("/", headers=headers)
    assert live.status_code == 200
    body = live.content.decode()
    assert body.lstrip().startswith('<tbody id="run-rows"') and "<html" not in body
    assert 'hx-trigger="every 2s"' in body
    queued.request_cancel(by="operator")
    assert viewer.get("/", headers=headers).status_code == 286  # nothing active: stop polling


def test_run_page_live_partial_and_event_log_pages(viewer, run):
    for i in range(60):
        timeline.record(run.pk, EventKind.FAULT_INJECTED, f"filler {i}")
    timeline.flush()
    page = viewer.get(f"/runs/{run.pk}/").content.decode()
    assert 'id="chart-timeline-data"' in page and "load older events" in page
    cursor = page.split("events_before=", 1)[1].split('"', 1)[0]
    assert f'hx-get="/runs/{run.pk}/events/?before={cursor}"' in page
    events = f"/runs/{run.pk}/events/?before={cursor}"
    older = viewer.get(events, headers={"HX-Request": "true"}).content.decode()
    assert "<html" not in older and "<td>lease taken</td>" in older
    # Without htmx (the link's fallback) the same page comes whole.
    url = f"/runs/{run.pk}/?events_before={cursor}"
    whole = viewer.get(url).content.decode()
    assert "<html" in whole and "<td>lease taken</td>" in whole
    assert viewer.get(events)["Location"] == url
    live = viewer.get(f"/runs/{run.pk}/live/", headers={"HX-Request": "true"})
    assert live.status_code == 286  # the run is finished: the page stops polling
    assert live.content.decode().lstrip().startswith('<section id="run-live"')
    assert viewer.get(f"/runs/{run.pk}/live/")["Location"] == f"/runs/{run.pk}/"


def test_an_active_run_polls_its_live_region(viewer):
    queued = submit(question="waiting", documents=["a.md"])
    page = viewer.get(f"/runs/{queued.pk}/").content.decode()
    assert f'<section id="run-live" hx-get="/runs/{queued.pk}/live/" hx-trigger="every 2s"' in page
    live = viewer.get(f"/runs/{queued.pk}/live/", headers={"HX-Request": "true"})
    assert live.status_code == 200 and "<html" not in live.content.decode()


def test_unknown_outcomes_are_shown_as_unknown(viewer):
    run = submit(
        question="q",
        documents=["northwind-clean-energy.md"],
        faults=[{"point": "delivery_timeout"}],
    )
    claim_and_drive(run.pk)
    page = viewer.get(f"/runs/{run.pk}/").content.decode()
    assert "1 open</span> — not known to be saved, not known to be lost" in page
    assert "unknown: not known to have happened, nor not" in page


def answered_page(viewer: Client, answer: str) -> str:
    """The run page of a run whose final answer is `answer`."""
    run = submit(question="q", documents=["a.md"])
    lease = Lease.claim(run.pk, "owner")
    assert lease is not None
    lease.publish_revision(1, answer, is_final=True)
    return viewer.get(f"/runs/{run.pk}/").content.decode()


def test_model_output_is_shown_as_text_never_run(viewer, run):
    page = answered_page(
        viewer,
        "# Report\n\n<script>alert(1)</script>\n\n"
        '<img src="x" onerror="alert(2)">\n\n![chart](/bundles/1/download)\n\n'
        "| a | b |\n|---|---|\n| 1 | 2 |",
    )
    assert "<script>alert(1)</script>" not in page
    assert "onerror" not in page
    # Showing the answer fetches nothing: no image, not even of this site.
    assert "<img" not in page and "/bundles/1/download" not in page
    assert "<table>" in page and "<h1>Report</h1>" in page


def test_text_that_only_looks_like_a_tag_is_shown_as_written(viewer, run):
    """Only a tag that names an HTML element is markup; `List<String>` is
    what the answer says, and an element that runs or fetches is still
    dropped, in any case."""
    page = answered_page(
        viewer,
        "# Types\n\nUse List<String> or Map<K, V>; <T> is generic, and Vec<u8> holds bytes.\n\n"
        "<String> opens a line. <SCRIPT>alert(1)</SCRIPT> <Img src=x onerror=alert(2)> "
        "<svg onload=alert(3)> <b>kept</b>",
    )
    answer = section(page, '<div class="answer final">', "</div>")
    assert "List&lt;String&gt; or Map&lt;K, V&gt;; &lt;T&gt; is generic" in answer
    assert "Vec&lt;u8&gt; holds bytes" in answer and "<p>&lt;String&gt; opens a line." in answer
    assert "alert" not in answer and "onerror" not in page and "onload" not in page
    assert "<svg" not in answer.lower() and "<b>kept</b>" in answer


def test_cancel_needs_the_operator_permission_and_csrf(viewer, run):
    queued = submit(question="to cancel", documents=["a.md"])
    assert viewer.post(f"/runs/{queued.pk}/cancel/", CANCELLING).status_code == 403
    strict = signed_in(make_user("strict", operator=True), enforce_csrf_checks=True)
    assert strict.post(f"/runs/{queued.pk}/cancel/", CANCELLING).status_code == 403  # no CSRF token
    queued.refresh_from_db()
    assert queued.status == RunStatus.QUEUED


def test_operator_cancels_a_queued_run_and_htmx_gets_the_fragment(operator):
    queued = submit(question="to cancel", documents=["a.md"])
    response = operator.post(f"/runs/{queued.pk}/cancel/", CANCELLING)
    assert response.status_code == 302 and response["Location"] == f"/runs/{queued.pk}/"
    queued.refresh_from_db()
    assert queued.status == RunStatus.CANCELLED and queued.cancel_requested_at is not None
    other = submit(question="another", documents=["a.md"])
    fragment = operator.post(
        f"/runs/{other.pk}/cancel/", CANCELLING, headers={"HX-Request": "true"}
    )
    assert fragment.status_code == 200
    assert fragment.content.decode().lstrip().startswith('<section id="run-live"')
    # The fragment says what happened; no page after it says it again.
    said = f"Cancel requested for run {other.pk}."
    assert said in fragment.content.decode()
    assert f"Cancel requested for run {queued.pk}." in operator.get("/").content.decode()
    assert said not in operator.get("/").content.decode()
    assert operator.post("/runs/987654/cancel/", CANCELLING).status_code == 404


def test_a_cancel_of_a_run_a_stranger_holds_says_so_instead_of_hanging(operator, monkeypatch):
    monkeypatch.setattr("dashboard.views.CANCEL_LOCK_WAIT", "200ms")
    queued = submit(question="to cancel", documents=["a.md"])
    with psycopg.connect(**connection.get_connection_params()) as stranger:
        stranger.execute("SELECT 1 FROM runs_run WHERE id = %s FOR SHARE", [queued.pk])
        page = operator.post(f"/runs/{queued.pk}/cancel/", CANCELLING, follow=True).content.decode()
    assert f"Run {queued.pk} is locked by another session" in page
    queued.refresh_from_db()
    assert queued.status == RunStatus.QUEUED and queued.cancel_requested_at is None


def test_a_page_a_stranger_holds_answers_503_instead_of_hanging(viewer, run, monkeypatch):
    monkeypatch.setattr("dashboard.security.PAGE_LOCK_WAIT", "300ms")
    with psycopg.connect(**connection.get_connection_params()) as stranger:
        stranger.execute("LOCK TABLE runs_run IN ACCESS EXCLUSIVE MODE")
        started = time.monotonic()
        response = viewer.get("/")
        assert time.monotonic() - started < 5
        assert response.status_code == 503 and response["Retry-After"] == "5"
        assert "another database session holds locked" in response.content.decode()
        # A region's poll keeps its region until the next poll: no page swapped in.
        poll = viewer.get(f"/runs/{run.pk}/live/", headers={"HX-Request": "true"})
        assert poll.status_code == 503 and not poll.has_header("HX-Retarget")
        stranger.rollback()
        # A lock on the items table costs a page that does not read it only
        # its badge's count.
        stranger.execute("LOCK TABLE runs_outcomeitem IN ACCESS EXCLUSIVE MODE")
        page = viewer.get("/locks/")
        assert page.status_code == 200 and 'title="not counted' in page.content.decode()
    assert viewer.get("/").status_code == 200


@pytest.mark.parametrize("table", ["django_session", "auth_user"])
def test_a_page_or_form_whose_session_or_user_a_stranger_holds_answers_503(
    viewer, operator, run, monkeypatch, table
):
    """A VACUUM FULL of django_session, a migration of auth_user: who is
    signed in could not be read, every page waited for the lock, then
    answered 500."""
    monkeypatch.setattr("dashboard.security.PAGE_LOCK_WAIT", "300ms")
    with psycopg.connect(**connection.get_connection_params()) as stranger:
        stranger.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        started = time.monotonic()
        page = viewer.get(f"/runs/{run.pk}/")
        cancel = operator.post(f"/runs/{run.pk}/cancel/", CANCELLING)
        assert time.monotonic() - started < 5
        assert page.status_code == 503 and cancel.status_code == 503
        assert "another database session holds locked" in page.content.decode()
    assert Run.objects.get(pk=run.pk).cancel_requested_at is None
    assert viewer.get(f"/runs/{run.pk}/").status_code == 200


def forms_held(run: Run) -> dict[str, tuple[str, str, dict[str, object]]]:
    """Each form, the lock a stranger holds that its first read or its
    write waits for, and what it posts."""
    item = OutcomeItem.objects.create(
        run=run, kind=OutcomeKind.RECEIPT, subject="receipt:held", summary="held", evidence={}
    )
    log = SimpleUploadedFile("server.log", THREE_WAY.encode())
    return {
        "cancel": ("LOCK TABLE runs_run", f"/runs/{run.pk}/cancel/", dict(CANCELLING)),
        # The export's row checks its run's row (a foreign key): FOR KEY SHARE.
        "bundle": (
            f"SELECT 1 FROM runs_run WHERE id = {run.pk} FOR UPDATE",
            f"/runs/{run.pk}/bundle/",
            {},
        ),
        "decide item": (
            "LOCK TABLE runs_outcomeitem",
            f"/inbox/{item.pk}/decide/",
            {"choice": "check_again", "token": "t-1", "reason": "r"},
        ),
        "decide run": (
            "LOCK TABLE runs_run",
            f"/runs/{run.pk}/decide/",
            {"choice": "abandon", "token": "t-2", "reason": "r"},
        ),
        "drill": ("LOCK TABLE runs_drill", "/drills/start/", {"scenario": ["lease_stolen"]}),
        "import": ("LOCK TABLE evidence_lockincident", "/locks/import/", {"log": log}),
    }


@pytest.mark.parametrize(
    "form", ["cancel", "bundle", "decide item", "decide run", "drill", "import"]
)
def test_a_form_a_stranger_holds_answers_503_and_changes_nothing(operator, form, monkeypatch):
    """Before, a form's first read (or an export's row) waited for as long
    as the stranger held the lock, and the request with it."""
    monkeypatch.setattr("dashboard.security.PAGE_LOCK_WAIT", "300ms")
    run = submit(question="waits", documents=["a.md"])
    Lease.claim(run.pk, "owner").finish(RunStatus.NEEDS_OPERATOR, "waits for an operator")
    lock, url, data = forms_held(run)[form]
    before = {
        model: model.objects.count()
        for model in (BundleExport, Drill, LockIncident, OperatorDecision)
    }
    with psycopg.connect(**connection.get_connection_params()) as stranger:
        stranger.execute(lock)
        started = time.monotonic()
        response = operator.post(url, data)
        took = time.monotonic() - started
        # htmx swaps no 503: its form gets the page's words in place of its page.
        if isinstance(data.get("log"), SimpleUploadedFile):
            data["log"].seek(0)
        swapped = operator.post(
            url, data, headers={"HX-Request": "true", "HX-Current-URL": "javascript:alert(1)"}
        )
    assert response.status_code == 503 and took < 5
    for page in (response, swapped):
        assert "another database session holds locked" in page.content.decode()
        assert "Nothing was changed: try again once it is free." in page.content.decode()
    assert swapped.status_code == 200
    assert (swapped["HX-Retarget"], swapped["HX-Reswap"]) == ("body", "innerHTML")
    assert "javascript:" not in swapped.content.decode()  # a header is no link
    run.refresh_from_db()
    assert (run.status, run.cancel_requested_at) == (RunStatus.NEEDS_OPERATOR, None)
    assert {model: model.objects.count() for model in before} == before


def test_a_form_whose_answer_a_stranger_holds_goes_to_its_page_saying_what_was_done(
    operator, monkeypatch
):
    """The cancel is written (its run row is free); the region it answers
    with reads evidence a stranger has locked: the browser is sent to the
    run's page, where the cancel is said."""
    monkeypatch.setattr("dashboard.security.PAGE_LOCK_WAIT", "300ms")
    run = submit(question="to cancel", documents=["a.md"])
    with psycopg.connect(**connection.get_connection_params()) as stranger:
        stranger.execute("LOCK TABLE evidence_capturegap")
        response = operator.post(
            f"/runs/{run.pk}/cancel/", CANCELLING, headers={"HX-Request": "true"}
        )
        # The run's page reads it too: held, it says what was done before.
        page = operator.get(f"/runs/{run.pk}/")
    said = response.content.decode()
    assert response.status_code == 200 and response["HX-Retarget"] == "body"
    assert f"Cancel requested for run {run.pk}." in said and "Nothing was changed" not in said
    assert "What you asked was carried out, and stands." in said
    assert f'href="/runs/{run.pk}/"' in said
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED
    # Said once: not again on the page after it.
    assert page.status_code == 503 and "Cancel requested" not in page.content.decode()


def test_a_page_held_after_a_form_says_what_the_form_did(operator, monkeypatch):
    """A plain form redirects to its page; held by a lock, that page said
    only "Nothing was changed", and the cancel it had made was said on
    some later page."""
    monkeypatch.setattr("dashboard.security.PAGE_LOCK_WAIT", "300ms")
    run = submit(question="to cancel", documents=["a.md"])
    with psycopg.connect(**connection.get_connection_params()) as stranger:
        stranger.execute("LOCK TABLE evidence_capturegap")
        page = operator.post(f"/runs/{run.pk}/cancel/", CANCELLING, follow=True)
    assert page.status_code == 503
    assert f"Cancel requested for run {run.pk}." in page.content.decode()
    assert "Nothing was changed by loading it." in page.content.decode()


def test_a_page_the_database_cannot_answer_says_so(viewer, run, monkeypatch):
    def gone(self: object) -> None:
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(type(Run.objects), "listing", gone)
    response = viewer.get("/")
    assert response.status_code == 503 and response["Retry-After"] == "5"
    assert "The database did not answer" in response.content.decode()


def test_lock_graph_page_draws_the_cycle(viewer, incident):
    page = viewer.get(f"/locks/{incident.pk}/").content.decode()
    assert 'id="chart-locks-data"' in page
    assert "4102 → 4103 → 4104 → 4102" in page


def test_log_upload_is_for_operators_with_a_size_limit_and_clear_errors(viewer, operator):
    upload = SimpleUploadedFile("pg.log", THREE_WAY.encode())
    assert viewer.post("/locks/import/", {"log": upload}).status_code == 403
    strict = signed_in(make_user("strict", operator=True), enforce_csrf_checks=True)
    no_token = SimpleUploadedFile("pg.log", THREE_WAY.encode())
    assert strict.post("/locks/import/", {"log": no_token}).status_code == 403
    assert viewer.get("/locks/import/").status_code == 405
    response = operator.post(
        "/locks/import/", {"log": SimpleUploadedFile("pg.log", THREE_WAY.encode())}, follow=True
    )
    assert "1 deadlock reports imported from pg.log" in response.content.decode()
    assert LockIncident.objects.filter(source=IncidentSource.LOG).count() == 1
    again = operator.post(
        "/locks/import/", {"log": SimpleUploadedFile("pg.log", THREE_WAY.encode())}, follow=True
    )
    assert (
        "0 deadlock reports imported from pg.log. 1 had been imported before"
        in again.content.decode()
    )
    assert LockIncident.objects.filter(source=IncidentSource.LOG).count() == 1
    empty = operator.post(
        "/locks/import/", {"log": SimpleUploadedFile("x.log", b"LOG: fine\n")}, follow=True
    )
    assert "No &#x27;deadlock detected&#x27; report found in x.log" in empty.content.decode()
    oversized = SimpleUploadedFile("huge.log", b"x" * (7 * 1024 * 1024))
    assert operator.post("/locks/import/", {"log": oversized}).status_code == 413  # unread
    huge = SimpleUploadedFile("big.log", b"x" * (5 * 1024 * 1024 + 1))
    refused = operator.post("/locks/import/", {"log": huge}, follow=True).content.decode()
    assert "the limit is 5242880" in refused
    assert LockIncident.objects.filter(source=IncidentSource.LOG).count() == 1


def test_gaps_page_shows_gaps_by_reason_and_run(viewer, run):
    record_gaps(Counter({(run.pk, None, "queue_full", "capacity 5"): 3}))
    page = viewer.get("/gaps/").content.decode()
    assert 'id="chart-gaps-data"' in page and "capture queue full" in page
    assert f'href="/runs/{run.pk}/"' in page


@pytest.mark.parametrize("model", ["run", "action", "receipt", "answerrevision", "runevent"])
def test_admin_lists_every_model_for_staff(staff, run, model):
    assert staff.get(f"/admin/runs/{model}/").status_code == 200


def test_admin_never_offers_to_delete_a_receipt(staff, run):
    receipt = run.receipts.first()
    response = staff.get(f"/admin/runs/receipt/{receipt.pk}/delete/")
    assert response.status_code == 403

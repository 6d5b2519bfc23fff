"""The "Needs you" page, where sign-in lands: every kind of trouble a person
must act on, each line linking to where it is acted on, and nothing else;
a plain sentence when nothing needs anyone.  A waiting run's page offers
what lets it go on at its top; the inbox keeps the items of ended runs
apart, out of the badge; the runs list offers to clear its filters."""

from __future__ import annotations

import datetime as dt
import re
import uuid

import pytest
from django.test import Client
from django.utils import timezone

from evidence.models import BundleExport, BundleState
from runs.models import (
    Alert,
    AlertChannel,
    AlertState,
    Drill,
    DrillResult,
    DrillState,
    DrillVerdict,
    OutcomeItem,
    OutcomeKind,
    Phase,
    Run,
    RunStatus,
)
from runs.outcomes import open_item
from tests.conftest import PASSWORD, make_user

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("short_settle")]

ENDED = (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED)


def run_in(status: RunStatus, *, reason: str = "", drill: bool = False) -> Run:
    # Inserted in that status: the lifecycle leads from queued to most of
    # them only through an owner.
    fields: dict[str, object] = {"status": status, "status_reason": reason, "is_drill": drill}
    if status in ENDED:
        fields["finished_at"] = timezone.now()
    if status == RunStatus.COMPLETED:
        fields["phase"] = Phase.DONE
    if status == RunStatus.RUNNING:
        fields.update(lease_owner="executor@host-7:123", lease_epoch=3)
        fields["lease_expires_at"] = timezone.now() + dt.timedelta(minutes=5)
    run = Run.objects.create(question=f"a run {status}", documents=["a.md"], **fields)
    return Run.objects.get(pk=run.pk)


def item_of(run: Run, kind: OutcomeKind = OutcomeKind.PUBLICATION) -> OutcomeItem:
    """An unanswered publication (its transaction not known, no row)."""
    return open_item(
        run_id=run.pk,
        kind=kind,
        subject=f"{kind}:{uuid.uuid4().hex}",
        summary=f"{kind} of run {run.pk}: COMMIT sent, no answer",
        evidence={"xid": None, "afterwards": "the run waits for an operator"},
        revision_number=1,
    )


def lines(client: Client) -> str:
    page = client.get("/needs-you/")
    assert page.status_code == 200
    html = page.content.decode()
    return html[html.index('id="needs-you-lines"') :]


def section(html: str, name: str) -> str:
    start = html.index(f'id="{name}"')
    return html[start : html.index("</section>", start)]


# -- who may see it ---------------------------------------------------------------------


def test_anonymous_is_sent_to_sign_in(client):
    response = client.get("/needs-you/")
    assert response.status_code == 302
    assert response["Location"] == "/login/?next=/needs-you/"


@pytest.mark.parametrize("method", ["post", "put", "delete"])
def test_the_page_only_reads(viewer, method):
    assert getattr(viewer, method)("/needs-you/").status_code == 405


@pytest.mark.parametrize(
    "asked, lands", [("", "/needs-you/"), ("/", "/needs-you/"), ("/inbox/", "/inbox/")]
)
def test_sign_in_lands_on_needs_you_unless_another_page_was_asked_for(client, asked, lands):
    make_user("viewer")
    form = {"username": "viewer", "password": PASSWORD, **({"next": asked} if asked else {})}
    response = client.post("/login/", form)
    assert response.status_code == 302 and response["Location"] == lands
    page = client.get(lands).content.decode()
    assert "Needs you</a>" in page  # the navigation's first link


def test_when_nothing_needs_anyone_the_page_says_so(viewer):
    run_in(RunStatus.COMPLETED)
    run_in(RunStatus.QUEUED)
    html = lines(viewer)
    assert 'id="nothing-needs-you"' in html and "Nothing needs anyone now" in html
    assert "<section" not in html


# -- what it lists ------------------------------------------------------------------


def test_every_kind_of_trouble_is_listed_with_where_to_act(viewer):
    now = timezone.now()
    waiting = run_in(RunStatus.NEEDS_OPERATOR, reason="the report's delivery got no answer")
    held = item_of(waiting)
    unheld = run_in(RunStatus.NEEDS_OPERATOR, reason="a receipt does not verify")
    lost = run_in(RunStatus.RUNNING)
    Run.objects.filter(pk=lost.pk).update(lease_expires_at=now - dt.timedelta(minutes=2))
    alive = run_in(RunStatus.RUNNING)  # its lease is renewed: nothing to do
    alert = Alert.objects.create(
        item=held,
        channel=AlertChannel.WEBHOOK,
        state=AlertState.FAILING,
        attempts=3,
        last_error="connection refused by hooks.example.com",
        next_try_at=now + dt.timedelta(minutes=1),
    )
    done = run_in(RunStatus.COMPLETED)
    failed_export = BundleExport.objects.create(
        run=done, requested_by="olga", state=BundleState.FAILED, error="disk full", finished_at=now
    )
    drill = Drill.objects.create(
        scenarios=["kill_executor"], started_by="olga", state=DrillState.DONE, finished_at=now
    )
    DrillResult.objects.create(
        drill=drill,
        scenario="kill_executor",
        verdict=DrillVerdict.FAILED,
        seconds=1.0,
        detail="an action ran twice",
    )
    DrillResult.objects.create(
        drill=drill, scenario="lock_wait", verdict=DrillVerdict.PASSED, seconds=1.0
    )

    html = lines(viewer)
    assert "Nothing needs anyone" not in html
    runs = section(html, "needs-waiting")
    assert f'<a href="/runs/{waiting.pk}/">Run {waiting.pk}</a> waits' in runs
    assert "the report&#x27;s delivery got no answer" in runs
    assert f'<a href="/inbox/{held.pk}/">{held.pk}</a>' in runs
    assert (
        f'<a href="/runs/{unheld.pk}/">Run {unheld.pk}</a>' in runs and "no item holds it" in runs
    )
    leases = section(html, "needs-lease")
    assert f'<a href="/runs/{lost.pk}/">Run {lost.pk}</a>: lease expired' in leases
    assert re.search(r">2\xa0minutes ago</span>", leases)
    assert "stopped renewing" in leases and f"/runs/{alive.pk}/" not in html
    items = section(html, "needs-items")
    assert f'<a href="/inbox/{held.pk}/">Item {held.pk}</a>' in items and "the whole run" in items
    alerts = section(html, "needs-alerts")
    assert (
        f'<a href="/inbox/{alert.item_id}/">' in alerts
        and "connection refused by hooks.example.com" in alerts
    )
    exports = section(html, "needs-exports")
    assert (
        f'href="/runs/{done.pk}/#run-bundles"' in exports
        and f"export {failed_export.pk}" in exports
    )
    assert "disk full" in exports
    drills = section(html, "needs-drills")
    assert (
        "kill_executor" in drills
        and "an action ran twice" in drills
        and 'href="/drills/"' in drills
    )
    assert "lock_wait" not in drills
    # Nothing else: no run that is fine, no table of runs.
    assert html.count(f"/runs/{done.pk}/") == 1  # its export's line only
    assert "<table" not in html


def test_what_needs_nobody_is_left_out(viewer):
    now = timezone.now()
    ended = run_in(RunStatus.CANCELLED)
    item_of(ended)  # its run ended: it blocks nothing
    staged = run_in(RunStatus.NEEDS_OPERATOR, reason="staged by a drill", drill=True)
    item_of(staged)
    sent = Alert.objects.create(
        item=item_of(ended, OutcomeKind.RECEIPT),
        channel=AlertChannel.EMAIL,
        state=AlertState.SENT,
        attempts=1,
        next_try_at=None,
        sent_at=now,
    )
    assert sent.pk
    done = run_in(RunStatus.COMPLETED)
    BundleExport.objects.create(
        run=done,
        requested_by="olga",
        state=BundleState.FAILED,
        error="old",
        finished_at=now - dt.timedelta(days=2),
    )
    retried = run_in(RunStatus.COMPLETED)
    BundleExport.objects.create(
        run=retried,
        requested_by="olga",
        state=BundleState.FAILED,
        error="disk full",
        finished_at=now,
    )
    BundleExport.objects.create(run=retried, requested_by="olga")  # asked again since
    Drill.objects.create(
        scenarios=["lock_wait"], started_by="olga", state=DrillState.DONE, finished_at=now
    )
    html = lines(viewer)
    assert "Nothing needs anyone now" in html, html


def test_a_drill_that_stopped_early_is_a_failure(viewer):
    Drill.objects.create(
        scenarios=["kill_executor"],
        started_by="olga",
        state=DrillState.DONE,
        error="the executor could not be started",
        finished_at=timezone.now(),
    )
    assert "the executor could not be started" in section(lines(viewer), "needs-drills")


def test_the_lines_refresh_alone_and_keep_polling(operator):
    run = run_in(RunStatus.NEEDS_OPERATOR, reason="a receipt does not verify")
    headers = {"HX-Request": "true", "HX-Target": "needs-you-lines"}
    response = operator.get("/needs-you/", headers=headers)
    html = response.content.decode()
    assert response.status_code == 200  # never 286: new trouble may come at any time
    assert html.lstrip().startswith('<div id="needs-you-lines"') and "<html" not in html
    assert f"Run {run.pk}</a> waits" in html and 'hx-trigger="every 5s"' in html
    Run.objects.filter(pk=run.pk).update(status=RunStatus.QUEUED)
    assert (
        "Nothing needs anyone now" in operator.get("/needs-you/", headers=headers).content.decode()
    )


# -- a waiting run's page ------------------------------------------------------------


def test_a_waiting_runs_choices_stand_at_the_top_of_its_page(operator, viewer):
    run = run_in(RunStatus.NEEDS_OPERATOR, reason="the report's delivery got no answer")
    item = item_of(run)
    page = operator.get(f"/runs/{run.pk}/").content.decode()
    top = page[page.index('id="run-unblock"') :]
    # Before the facts, the cancel button and everything below.
    assert page.index('id="run-unblock"') < page.index('class="facts"') < page.index("Cancel run")
    assert page.index('id="run-unblock"') < page.index("<h2>Timeline</h2>")
    assert "the report&#x27;s delivery got no answer" in top[: top.index("</section>")]
    assert f'<a class="button" href="/inbox/{item.pk}/">Decide item {item.pk}</a>' in top
    assert "Offered: check the evidence again" in top
    assert 'id="run-decide"' in top[: top.index('class="facts"')]  # abandon, for the whole run
    assert page.count('id="run-decisions"') == 1
    # A viewer reads the same, and is told operators decide.
    seen = viewer.get(f"/runs/{run.pk}/").content.decode()
    assert 'id="run-unblock"' in seen and 'id="run-decide"' not in seen
    assert "Operators decide" in seen


def test_a_run_no_item_holds_offers_resume_at_the_top(operator):
    run = run_in(RunStatus.NEEDS_OPERATOR, reason="a receipt does not verify")
    page = operator.get(f"/runs/{run.pk}/").content.decode()
    top = page[page.index('id="run-unblock"') : page.index('class="facts"')]
    assert 'value="resume"' in top and 'value="abandon"' in top
    assert "Decide item" not in top


def test_a_live_region_that_finds_the_run_waiting_shows_its_choices(operator):
    run = run_in(RunStatus.NEEDS_OPERATOR, reason="a receipt does not verify")
    region = operator.get(f"/runs/{run.pk}/live/", headers={"HX-Request": "true"})
    html = region.content.decode()
    assert 'id="run-unblock"' in html and 'value="resume"' in html
    # The decision comes back to the run page, not to the region's address.
    assert f'name="next" value="/runs/{run.pk}/"' in html


@pytest.mark.parametrize("status", [RunStatus.RUNNING, RunStatus.COMPLETED, RunStatus.CANCELLED])
def test_a_run_that_does_not_wait_offers_nothing_at_the_top(operator, status):
    run = run_in(status)
    assert 'id="run-unblock"' not in operator.get(f"/runs/{run.pk}/").content.decode()


# -- the inbox and its badge ---------------------------------------------------------


def badge(html: str) -> str:
    return re.search(r'id="nav-inbox">Inbox <span class="badge[^"]*"[^>]*>([^<]*)<', html).group(1)


def test_items_of_ended_runs_leave_the_badge_for_a_section_of_their_own(viewer):
    waiting = item_of(run_in(RunStatus.NEEDS_OPERATOR))
    ended = {status: item_of(run_in(status)) for status in ENDED}
    page = viewer.get("/inbox/").content.decode()
    assert badge(page) == "1"
    rows = page[
        page.index('id="inbox-rows"') : page.index("</tbody>", page.index('id="inbox-rows"'))
    ]
    assert f'href="/inbox/{waiting.pk}/"' in rows
    assert all(f'href="/inbox/{item.pk}/"' not in rows for item in ended.values())
    apart = section(page, "inbox-ended")
    assert "No longer blocking" in apart
    assert all(f'href="/inbox/{item.pk}/"' in apart for item in ended.values())
    assert "1 open, 3 no longer blocking" in page
    # Still decidable, for the record: the item page offers its choices.
    item_page = viewer.get(f"/inbox/{ended[RunStatus.CANCELLED].pk}/")
    assert item_page.status_code == 200 and "check the evidence again" in item_page.content.decode()
    # When the waiting run ends too, the badge says nobody is needed.
    Run.objects.filter(pk=waiting.run_id).update(
        status=RunStatus.CANCELLED, finished_at=timezone.now()
    )
    page = viewer.get("/inbox/").content.decode()
    assert badge(page) == "0" and "Nothing open that needs anyone." in page


# -- the runs list ----------------------------------------------------------------------


@pytest.mark.parametrize("query", ["status=queued", "unknown=1", "gaps=1", "drills=1", "q=fund"])
def test_a_filtered_runs_list_offers_to_clear_its_filters(viewer, query):
    page = viewer.get(f"/?{query}").content.decode()
    assert '<a href="/" id="clear-filters">clear filters</a>' in page


def test_an_unfiltered_runs_list_has_nothing_to_clear(viewer):
    assert 'id="clear-filters"' not in viewer.get("/").content.decode()
    assert 'id="clear-filters"' not in viewer.get("/?status=&q=").content.decode()

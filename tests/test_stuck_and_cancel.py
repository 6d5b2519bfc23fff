"""Stuck runs say so, and a cancel asks why (issue 36, points 3 and 5).

A running run whose owner stopped renewing its lease says "lease expired
… ago: the owner stopped renewing" in warning colour, on its page, in the
runs list and on its items' pages alike; a run queued for long says that
no executor took it, and what is known of the executors; a lock incident
always has a summary, a start, an end (or "still going") and a duration in
human units.  A cancel asks for a reason and a confirmation, keeps the
reason with the run, and after the run ended says how it ended."""

from __future__ import annotations

import datetime as dt
import re

import pytest
from django.test import Client
from django.utils import timezone

from evidence.models import IncidentSource, LockIncident, LockWait
from runs.models import OutcomeKind, Phase, Run, RunStatus
from runs.outcomes import open_item
from runs.words import human_duration
from tests.conftest import make_user, signed_in

pytestmark = pytest.mark.django_db

CANCELLING = {"reason": "asked the wrong question", "confirm": "on"}
EXPIRED = re.compile(r"lease expired 2 min( \d+ s)? ago: the owner stopped renewing")


@pytest.fixture
def operator_name() -> str:
    return "olga"


def run_in(status: RunStatus, **fields: object) -> Run:
    """A run inserted in `status` (the lifecycle leads there only through
    an owner)."""
    if status in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED):
        fields.setdefault("finished_at", timezone.now())
    if status == RunStatus.COMPLETED:
        fields["phase"] = Phase.DONE
    if status == RunStatus.RUNNING:
        fields.setdefault("lease_owner", "executor@host-7:123")
        fields.setdefault("lease_epoch", 3)
        fields.setdefault("lease_expires_at", timezone.now() + dt.timedelta(minutes=5))
    run = Run.objects.create(
        question=f"a run {status}", documents=["a.md"], status=status, **fields
    )
    return Run.objects.get(pk=run.pk)


def expired_run() -> Run:
    return run_in(RunStatus.RUNNING, lease_expires_at=timezone.now() - dt.timedelta(minutes=2))


def page_of(client: Client, run: Run) -> str:
    response = client.get(f"/runs/{run.pk}/")
    assert response.status_code == 200
    return response.content.decode()


def element(html: str, id_: str) -> str:
    """The opening tag and text of the element with `id_`, up to its close."""
    start = html.rindex("<", 0, html.index(f'id="{id_}"'))
    return html[start : html.index("</", start)]


# -- durations --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "said"),
    [
        (0.35, "350 ms"),
        (4.2, "4.2 s"),
        (44, "44 s"),
        (104.47, "1 min 44 s"),
        (120, "2 min"),
        (25 * 60 + 10, "25 min"),
        (65 * 60, "1 h 5 min"),
        (3 * 86400 + 2 * 3600, "3 d 2 h"),
    ],
)
def test_a_duration_is_said_in_human_units(seconds: float, said: str) -> None:
    assert human_duration(seconds) == said


# -- a lease that expired -----------------------------------------------------------


def test_a_run_whose_lease_expired_says_so_in_warning_colour(viewer) -> None:
    run = expired_run()
    html = page_of(viewer, run)
    status = element(html, "run-status")
    assert 'class="status running warning"' in status and EXPIRED.search(status)
    lease = html[html.index('id="run-lease"') : html.index("</dd>", html.index('id="run-lease"'))]
    assert (
        'class="warning"' in lease
        and EXPIRED.search(lease)
        and "was held by <code>executor@host-7:123</code>" in lease
    )
    assert "until" in lease and "renewing" in lease


def test_a_running_run_whose_owner_renews_is_calm(viewer) -> None:
    run = run_in(RunStatus.RUNNING)
    html = page_of(viewer, run)
    assert '<span class="status running" id="run-status">running</span>' in html
    assert "lease expired" not in html and 'id="run-lease">' in html


def test_the_runs_list_row_says_the_lease_expired(viewer) -> None:
    run = expired_run()
    calm = run_in(RunStatus.RUNNING)
    html = viewer.get("/").content.decode()
    row = html[html.index(f'<a href="/runs/{run.pk}/">') :]
    row = row[: row.index("</tr>")]
    assert 'class="status running warning"' in row and EXPIRED.search(row)
    other = html[html.index(f'<a href="/runs/{calm.pk}/">') :]
    assert '<span class="status running">running</span>' in other[: other.index("</tr>")]


def test_an_items_page_says_what_its_run_is_doing_now(viewer) -> None:
    """The item said "waits for an operator" while the run page said
    "running": both now say the lease expired."""
    run = expired_run()
    item = open_item(
        run_id=run.pk,
        kind=OutcomeKind.RECEIPT,
        subject="receipt:stuck",
        summary="receipt of the search: no answer",
        evidence={},
    )
    html = viewer.get(f"/inbox/{item.pk}/").content.decode()
    assert EXPIRED.search(html)
    assert f'<span class="status running">{EXPIRED.search(html)[0]}' in html


# -- a queue nobody takes from ------------------------------------------------------


def test_a_run_queued_for_long_with_no_executor_says_none_took_it(viewer) -> None:
    run_in(RunStatus.COMPLETED, started_at=timezone.now() - dt.timedelta(minutes=5))
    run = run_in(RunStatus.QUEUED, queued_at=timezone.now() - dt.timedelta(seconds=70))
    html = page_of(viewer, run)
    queue = element(html, "run-queue")
    assert 'class="warning"' in queue
    assert re.search(r"queued for 1 min 1\d s: no executor has taken it", queue)
    assert re.search(r"none has claimed a new run in the last 5 min( \d+ s)?", queue)
    assert 'class="status queued warning"' in element(html, "run-status")


def test_a_run_queued_while_every_executor_is_busy_names_them_and_their_runs(viewer) -> None:
    busy = [run_in(RunStatus.RUNNING) for _ in range(2)]
    other = run_in(RunStatus.RUNNING, lease_owner="executor@host-9:55")
    expired_run()  # its owner stopped: not an executor known to be alive
    run = run_in(RunStatus.QUEUED, queued_at=timezone.now() - dt.timedelta(seconds=61))
    queue = element(page_of(viewer, run), "run-queue")
    assert re.search(r"queued for 1 min( \d s)?: no executor free", queue)
    assert "2 executors renew a lease now" in queue
    assert f"executor@host-7:123 (runs {busy[0].pk}, {busy[1].pk})" in queue
    assert f"executor@host-9:55 (run {other.pk})" in queue


def test_a_run_just_queued_says_nothing_about_executors(viewer) -> None:
    run = run_in(RunStatus.QUEUED)
    html = page_of(viewer, run)
    assert 'id="run-queue"' not in html
    assert '<span class="status queued" id="run-status">queued</span>' in html


# -- lock incidents -----------------------------------------------------------------


def sampled(ended: dt.datetime | None, last_seen: dt.datetime) -> LockIncident:
    started = last_seen - dt.timedelta(milliseconds=104470)
    incident = LockIncident.objects.create(
        source=IncidentSource.SAMPLER, started_at=started, ended_at=ended, processes=2
    )
    LockWait.objects.create(
        incident=incident,
        waiter_pid=4101,
        waiter_role="heartbeat",
        blocker_pid=4102,
        blocker_role="publication",
        mode="RowExclusiveLock",
        lock_type="relation",
        locked="relation runs_run",
        first_seen=started,
        last_seen=last_seen,
        waited_ms=104470,
    )
    return incident


def test_a_sampled_incident_says_its_summary_start_end_and_duration(viewer) -> None:
    now = timezone.now()
    incident = sampled(ended=now, last_seen=now)
    detail = viewer.get(f"/locks/{incident.pk}/").content.decode()
    summary = element(detail, "incident-summary")
    assert "heartbeat 4101 waited 1 min 44 s for RowExclusiveLock on relation runs_run" in summary
    assert "publication 4102" in summary
    assert timezone.localtime(now).strftime("%H:%M:%S") in element(detail, "incident-ended")
    assert element(detail, "incident-lasted").endswith("1 min 44 s")
    assert "104470 ms" not in detail and "1 min 44 s" in detail
    listing = viewer.get("/locks/").content.decode()
    assert "heartbeat 4101 waited 1 min 44 s" in listing and "104470" not in listing


def test_an_incident_the_sampler_still_watches_is_still_going(viewer) -> None:
    incident = sampled(ended=None, last_seen=timezone.now())
    detail = viewer.get(f"/locks/{incident.pk}/").content.decode()
    assert "still going" in element(detail, "incident-ended")
    assert re.search(r"1 min 4\d s so far", element(detail, "incident-lasted"))
    assert "still going" in viewer.get("/locks/").content.decode()


def test_an_incident_whose_sampler_stopped_is_not_said_to_go_on(viewer) -> None:
    last = timezone.now() - dt.timedelta(minutes=10)
    incident = sampled(ended=None, last_seen=last)
    detail = viewer.get(f"/locks/{incident.pk}/").content.decode()
    ended = element(detail, "incident-ended")
    assert "still going" not in ended and "the sampler stopped watching" in ended
    assert timezone.localtime(last).strftime("%H:%M:%S") in ended
    assert "at least 1 min 44 s" in element(detail, "incident-lasted")


def test_an_incident_with_no_wait_read_still_has_a_summary(viewer) -> None:
    incident = LockIncident.objects.create(source=IncidentSource.REPRODUCTION)
    detail = viewer.get(f"/locks/{incident.pk}/").content.decode()
    assert "no wait was read" in element(detail, "incident-summary")
    assert "not known" in element(detail, "incident-lasted")


# -- the cancel form ----------------------------------------------------------------


def test_the_cancel_form_asks_for_a_reason_and_a_confirmation(operator, viewer) -> None:
    run = run_in(RunStatus.QUEUED)
    html = page_of(operator, run)
    form = html[html.index('id="run-cancel"') : html.index("</details>")]
    assert f"Cancel run {run.pk}…</summary>" in form
    assert re.search(r'<textarea name="reason"[^>]*required', form)
    assert re.search(r'<input type="checkbox" name="confirm"[^>]*required', form)
    assert 'id="run-cancel"' not in page_of(viewer, run)  # a viewer is offered none


def test_an_anonymous_cancel_goes_to_sign_in_and_changes_nothing(client) -> None:
    run = run_in(RunStatus.QUEUED)
    response = client.post(f"/runs/{run.pk}/cancel/", CANCELLING)
    assert response.status_code == 302 and response["Location"].startswith("/login/")
    assert Run.objects.get(pk=run.pk).cancel_requested_at is None


def test_a_viewer_cannot_cancel(viewer) -> None:
    run = run_in(RunStatus.QUEUED)
    assert viewer.post(f"/runs/{run.pk}/cancel/", CANCELLING).status_code == 403
    assert Run.objects.get(pk=run.pk).status == RunStatus.QUEUED


def test_the_cancel_address_takes_only_a_post(operator) -> None:
    run = run_in(RunStatus.QUEUED)
    response = operator.get(f"/runs/{run.pk}/cancel/")
    assert response.status_code == 405 and "POST" in response["Allow"]


def test_a_cancel_without_its_csrf_token_is_refused() -> None:
    strict = signed_in(make_user("strict", operator=True), enforce_csrf_checks=True)
    run = run_in(RunStatus.QUEUED)
    assert strict.post(f"/runs/{run.pk}/cancel/", CANCELLING).status_code == 403
    assert Run.objects.get(pk=run.pk).cancel_requested_at is None


@pytest.mark.parametrize(
    ("sent", "missing"),
    [
        ({"confirm": "on"}, "Say why the run is cancelled"),
        ({"reason": "   ", "confirm": "on"}, "Say why the run is cancelled"),
        ({"reason": "kept as typed"}, "Tick the box to confirm the cancel"),
    ],
)
def test_a_cancel_without_a_reason_or_confirmation_is_refused_with_the_form_kept(
    operator, sent: dict[str, str], missing: str
) -> None:
    run = run_in(RunStatus.QUEUED)
    response = operator.post(f"/runs/{run.pk}/cancel/", sent)
    assert response.status_code == 400
    html = response.content.decode()
    assert missing in html and '<details class="cancel" id="run-cancel" open>' in html
    if sent.get("reason", "").strip():
        assert "kept as typed</textarea>" in html
    fragment = operator.post(f"/runs/{run.pk}/cancel/", sent, headers={"HX-Request": "true"})
    # htmx swaps no 4xx: the region comes back, saying what is missing.
    assert fragment.status_code == 200 and missing in fragment.content.decode()
    assert fragment.content.decode().lstrip().startswith('<section id="run-live"')
    run.refresh_from_db()
    assert (run.status, run.cancel_requested_at) == (RunStatus.QUEUED, None)


def test_a_cancel_keeps_its_reason_with_the_run(operator, viewer) -> None:
    run = run_in(RunStatus.QUEUED)
    response = operator.post(f"/runs/{run.pk}/cancel/", CANCELLING)
    assert response.status_code == 302 and response["Location"] == f"/runs/{run.pk}/"
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED
    assert run.status_reason == "cancelled by olga: asked the wrong question"
    said = element(page_of(viewer, run), "run-cancelled-by")
    at = timezone.localtime(run.cancel_requested_at).strftime("%H:%M:%S")
    assert f"Cancel asked at {at} by olga (asked the wrong question); the run ended by it" in said


def test_a_cancel_sent_by_htmx_answers_with_the_region(operator) -> None:
    run = run_in(RunStatus.QUEUED)
    fragment = operator.post(f"/runs/{run.pk}/cancel/", CANCELLING, headers={"HX-Request": "true"})
    html = fragment.content.decode()
    assert fragment.status_code == 200 and html.lstrip().startswith('<section id="run-live"')
    assert f"Cancel requested for run {run.pk}." in html and 'id="run-cancel"' not in html


def test_a_running_runs_cancel_says_its_owner_stops_at_its_next_boundary(operator) -> None:
    run = run_in(RunStatus.RUNNING)
    assert operator.post(f"/runs/{run.pk}/cancel/", CANCELLING).status_code == 302
    run.refresh_from_db()
    assert run.status == RunStatus.RUNNING and run.cancel_requested_by == "olga"
    said = element(page_of(operator, run), "run-cancelled-by")
    assert "by olga (asked the wrong question); its owner stops before its next boundary" in said


def test_a_cancel_that_lost_the_race_says_the_run_completed_first(operator) -> None:
    """The run completed before its owner saw the cancel: the page said
    "its owner stops before its next boundary" for ever after."""
    run = run_in(RunStatus.RUNNING)
    assert run.request_cancel(by="olga", reason="too slow")
    asked = Run.objects.get(pk=run.pk).cancel_requested_at
    completed = run_in(RunStatus.COMPLETED, cancel_requested_at=asked, cancel_requested_by="olga")
    completed.events.create(
        kind="cancel_requested", data={"by": "olga", "reason": "too slow"}, created_at=asked
    )
    said = element(page_of(operator, completed), "run-cancelled-by")
    at = timezone.localtime(asked).strftime("%H:%M:%S")
    assert f"Cancel asked at {at} by olga (too slow); the run completed first" in said
    assert "stops before its next boundary" not in said
    failed = run_in(RunStatus.FAILED, cancel_requested_at=asked, cancel_requested_by="olga")
    assert "the run failed first" in element(page_of(operator, failed), "run-cancelled-by")


def test_a_cancel_whose_owner_stopped_says_who_ends_it(operator) -> None:
    run = expired_run()
    assert run.request_cancel(by="olga", reason="stuck")
    said = element(page_of(operator, run), "run-cancelled-by")
    assert "its owner stopped renewing its lease: the next executor to take the run" in said


def test_a_waiting_run_explains_cancel_against_abandon(operator) -> None:
    run = run_in(RunStatus.NEEDS_OPERATOR, status_reason="waits for an operator")
    html = page_of(operator, run)
    said = element(html, "run-cancel-or-abandon")
    assert "Abandon (above) is a decision on the run" in said and "Prefer abandon" in said
    assert html.index('id="run-decide"') < html.index('id="run-cancel"')

"""The holds page (dashboard/holds.py): who may see it, who may add and
release holds, the methods and the CSRF token it requires, what it says;
and where operators find runs waiting on a hold (the inbox, "Needs you",
the run page's timeline)."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from runs import holds
from runs.executor import Ending, claim_and_drive
from runs.models import Hold, Run, RunStatus
from runs.submission import submit
from runs.timeline import timeline
from tests.conftest import make_user, signed_in
from tests.test_holds import INPUT, receivers  # noqa: F401  (a fixture)

pytestmark = pytest.mark.django_db

ADD = {"tool": "send_email", "agent": "support", "reason": "drafts look wrong"}


@pytest.fixture
def alice():
    return make_user("alice", operator=True)


def held_scope(**scope: str) -> Hold:
    return holds.add(holds.Scope(**scope), user=make_user("olga", operator=True), reason="why")


def test_anonymous_visitors_are_sent_to_sign_in():
    client = Client()
    for url in ("/holds/", "/holds/add/", "/holds/1/release/"):
        response = client.get(url) if url == "/holds/" else client.post(url, ADD)
        assert response.status_code == 302 and response["Location"].startswith("/login/"), url
    assert not Hold.objects.exists()


def test_a_viewer_reads_the_page_and_may_neither_add_nor_release(viewer):
    hold = held_scope(tool="send_email", agent="")
    page = viewer.get("/holds/")
    assert page.status_code == 200
    text = page.content.decode()
    assert "send_email of every agent" in text and "Add a hold" not in text
    assert "Release hold" not in text
    assert viewer.post("/holds/add/", ADD).status_code == 403
    assert viewer.post(f"/holds/{hold.pk}/release/", {"reason": "x"}).status_code == 403
    assert Hold.objects.active().count() == 1


def test_an_operator_adds_and_releases_a_hold(operator, operator_user):
    response = operator.post("/holds/add/", ADD, follow=True)
    hold = Hold.objects.get()
    assert (hold.tool, hold.agent, hold.added_by, hold.reason) == (
        "send_email",
        "support",
        operator_user.get_username(),
        "drafts look wrong",
    )
    text = response.content.decode()
    assert f"Hold {hold.pk} added: send_email of support is held." in text
    assert f"Release hold {hold.pk}" in text

    response = operator.post(f"/holds/{hold.pk}/release/", {"reason": "fixed"}, follow=True)
    hold.refresh_from_db()
    assert (hold.released_by, hold.release_reason) == (operator_user.get_username(), "fixed")
    text = response.content.decode()
    assert f"Hold {hold.pk} released: 0 runs back in the queue." in text
    assert "Nothing is held." in text


def test_a_hold_refused_or_incomplete_says_why_and_changes_nothing(operator):
    held_scope(tool="send_email", agent="support")
    again = operator.post("/holds/add/", ADD)
    assert again.status_code == 409
    assert "Not held: send_email of support is already held" in again.content.decode()
    nothing = operator.post("/holds/add/", {**ADD, "tool": "", "agent": ""})
    assert nothing.status_code == 409
    assert "name a tool, or the agent whose every effect is held" in nothing.content.decode()
    unknown = operator.post("/holds/add/", {**ADD, "tool": "send_mail"})
    assert (
        unknown.status_code == 400
        and "not one of the available choices" in unknown.content.decode()
    )
    no_reason = operator.post("/holds/add/", {**ADD, "tool": "update_ticket", "reason": " "})
    assert no_reason.status_code == 400 and "Say why the tool is held" in no_reason.content.decode()
    assert Hold.objects.count() == 1
    unsaid = operator.post(f"/holds/{Hold.objects.get().pk}/release/", {"reason": ""}, follow=True)
    assert "not released: say why" in unsaid.content.decode()
    assert Hold.objects.active().count() == 1


def test_the_wrong_method_is_refused(operator):
    assert operator.post("/holds/", ADD).status_code == 405
    assert operator.get("/holds/add/").status_code == 405
    assert operator.get("/holds/1/release/").status_code == 405


def test_the_forms_need_their_csrf_token(operator_user):
    client = signed_in(operator_user, enforce_csrf_checks=True)
    page = client.get("/holds/").content.decode()
    assert client.post("/holds/add/", ADD).status_code == 403
    assert not Hold.objects.exists()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
    assert client.post("/holds/add/", {**ADD, "csrfmiddlewaretoken": token}).status_code == 302
    hold = Hold.objects.get()
    assert client.post(f"/holds/{hold.pk}/release/", {"reason": "ok"}).status_code == 403
    assert Hold.objects.get().is_active


def test_every_page_links_to_the_holds(viewer):
    assert 'href="/holds/" id="nav-holds"' in viewer.get("/").content.decode()


@pytest.mark.django_db(transaction=True)
def test_runs_waiting_on_a_hold_are_grouped_under_it_in_the_inbox_and_needs_you(
    receivers,  # noqa: F811
    operator,
):
    hold = held_scope(tool="send_email", agent="support")
    runs = [submit(agent="support", input=INPUT) for _ in range(2)]
    for run in runs:
        assert claim_and_drive(run.pk) == Ending.NEEDS_OPERATOR
    inbox = operator.get("/inbox/").content.decode()
    assert f"Hold {hold.pk}: send_email of support" in inbox
    assert "2 runs wait on it" in inbox
    for run in runs:
        assert f'href="/runs/{run.pk}/"' in inbox
    # Not among the runs only a decision on the run lets go on.
    assert "Runs waiting with no item holding them" not in inbox
    needs_you = operator.get("/needs-you/").content.decode()
    assert f'2 runs wait on <a href="/holds/#hold-{hold.pk}">hold {hold.pk}</a>' in needs_you
    # Said under the hold, not run by run among the runs waiting for an operator.
    assert "Runs waiting for an operator" not in needs_you
    page = operator.get("/holds/").content.decode()
    assert "2 runs waiting now; 2 waited in all" in page
    run_page = operator.get(f"/runs/{runs[0].pk}/").content.decode()
    assert (
        f'<a href="/holds/#hold-{hold.pk}">Waits at send on hold {hold.pk} (send_email of '
        "support, held by olga)" in run_page
    )

    holds.release(hold.pk, user=make_user("bob", operator=True), reason="ok")
    for run in runs:
        assert Run.objects.get(pk=run.pk).status == RunStatus.QUEUED
        assert claim_and_drive(run.pk) == Ending.COMPLETED
    timeline.flush()
    run_page = operator.get(f"/runs/{runs[0].pk}/").content.decode()
    assert re.search(
        r"held: send_email by olga: [0-9.]+ (ms|s), ended by the release of bob", run_page
    ), "the hold's wait is a labelled span of the run's timeline"

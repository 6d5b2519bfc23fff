"""The operators' inbox: open items with what they block, the evidence of an
item, and decisions through the pages: only operators decide, a repeated
submit changes nothing, two operators at once make one decision, a decision
on an item settled meanwhile is refused and names the one that stands."""

from __future__ import annotations

import re
import threading
import uuid

import psycopg
import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone

from runs.decisions import Request, Who, decide
from runs.executor import claim_and_drive
from runs.models import (
    AnswerRevision,
    DecisionChoice,
    OperatorDecision,
    OutcomeItem,
    OutcomeKind,
    OutcomeState,
    Receipt,
    Run,
    RunStatus,
)
from runs.outcomes import open_item
from tests.conftest import make_user, signed_in
from tests.faultruns import run_with
from tests.receivers import LocalServer, status

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("short_settle")]

HTMX = {"HTTP_HX_REQUEST": "true"}


@pytest.fixture
def operator_name() -> str:
    return "olga"  # the decisions name who took them


@pytest.fixture
def lost_delivery(settings, journal):
    """A run whose delivery reached a real receiver, but whose answer was lost."""
    with LocalServer(status(200)) as receiver:
        settings.RUNDESK_DELIVERY_URL = receiver.url
        run, outcome = run_with([{"point": "delivery_timeout"}])
        assert outcome == RunStatus.NEEDS_OPERATOR and len(receiver.requests) == 1
        yield run, OutcomeItem.objects.get(run=run, kind=OutcomeKind.EFFECT), receiver


def item_on(run_status: RunStatus, kind: OutcomeKind = OutcomeKind.PUBLICATION) -> OutcomeItem:
    """An open item on a run in `run_status`, without executing anything:
    an unanswered publication whose transaction is not known (the probe
    finds no row)."""
    # Inserted in that status, as an imported run is: no transition of the
    # lifecycle leads from queued to waiting without an owner.
    fields = {"status": run_status}
    if run_status in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED):
        fields["finished_at"] = timezone.now()
    run = Run.objects.create(question=f"a run {run_status}", documents=["a.md"], **fields)
    return open_item(
        run_id=run.pk,
        kind=kind,
        subject=f"{kind}:{uuid.uuid4().hex}",
        summary=f"{kind} of run {run.pk}: COMMIT sent, no answer",
        evidence={"xid": None, "afterwards": "the run waits for an operator"},
        revision_number=1,
    )


def page_token(html: str, form: str = "item-decide") -> str:
    section = html[html.index(f'id="{form}"') :]
    return re.search(r'name="token" value="([0-9a-f]{32})"', section).group(1)


def decision_form(html: str, **fields: str) -> dict[str, str]:
    return {"token": page_token(html), **fields}


# -- who may do what --------------------------------------------------------------------


@pytest.mark.parametrize(
    "method, path",
    [
        ("get", "/inbox/"),
        ("get", "/inbox/1/"),
        ("post", "/inbox/1/decide/"),
        ("post", "/runs/1/decide/"),
    ],
)
def test_anonymous_is_sent_to_sign_in(client, method, path):
    response = getattr(client, method)(path)
    assert response.status_code == 302 and response["Location"].startswith("/login/")


@pytest.mark.parametrize(
    "method, path",
    [
        ("post", "/inbox/"),
        ("post", "/inbox/{item}/"),
        ("get", "/inbox/{item}/decide/"),
        ("get", "/runs/{run}/decide/"),
    ],
)
def test_wrong_method_is_405(operator, method, path):
    item = item_on(RunStatus.NEEDS_OPERATOR)
    url = path.format(item=item.pk, run=item.run_id)
    assert getattr(operator, method)(url).status_code == 405


def test_a_viewer_reads_the_item_and_the_choices_but_gets_no_form(viewer, lost_delivery):
    _, item, _ = lost_delivery
    page = viewer.get(f"/inbox/{item.pk}/").content.decode()
    assert "Operators decide" in page and 'name="token"' not in page
    assert "confirmed: it happened" in page  # the choices, as text


@pytest.mark.parametrize("url", ["/inbox/{item}/decide/", "/runs/{run}/decide/"])
def test_a_viewer_may_not_decide(viewer, url):
    item = item_on(RunStatus.NEEDS_OPERATOR)
    form = {"token": uuid.uuid4().hex, "choice": "abandon", "reason": "I am not allowed"}
    response = viewer.post(url.format(item=item.pk, run=item.run_id), form)
    assert response.status_code == 403
    assert "operator permission" in response.content.decode()
    assert not OperatorDecision.objects.exists()
    assert Run.objects.get(pk=item.run_id).status == RunStatus.NEEDS_OPERATOR


def test_deciding_enforces_csrf(lost_delivery, operator_user):
    _, item, _ = lost_delivery
    client = signed_in(operator_user, enforce_csrf_checks=True)
    page = client.get(f"/inbox/{item.pk}/").content.decode()
    form = decision_form(page, choice="confirmed_happened", reason="in their log")
    assert client.post(f"/inbox/{item.pk}/decide/", form).status_code == 403
    assert not OperatorDecision.objects.exists()
    csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
    response = client.post(f"/inbox/{item.pk}/decide/", {**form, "csrfmiddlewaretoken": csrf})
    assert response.status_code == 302
    assert OperatorDecision.objects.filter(item=item).count() == 1


def test_run_decisions_enforce_csrf(operator_user):
    item = item_on(RunStatus.NEEDS_OPERATOR)
    client = signed_in(operator_user, enforce_csrf_checks=True)
    form = {"token": uuid.uuid4().hex, "choice": "abandon", "reason": "customer withdrew"}
    assert client.post(f"/runs/{item.run_id}/decide/", form).status_code == 403
    assert Run.objects.get(pk=item.run_id).status == RunStatus.NEEDS_OPERATOR


# -- the list ---------------------------------------------------------------------------


def test_the_inbox_lists_open_items_oldest_first_with_what_each_blocks(viewer):
    waiting = item_on(RunStatus.NEEDS_OPERATOR, OutcomeKind.RECEIPT)
    checkpoint = item_on(RunStatus.NEEDS_OPERATOR, OutcomeKind.CHECKPOINT)
    cancelled = item_on(RunStatus.CANCELLED)
    requeued = item_on(RunStatus.QUEUED)
    settled = item_on(RunStatus.NEEDS_OPERATOR)
    OutcomeItem.objects.filter(pk=settled.pk).update(
        state=OutcomeState.SETTLED, resolved_at=settled.created_at, resolution="by evidence"
    )
    page = viewer.get("/inbox/").content.decode()
    rows = re.findall(r'<tr class="blocks-(\w+)">\s*<td><a href="/inbox/(\d+)/"', page)
    assert rows == [
        ("whole_run", str(waiting.pk)),
        ("nothing", str(checkpoint.pk)),
        ("further_effects", str(requeued.pk)),
        # Its run has ended: listed apart, as no longer blocking.
        ("nothing", str(cancelled.pk)),
    ]
    assert page.index('id="inbox-ended"') < page.index(f'href="/inbox/{cancelled.pk}/"')
    assert "3 open, 1 no longer blocking" in page and f'href="/runs/{waiting.run_id}/"' in page
    assert "the whole run" in page and "further effects" in page


def test_the_inbox_filters_by_kind_and_run(viewer):
    receipt = item_on(RunStatus.NEEDS_OPERATOR, OutcomeKind.RECEIPT)
    publication = item_on(RunStatus.NEEDS_OPERATOR, OutcomeKind.PUBLICATION)
    by_kind = viewer.get("/inbox/?kind=receipt").content.decode()
    assert f'href="/inbox/{receipt.pk}/"' in by_kind
    assert f'href="/inbox/{publication.pk}/"' not in by_kind
    by_run = viewer.get(f"/inbox/?run={publication.run_id}").content.decode()
    assert f'href="/inbox/{publication.pk}/"' in by_run
    assert f'href="/inbox/{receipt.pk}/"' not in by_run


@pytest.mark.parametrize("query", ["kind=meteor", "run=abc", "run=-1", "after=not-a-cursor"])
def test_the_inbox_refuses_filters_it_cannot_use(viewer, query):
    response = viewer.get(f"/inbox/?{query}")
    assert response.status_code == 400
    assert query.split("=")[0] in response.content.decode()


def test_nul_in_a_parameter_is_400_and_decides_nothing(operator):
    item = item_on(RunStatus.NEEDS_OPERATOR)
    assert operator.get("/inbox/?run=%00").status_code == 400
    assert operator.get(f"/inbox/{item.pk}/?x=%00").status_code == 400
    form = {"token": uuid.uuid4().hex, "choice": "check_again", "reason": "a\x00b"}
    assert operator.post(f"/inbox/{item.pk}/decide/", form).status_code == 400
    assert operator.post(f"/runs/{item.run_id}/decide/", form).status_code == 400
    assert not OperatorDecision.objects.exists()


def test_the_inbox_pages_oldest_first(viewer, monkeypatch):
    monkeypatch.setattr("dashboard.inbox.PAGE_SIZE", 2)
    items = [item_on(RunStatus.NEEDS_OPERATOR) for _ in range(3)]
    first = viewer.get("/inbox/").content.decode()
    assert f'href="/inbox/{items[2].pk}/"' not in first
    cursor = re.search(r'after=([^"]+)">newer', first).group(1).replace("&amp;", "&")
    second = viewer.get(f"/inbox/?after={cursor}").content.decode()
    assert f'href="/inbox/{items[2].pk}/"' in second
    assert f'href="/inbox/{items[0].pk}/"' not in second


def test_the_rows_refresh_while_items_are_open_and_stop_when_none_is(viewer):
    item = item_on(RunStatus.NEEDS_OPERATOR)
    headers = {**HTMX, "HTTP_HX_TARGET": "inbox-rows"}
    response = viewer.get("/inbox/", **headers)
    assert response.status_code == 200
    fragment = response.content.decode()
    assert fragment.lstrip().startswith('<tbody id="inbox-rows"') and "every 3s" in fragment
    OutcomeItem.objects.filter(pk=item.pk).update(
        state=OutcomeState.SETTLED, resolved_at=item.created_at, resolution="by evidence"
    )
    response = viewer.get("/inbox/", **headers)
    assert response.status_code == 286  # htmx stops polling
    assert "Nothing open" in response.content.decode()


# -- the item page ------------------------------------------------------------------------


def test_the_item_page_says_what_is_known_and_shows_the_evidence_as_fields(operator, lost_delivery):
    run, item, _ = lost_delivery
    page = operator.get(f"/inbox/{item.pk}/").content.decode()
    assert "Known: delivering the report to 127.0.0.1 was dispatched at" in page
    assert "Not known: whether the receiver has it" in page
    assert f"rundesk:run-{run.pk}:deliver" in page  # the identity, in the boundary
    for label in (
        "The boundary (written before dispatch)",
        "Input digest (SHA-256)",
        "What the runtime saw",
        "Idempotency-Key sent",
        "Receiver&#x27;s answer",
        "Receiver",
        "Receipts of the run",
        "What the run did afterwards",
    ):
        assert label in page
    assert "{&#x27;" not in page  # never a raw Python dict
    # The choices, each with what it will do, as a form with a fresh token.
    for choice in ("confirmed_happened", "resend_same_identity", "confirmed_not_happened"):
        assert f'value="{choice}"' in page
    assert 'name="reference"' in page and '<textarea name="reason"' in page
    again = operator.get(f"/inbox/{item.pk}/").content.decode()
    assert page_token(page) != page_token(again)


def test_the_item_page_rechecks_a_writes_transaction_on_load(viewer):
    item = item_on(RunStatus.NEEDS_OPERATOR)
    page = viewer.get(f"/inbox/{item.pk}/").content.decode()
    assert "Now (checked when this page loaded)" in page
    assert "Row found by identity (probe)" in page
    assert "The evidence now says: not written" in page


def test_an_unknown_item_is_404(viewer):
    assert viewer.get("/inbox/987654/").status_code == 404


# -- deciding ---------------------------------------------------------------------------


def test_confirmed_happened_through_the_page_completes_the_run_with_one_delivery(
    operator, lost_delivery
):
    run, item, receiver = lost_delivery
    page = operator.get(f"/inbox/{item.pk}/").content.decode()
    form = decision_form(
        page, choice="confirmed_happened", reason="in the receiver's log", reference="D-7"
    )
    response = operator.post(f"/inbox/{item.pk}/decide/", form)
    assert response.status_code == 302 and response["Location"] == f"/inbox/{item.pk}/"
    item.refresh_from_db()
    assert item.state == OutcomeState.SETTLED
    assert Run.objects.get(pk=run.pk).status == RunStatus.QUEUED
    decision = OperatorDecision.objects.get(item=item)
    assert (decision.decided_by, decision.reason, decision.reference) == (
        "olga",
        "in the receiver's log",
        "D-7",
    )
    assert Receipt.objects.get(action=item.action).result["reference"] == "D-7"

    after = operator.get(f"/inbox/{item.pk}/").content.decode()
    assert "Recorded: confirmed: it happened by olga" in after
    assert f"Run {run.pk} is back in the queue" in after
    assert (
        f'id="decision-{decision.pk}"' in after
        and 'name="choice"'
        not in after.split("Decisions on this item")[0].split("<h2>Decide</h2>")[1]
    )

    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    assert len(receiver.requests) == 1  # never sent again
    assert AnswerRevision.objects.filter(run=run, is_final=True).exists()


def test_the_same_token_posted_twice_is_one_decision(operator, lost_delivery):
    _, item, _ = lost_delivery
    page = operator.get(f"/inbox/{item.pk}/").content.decode()
    form = decision_form(page, choice="confirmed_happened", reason="in their log")
    first = operator.post(f"/inbox/{item.pk}/decide/", form)
    again = operator.post(f"/inbox/{item.pk}/decide/", form, follow=True)
    assert first.status_code == 302 and again.status_code == 200
    assert "Already recorded: confirmed: it happened by olga" in again.content.decode()
    assert OperatorDecision.objects.filter(item=item).count() == 1
    htmx = operator.post(f"/inbox/{item.pk}/decide/", form, **HTMX)
    assert htmx.status_code == 200 and "Already recorded" in htmx.content.decode()
    assert OperatorDecision.objects.filter(item=item).count() == 1


def test_a_decision_on_an_item_settled_meanwhile_is_refused_and_names_the_winner(
    operator, lost_delivery
):
    _, item, _ = lost_delivery
    page = operator.get(f"/inbox/{item.pk}/").content.decode()
    winner = decide(
        item.pk,
        Request(
            choice=DecisionChoice.CONFIRMED_NOT_HAPPENED,
            who=Who(user=make_user("omar", operator=True)),
            token=uuid.uuid4().hex,
            reason="the receiver has no record",
        ),
    ).decision
    form = decision_form(page, choice="confirmed_happened", reason="I saw it there")
    response = operator.post(f"/inbox/{item.pk}/decide/", form, follow=True)
    said = response.content.decode()
    assert "Not decided: already settled by omar" in said
    assert f"(decision {winner.pk}): the receiver has no record" in said
    htmx = operator.post(f"/inbox/{item.pk}/decide/", {**form, "token": uuid.uuid4().hex}, **HTMX)
    assert htmx.status_code == 409 and "already settled by omar" in htmx.content.decode()
    assert list(OperatorDecision.objects.filter(item=item)) == [winner]


def test_two_operators_posting_at_once_make_exactly_one_decision(lost_delivery):
    _, item, _ = lost_delivery
    clients = []
    for name in ("olga", "omar"):
        clients.append(signed_in(make_user(name, operator=True)))
    choices = ["confirmed_happened", "confirmed_not_happened"]
    barrier = threading.Barrier(2)
    statuses: list[int] = []

    def posting(client: Client, choice: str) -> None:
        try:
            form = {"token": uuid.uuid4().hex, "choice": choice, "reason": "mine to decide"}
            barrier.wait()
            response = client.post(f"/inbox/{item.pk}/decide/", form, **HTMX)
            statuses.append(response.status_code)
        finally:
            connection.close()  # each thread had its own connection

    threads = [threading.Thread(target=posting, args=pair) for pair in zip(clients, choices)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(statuses) == [200, 409]
    assert OperatorDecision.objects.filter(item=item).count() == 1
    assert OutcomeItem.objects.get(pk=item.pk).state == OutcomeState.SETTLED


@pytest.mark.parametrize(
    "fields, said",
    [
        ({"choice": "confirmed_happened", "reason": "  "}, "say why: a reason is required"),
        ({"choice": "written", "reason": "guess"}, "written is not offered for this item"),
        ({"choice": "", "reason": "no choice"}, "choose one of the choices"),
    ],
)
def test_a_decision_without_a_reason_or_not_offered_is_refused(
    operator, lost_delivery, fields, said
):
    _, item, _ = lost_delivery
    response = operator.post(
        f"/inbox/{item.pk}/decide/", {"token": uuid.uuid4().hex, **fields}, follow=True
    )
    assert said in response.content.decode()
    assert not OperatorDecision.objects.exists()
    assert OutcomeItem.objects.get(pk=item.pk).state == OutcomeState.OPEN


@pytest.mark.parametrize("token", ["", "x" * 101])
def test_a_decision_without_a_usable_token_is_400(operator, token):
    item = item_on(RunStatus.NEEDS_OPERATOR)
    form = {"token": token, "choice": "check_again", "reason": "look"}
    assert operator.post(f"/inbox/{item.pk}/decide/", form).status_code == 400
    assert not OperatorDecision.objects.exists()


def test_an_item_page_a_stranger_holds_answers_503_instead_of_hanging(viewer, monkeypatch):
    """The page asks the database about the write (its probe reads the
    receipts): under a lock it gives up, and says so."""
    monkeypatch.setattr("dashboard.security.PAGE_LOCK_WAIT", "300ms")
    item = item_on(RunStatus.NEEDS_OPERATOR)
    with psycopg.connect(**connection.get_connection_params()) as stranger:
        stranger.execute("LOCK TABLE runs_receipt IN ACCESS EXCLUSIVE MODE")
        response = viewer.get(f"/inbox/{item.pk}/")
    assert response.status_code == 503
    assert viewer.get(f"/inbox/{item.pk}/").status_code == 200


# -- the run ------------------------------------------------------------------------------


def test_abandon_from_the_item_page_ends_the_run_and_returns_to_the_page(operator, lost_delivery):
    run, item, receiver = lost_delivery
    page = operator.get(f"/inbox/{item.pk}/").content.decode()
    run_form = page[page.index('id="run-decide"') :]
    assert 'value="abandon"' in run_form and 'value="resume"' not in run_form  # item holds it
    form = {
        "token": page_token(page, "run-decide"),
        "next": f"/inbox/{item.pk}/",
        "choice": "abandon",
        "reason": "customer withdrew",
    }
    response = operator.post(f"/runs/{run.pk}/decide/", form)
    assert response.status_code == 302 and response["Location"] == f"/inbox/{item.pk}/"
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED
    assert run.status_reason == "abandoned by olga: customer withdrew"
    after = operator.get(f"/inbox/{item.pk}/").content.decode()
    assert "Decisions on the run" in after and "customer withdrew" in after
    assert claim_and_drive(run.pk) == "not_claimable" and len(receiver.requests) == 1


def test_resume_is_refused_while_an_item_holds_the_run(operator):
    item = item_on(RunStatus.NEEDS_OPERATOR)
    form = {"token": uuid.uuid4().hex, "choice": "resume", "reason": "go on"}
    response = operator.post(f"/runs/{item.run_id}/decide/", form, **HTMX)
    assert response.status_code == 409
    assert "resume is not offered" in response.content.decode()
    assert "waits for an operator</span>" in response.content.decode()  # the run, in words
    assert Run.objects.get(pk=item.run_id).status == RunStatus.NEEDS_OPERATOR


def test_resume_puts_a_run_no_item_holds_back_in_the_queue(operator):
    item = item_on(RunStatus.NEEDS_OPERATOR, OutcomeKind.CHECKPOINT)  # holds nothing
    form = {
        "token": uuid.uuid4().hex,
        "choice": "resume",
        "reason": "checkpoint only",
        "next": "https://elsewhere.example/",
    }
    response = operator.post(f"/runs/{item.run_id}/decide/", form)
    assert response["Location"] == f"/runs/{item.run_id}/"  # never off the site
    assert Run.objects.get(pk=item.run_id).status == RunStatus.QUEUED
    again = operator.post(f"/runs/{item.run_id}/decide/", form, follow=True)
    assert "Already recorded: resume the run by olga" in again.content.decode()
    assert OperatorDecision.objects.filter(run_id=item.run_id).count() == 1


@pytest.mark.parametrize("back", ["x", "runs-list", "-1", "é😀", "//elsewhere.example/", "/\\x"])
def test_a_run_decision_returns_to_its_run_page_when_next_is_no_path_of_the_site(operator, back):
    item = item_on(RunStatus.NEEDS_OPERATOR, OutcomeKind.CHECKPOINT)  # holds nothing
    form = {"token": uuid.uuid4().hex, "choice": "resume", "reason": "go on", "next": back}
    response = operator.post(f"/runs/{item.run_id}/decide/", form)
    assert response.status_code == 302 and response["Location"] == f"/runs/{item.run_id}/"
    assert Run.objects.get(pk=item.run_id).status == RunStatus.QUEUED


# -- the admin ----------------------------------------------------------------------------


def test_the_admin_shows_decisions_and_changes_none(lost_delivery, operator_user, staff):
    _, item, _ = lost_delivery
    decision = decide(
        item.pk,
        Request(
            choice=DecisionChoice.CONFIRMED_HAPPENED,
            who=Who(user=operator_user),
            token=uuid.uuid4().hex,
            reason="in their log",
        ),
    ).decision
    listing = staff.get("/admin/runs/operatordecision/")
    assert listing.status_code == 200 and "olga" in listing.content.decode()
    assert staff.get(f"/admin/runs/operatordecision/{decision.pk}/change/").status_code == 200
    assert staff.get("/admin/runs/operatordecision/add/").status_code == 403
    assert staff.get(f"/admin/runs/operatordecision/{decision.pk}/delete/").status_code == 403


def test_a_run_waiting_with_no_item_is_in_the_inbox_with_its_reason(viewer, journal):
    """The delivery's receipt is cut twice on its way and known not written:
    the run waits for an operator with no item to settle.  It was on no
    list an operator reads at 3 a.m.; the inbox names it, with why."""
    cut = {"point": "drop_connection_at_commit", "write": "receipt", "action": 4}
    run, outcome = run_with(
        [{**cut, "outcome": "aborted"}] * 2, documents=["crestline-short-treasury.md"]
    )
    assert outcome == RunStatus.NEEDS_OPERATOR
    assert not OutcomeItem.objects.filter(run=run).exists()

    page = viewer.get("/inbox/").content.decode()
    assert "Runs waiting with no item" in page
    assert f'<a href="/runs/{run.pk}/">run {run.pk}</a>' in page
    assert "got no answer 2 times, and was not written" in page
    # Filtered to another run, or to a kind of item, it is not listed.
    assert (
        "Runs waiting with no item" not in viewer.get(f"/inbox/?run={run.pk + 1}").content.decode()
    )
    assert "Runs waiting with no item" not in viewer.get("/inbox/?kind=effect").content.decode()


def test_a_drills_items_and_waiting_runs_stay_out_of_the_inbox(viewer):
    """A drill stages unknown outcomes and waits on purpose; they were left
    on the operators' list (and its count) after the drill had ended."""
    item = item_on(RunStatus.NEEDS_OPERATOR)
    waiting = Run.objects.create(
        question="a drill waiting", documents=["a.md"], is_drill=True, status=item.run.status
    )
    Run.objects.filter(pk=item.run_id).update(is_drill=True)
    page = viewer.get("/inbox/").content.decode()
    assert f"/inbox/{item.pk}/" not in page and f"/runs/{waiting.pk}/" not in page
    assert 'title="0 open outcome items">0</span>' in page

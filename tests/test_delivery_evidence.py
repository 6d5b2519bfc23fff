"""An outside effect's item page says once what is not known and where to
look (the receiver, named without its secrets, or the outbox file), names
actions by what they did, not by internal ids, and folds a check repeated
while waiting into one line with its count and time span."""

from __future__ import annotations

import datetime as dt
import html
import json
import re
import uuid
from io import StringIO

import pytest
from django.core.management import call_command
from django.utils import timezone

from runs.agents.tools import outbox_file
from runs.models import Action, ActionState, OutcomeItem, OutcomeKind, Receipt, Run, RunStatus
from runs.models import digest as sha
from runs.outcomes import open_item
from tests.faultruns import run_with
from tests.receivers import LocalServer, status

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("short_settle")]

PASSWORD = "hunter2-Vq81"  # planted, to be kept off the page
TOKEN = "tok-Zx93-planted"  # planted


def item_text(page: str) -> str:
    """The item's own section (the run's decisions below it are another
    page's part), as a reader sees it: no markup, entities decoded."""
    start = page.index(">", page.index('<section id="item"')) + 1
    section = page[start : page.index("Decisions on this item")]
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", section))).strip()


def lost_delivery(settings, address: str) -> tuple[Run, OutcomeItem]:
    settings.RUNDESK_DELIVERY_URL = address
    run, outcome = run_with([{"point": "delivery_timeout"}])
    assert outcome == RunStatus.NEEDS_OPERATOR
    return run, OutcomeItem.objects.get(run=run, kind=OutcomeKind.EFFECT)


def test_the_receiver_is_named_without_its_user_password_or_query_values(
    settings, journal, operator
):
    with LocalServer(status(200)) as receiver:
        host = receiver.url.removeprefix("http://")
        planted = f"http://olga:{PASSWORD}@{host}/hooks/report?token={TOKEN}&{TOKEN}"
        _, item = lost_delivery(settings, planted)
        assert len(receiver.requests) == 1  # it went there: the address works
    page = operator.get(f"/inbox/{item.pk}/").content.decode()
    shown = f"http://{host}/hooks/report?token=…&amp;…"
    assert shown in page
    out = StringIO()
    call_command("outcomes", "show", str(item.pk), "--json", stdout=out)
    evidence = json.loads(out.getvalue())["evidence"]
    assert html.unescape(shown) == evidence["delivery"]["receiver"]
    for secret in (PASSWORD, TOKEN, "olga:"):
        assert secret not in page and secret not in out.getvalue(), secret
    # Where to look, with what to look for, in the one sentence on it.
    key = item.action.idempotency_key
    text = item_text(page)
    assert f"look it up at {html.unescape(shown)} by Idempotency-Key {key}" in text


def test_an_outbox_delivery_names_the_file_to_look_for(settings, journal, operator, tmp_path):
    settings.RUNDESK_OUTBOX_DIR = tmp_path / "outbox"
    _, item = lost_delivery(settings, "")
    page = item_text(operator.get(f"/inbox/{item.pk}/").content.decode())
    path = outbox_file(item.action.idempotency_key)
    assert path.exists()  # the fault loses the answer, not the report
    assert f"look it up at {path} by Idempotency-Key" in page
    assert "delivering the report to the outbox" in page


def test_what_is_unknown_and_why_are_said_once(settings, journal, operator):
    with LocalServer(status(200)) as receiver:
        _, item = lost_delivery(settings, receiver.url)
    text = item_text(operator.get(f"/inbox/{item.pk}/").content.decode())
    assert text.count("Only the receiver can say") == 1
    assert text.count(item.summary) == 1
    # Each choice's words once: in the form, for who may decide.
    for does in ("Sends it again, once, under the same Idempotency-Key",):
        assert text.count(does) == 2  # send again, and confirmed: it did not happen


def test_both_choices_that_send_again_say_so(settings, journal, operator):
    with LocalServer(status(200)) as receiver:
        _, item = lost_delivery(settings, receiver.url)
    out = StringIO()
    call_command("outcomes", "show", str(item.pk), "--json", stdout=out)
    offers = {offer["choice"]: offer["does"] for offer in json.loads(out.getvalue())["offers"]}
    assert offers["resend_same_identity"].startswith("Sends it again")
    assert offers["confirmed_not_happened"].startswith("Sends it again")
    assert "nothing is sent again" in offers["confirmed_happened"]


def test_actions_are_named_by_what_they_did_not_by_internal_names(settings, journal, operator):
    with LocalServer(status(200)) as receiver:
        run, item = lost_delivery(settings, receiver.url)
    text = item_text(operator.get(f"/inbox/{item.pk}/").content.decode())
    assert text.startswith("Outside effect: delivering the report to 127.0.0.1")
    assert "Known: delivering the report to 127.0.0.1 was dispatched at" in text
    assert item.subject not in text  # effect:action-N:attempt-1
    for document in run.documents:
        assert f"reading {document}" in text and f"summarising {document}" in text
    assert "composing the report" in text
    # The identity stays, as the journal's name, in the boundary.
    assert text.count(f"rundesk:run-{run.pk}:deliver") == 1


def waiting_run() -> Run:
    # Inserted waiting, as an imported run is: no owner drove it there.
    return Run.objects.create(
        question="a run with an unanswered receipt",
        documents=["northwind.md"],
        status=RunStatus.NEEDS_OPERATOR,
    )


def read_of_northwind(run: Run) -> Action:
    given = {"path": "northwind.md"}
    return Action.objects.create(
        run=run,
        step_key="read:0",
        kind="read_document",
        effect_class="read",
        input=given,
        input_digest=sha(given),
        state=ActionState.COMPLETED,
        epoch=1,
    )


def test_a_receipt_item_names_its_action_by_what_it_did(viewer):
    run = waiting_run()
    action = read_of_northwind(run)
    item = open_item(
        run_id=run.pk,
        kind=OutcomeKind.RECEIPT,
        subject=f"receipt:action-{action.pk}",
        summary=f"receipt of action {action.pk}: COMMIT sent, no answer",
        evidence={"xid": None},
        action_id=action.pk,
    )
    text = item_text(viewer.get(f"/inbox/{item.pk}/").content.decode())
    assert "receipt of reading northwind.md: COMMIT sent, no answer" in text
    assert f"action {action.pk}" not in text and item.subject not in text


def test_a_check_repeated_while_waiting_is_one_line_with_its_count_and_span(viewer):
    run = waiting_run()
    start = timezone.now().replace(microsecond=0) - dt.timedelta(minutes=5)
    same = {"xid_status": None, "row_found": False, "backend_alive": False}
    checks = [{"at": (start + dt.timedelta(seconds=i)).isoformat(), **same} for i in range(15)]
    last = {"at": (start + dt.timedelta(seconds=20)).isoformat(), **same, "row_found": True}
    item = open_item(
        run_id=run.pk,
        kind=OutcomeKind.PUBLICATION,
        subject=f"publication:{uuid.uuid4().hex}",
        summary="publication of revision 1: COMMIT sent, no answer",
        evidence={"xid": None, "checks": [*checks, last]},
        revision_number=1,
    )
    page = viewer.get(f"/inbox/{item.pk}/").content.decode()
    table = page[page.index(">Checks<") :]
    table = table[: table.index("</table>")]
    rows = re.findall(r"<tr><td>", table)
    assert len(rows) == 2  # the 15 alike, and the one that differs
    first = timezone.localtime(start)
    span = f"{first:%Y-%m-%d %H:%M:%S}.000 to {first + dt.timedelta(seconds=14):%H:%M:%S}.000"
    assert f"{span} (15 times)" in html.unescape(table)


def test_receipts_are_listed_by_what_their_actions_did(viewer):
    run = waiting_run()
    action = read_of_northwind(run)
    Receipt.objects.create(
        action=action, run=run, step_key="read:0", result={}, result_digest=sha({}), epoch=1
    )
    item = open_item(
        run_id=run.pk,
        kind=OutcomeKind.PUBLICATION,
        subject=f"publication:{uuid.uuid4().hex}",
        summary="publication of revision 1: COMMIT sent, no answer",
        evidence={"xid": None},
        revision_number=1,
    )
    page = viewer.get(f"/inbox/{item.pk}/").content.decode()
    receipts = page[page.index('id="item-receipts"') :]
    assert '<td title="read:0">reading northwind.md</td>' in receipts

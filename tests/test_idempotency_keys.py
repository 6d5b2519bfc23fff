"""The key an action is sent under is unique in the world: run ids repeat
across installations and after a database is made anew or restored, so a
receiver that keeps keys, or the outbox, must never take a new run 4 for an
old one.  A resend sends the key its boundary was written with."""

from __future__ import annotations

import re
import uuid
from http.server import BaseHTTPRequestHandler

import pytest
from django.db import connection

from runs.decisions import Request, Who, decide
from runs.executor import claim_and_drive
from runs.models import (
    Action,
    DecisionChoice,
    OutcomeItem,
    OutcomeKind,
    RunStatus,
    new_idempotency_key,
)
from tests.conftest import make_user
from tests.faultruns import DOCS, run_with
from tests.receivers import LocalServer, status

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("short_settle")]

KEY = re.compile(r"rundesk:[A-Za-z0-9.-]+:[0-9a-f]{32}")


def database_made_anew(next_run_id: int) -> None:
    """What a new database, or a restore of an older one, does to run ids:
    they start again, and the next run has an id an earlier one had."""
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE runs_run RESTART IDENTITY CASCADE")
        cursor.execute("SELECT setval('runs_run_id_seq', %s, false)", [next_run_id])


class KeyKeepingReceiver(LocalServer):
    """A webhook receiver that honours Idempotency-Key as such receivers
    do: a key it has seen is answered with the success it cached, and the
    report that came with it is dropped."""

    def __init__(self) -> None:
        self.kept: dict[str, bytes] = {}
        super().__init__(self._respond)

    def _respond(self, handler: BaseHTTPRequestHandler, body: bytes) -> None:
        self.kept.setdefault(handler.headers["Idempotency-Key"], body)
        status(200)(handler, body)


def delivery(run_id: int) -> Action:
    return Action.objects.get(run_id=run_id, step_key="deliver")


def test_a_new_run_4_delivers_beside_the_old_run_4s_report_in_the_outbox(settings, _outbox):
    settings.RUNDESK_DELIVERY_URL = ""
    old, outcome = run_with([], documents=DOCS[:2])
    assert outcome == RunStatus.COMPLETED
    [old_report] = [path.read_text() for path in _outbox.iterdir()]

    database_made_anew(old.pk)
    new, outcome = run_with([], documents=DOCS[1:])

    assert new.pk == old.pk
    assert outcome == RunStatus.COMPLETED, new.status_reason
    reports = {path.name: path.read_text() for path in _outbox.iterdir()}
    assert len(reports) == 2 and old_report in reports.values()
    key = delivery(new.pk).idempotency_key
    assert reports[key.replace(":", "%3A") + ".md"] != old_report


def test_a_receiver_that_keeps_keys_gets_each_installations_run_1(settings):
    with KeyKeepingReceiver() as receiver:
        settings.RUNDESK_DELIVERY_URL = receiver.url
        settings.RUNDESK_INSTALLATION = "alpha"
        first, _ = run_with([], documents=DOCS[:2])
        first_key = delivery(first.pk).idempotency_key

        database_made_anew(first.pk)
        settings.RUNDESK_INSTALLATION = "beta"
        second, outcome = run_with([], documents=DOCS[1:])

    assert second.pk == first.pk and outcome == RunStatus.COMPLETED
    # Each report was taken as itself, none answered with the other's success.
    assert len(receiver.kept) == 2 and len(set(receiver.kept.values())) == 2
    second_key = delivery(second.pk).idempotency_key
    assert first_key.startswith("rundesk:alpha:") and second_key.startswith("rundesk:beta:")
    assert set(receiver.kept) == {first_key, second_key}


def test_a_resend_sends_the_key_its_boundary_was_written_with(settings):
    settings.RUNDESK_INSTALLATION = "before-the-rename"
    with LocalServer(status(200)) as receiver:
        settings.RUNDESK_DELIVERY_URL = receiver.url
        run, outcome = run_with([{"point": "delivery_timeout"}])
        assert outcome == RunStatus.NEEDS_OPERATOR
        item = OutcomeItem.objects.get(run=run, kind=OutcomeKind.EFFECT)
        # Read from the action's row, never made again: a rename of the
        # installation in between changes nothing.
        settings.RUNDESK_INSTALLATION = "after-the-rename"
        decide(
            item.pk,
            Request(
                choice=DecisionChoice.RESEND_SAME_IDENTITY,
                who=Who(user=make_user("olga", operator=True)),
                token=uuid.uuid4().hex,
                reason="the receiver has no record of it",
            ),
        )
        assert claim_and_drive(run.pk) == RunStatus.COMPLETED

    key = delivery(run.pk).idempotency_key
    assert key.startswith("rundesk:before-the-rename:")
    assert [headers["Idempotency-Key"] for headers, _ in receiver.requests] == [key, key]
    assert item.evidence["idempotency_key"] == key


@pytest.mark.parametrize(
    "installation", ["prod-eu-1", "prod eu/1", "zürich:2", "a\r\nX-Injected: 1", "", "-" * 300]
)
def test_a_key_names_the_installation_and_is_safe_in_a_header_and_a_file_name(
    settings, installation
):
    settings.RUNDESK_INSTALLATION = installation
    first, second = new_idempotency_key(), new_idempotency_key()
    assert KEY.fullmatch(first) and KEY.fullmatch(second) and first != second
    assert len(first) <= 110
    if installation == "prod-eu-1":
        assert first.startswith("rundesk:prod-eu-1:")

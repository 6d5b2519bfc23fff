"""Alerts are durable work: a row per item and channel, written in the
transaction that opens the item, sent by the sweep with retries, once per
item and channel when the receiver answers, and shown where the item is."""

from __future__ import annotations

import datetime as dt
import json
import signal
import threading
from collections import Counter
from io import StringIO
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.core import mail
from django.core.management import call_command
from django.db import connection, transaction
from django.utils import timezone

from runs.alerts import Delivered, deliver_due, retry_after
from runs.models import Alert, AlertChannel, AlertState, OutcomeItem, OutcomeState, RunStatus
from runs.sweep import sweep
from tests.conftest import manage
from tests.faultruns import wait_for
from tests.receivers import LocalServer, status
from tests.test_inbox import item_on

pytestmark = pytest.mark.django_db(transaction=True)


def posted_items(server: LocalServer) -> Counter[int]:
    return Counter(json.loads(body)["item"] for _, body in server.requests)


def answering(*codes: int) -> Any:
    """A receiver that answers each POST with the next code."""
    answers = iter(codes)

    def respond(handler: Any, body: bytes) -> None:
        status(next(answers))(handler, body)

    return respond


def operator_with_address(name: str, email: str, *, active: bool = True) -> User:
    group, _ = Group.objects.get_or_create(name="operators")
    user = User.objects.create_user(name, email=email, is_active=active)
    user.groups.add(group)
    return user


# -- written with the item ------------------------------------------------------------


def test_an_item_and_its_alerts_commit_together_or_not_at_all(settings):
    settings.RUNDESK_ALERT_URL = "http://127.0.0.1:9"
    with pytest.raises(RuntimeError), transaction.atomic():
        item_on(RunStatus.NEEDS_OPERATOR)
        assert Alert.objects.count() == 1
        raise RuntimeError("the transaction that opened the item fails")
    assert not OutcomeItem.objects.exists() and not Alert.objects.exists()
    item = item_on(RunStatus.NEEDS_OPERATOR)
    assert list(item.alerts.values_list("channel", "state", "attempts")) == [
        (AlertChannel.WEBHOOK, AlertState.PENDING, 0)
    ]


def test_only_the_channels_configured_when_the_item_opens_get_an_alert(settings):
    settings.RUNDESK_ALERT_URL = ""
    operator_with_address("ida", "ida@example.test", active=False)  # inactive: not mailed
    operator_with_address("omar", "")  # no address
    assert not item_on(RunStatus.NEEDS_OPERATOR).alerts.exists()

    olga = operator_with_address("olga", "olga@example.test")
    mailed = item_on(RunStatus.NEEDS_OPERATOR)
    assert list(mailed.alerts.values_list("channel", flat=True)) == [AlertChannel.EMAIL]

    # Her address is gone before the sweep sends it: kept, with why.
    User.objects.filter(pk=olga.pk).update(email="")
    assert deliver_due().failing == [mailed.alerts.get().pk]
    failing = mailed.alerts.get()
    assert failing.state == AlertState.FAILING
    assert failing.last_error == "no active operator has an email address"
    assert mail.outbox == []


def test_an_alert_outlives_a_process_that_dies_right_after_the_commit(settings, process_env):
    with LocalServer(status(204)) as receiver:
        settings.RUNDESK_ALERT_URL = receiver.url
        script = (
            "import os, signal\n"
            "from runs.models import OutcomeKind\n"
            "from runs.submission import submit\n"
            "from runs.outcomes import open_item\n"
            "run = submit(question='q', documents=['a.md'])\n"
            "item = open_item(run_id=run.pk, kind=OutcomeKind.EFFECT, subject='effect:dies',"
            " summary='lost answer', evidence={})\n"
            "print(item.pk, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n"
        )
        dying = manage(
            "shell", "-c", script, env={**process_env, "RUNDESK_ALERT_URL": receiver.url}
        )
        out, err = dying.communicate(timeout=60)
        assert dying.returncode == -signal.SIGKILL, err
        item = OutcomeItem.objects.get(pk=int(out.split()[-1]))
        alert = item.alerts.get()
        assert (alert.channel, alert.state) == (AlertChannel.WEBHOOK, AlertState.PENDING)
        assert receiver.requests == []

        assert sweep().alerted == [alert.pk]
        assert sweep().alerted == []
        assert posted_items(receiver) == {item.pk: 1}
    alert.refresh_from_db()
    assert (alert.state, alert.attempts, alert.next_try_at) == (AlertState.SENT, 1, None)
    assert alert.sent_at is not None


# -- retries -------------------------------------------------------------------------


def test_a_failing_receiver_is_tried_again_later_and_sent_once_it_answers(settings):
    settings.RUNDESK_ALERT_RETRY_SECONDS = 0.5
    with LocalServer(answering(500, 200)) as receiver:
        settings.RUNDESK_ALERT_URL = receiver.url
        item = item_on(RunStatus.NEEDS_OPERATOR)
        alert = item.alerts.get()
        before = timezone.now()

        assert deliver_due() == Delivered(failing=[alert.pk])
        alert.refresh_from_db()
        assert (alert.state, alert.attempts) == (AlertState.FAILING, 1)
        assert alert.last_error.startswith("HTTP 500")
        assert alert.next_try_at > before and alert.sent_at is None
        assert deliver_due() == Delivered()  # not due yet: the receiver is left alone
        assert len(receiver.requests) == 1

        wait_for(lambda: deliver_due().sent == [alert.pk], timeout=10)
        assert deliver_due() == Delivered()
        assert len(receiver.requests) == 2
    keys = {headers["Idempotency-Key"] for headers, _ in receiver.requests}
    assert keys == {f"rundesk-alert-{alert.pk}"}  # the receiver can tell a repeat
    alert.refresh_from_db()
    assert (alert.state, alert.attempts, alert.last_error) == (AlertState.SENT, 2, "")
    assert alert.next_try_at is None and alert.sent_at is not None


def test_retries_back_off_doubling_up_to_the_cap(settings):
    settings.RUNDESK_ALERT_RETRY_SECONDS = 30
    settings.RUNDESK_ALERT_RETRY_MAX_SECONDS = 300
    waits = [retry_after(attempts).total_seconds() for attempts in (1, 2, 3, 4, 5, 10_000)]
    assert waits == [30, 60, 120, 240, 300, 300]


def test_a_receiver_nobody_listens_on_is_kept_failing_with_why(settings):
    settings.RUNDESK_ALERT_URL = "http://127.0.0.1:9"
    alert = item_on(RunStatus.NEEDS_OPERATOR).alerts.get()
    assert deliver_due().failing == [alert.pk]
    alert.refresh_from_db()
    assert alert.state == AlertState.FAILING
    assert "Connection refused" in alert.last_error


def test_an_item_settled_before_its_alert_went_out_is_not_announced(settings):
    with LocalServer(status(204)) as receiver:
        settings.RUNDESK_ALERT_URL = receiver.url
        item = item_on(RunStatus.NEEDS_OPERATOR)
        OutcomeItem.objects.filter(pk=item.pk).update(
            state=OutcomeState.SETTLED, resolved_at=timezone.now(), resolution="settled"
        )
        assert deliver_due().withdrawn == [item.alerts.get().pk]
        assert deliver_due() == Delivered()
    assert receiver.requests == []
    assert item.alerts.get().state == AlertState.WITHDRAWN


# -- concurrency ---------------------------------------------------------------------


def test_two_sweeps_at_once_send_each_alert_once(settings):
    with LocalServer(status(204, delay=0.1)) as receiver:
        settings.RUNDESK_ALERT_URL = receiver.url
        items = [item_on(RunStatus.NEEDS_OPERATOR) for _ in range(12)]
        barrier = threading.Barrier(2)
        results: list[Delivered] = []

        def delivering() -> None:
            try:
                barrier.wait()
                results.append(deliver_due())
            finally:
                connection.close()

        threads = [threading.Thread(target=delivering) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert posted_items(receiver) == {item.pk: 1 for item in items}
    sent = [results[0].sent, results[1].sent]
    assert all(sent), sent  # both sweeps sent some: they did run at once
    assert sorted(sent[0] + sent[1]) == sorted(Alert.objects.values_list("pk", flat=True))
    assert set(Alert.objects.values_list("state", "attempts")) == {(AlertState.SENT, 1)}


# -- shown where the item is ---------------------------------------------------------


@pytest.fixture
def failing(settings: Any) -> Alert:
    settings.RUNDESK_ALERT_URL = "http://127.0.0.1:9"
    alert = item_on(RunStatus.NEEDS_OPERATOR).alerts.get()
    deliver_due()
    alert.refresh_from_db()
    return alert


def test_the_item_page_says_where_its_alerts_stand(failing, viewer):
    page = viewer.get(f"/inbox/{failing.item_id}/").content.decode()
    row = page[page.index('id="alert-webhook"') :].split("</tr>")[0]
    assert "failing" in row and "Connection refused" in row
    assert "next try" in row


def test_outcomes_show_gives_the_alerts_state(failing):
    out = StringIO()
    call_command("outcomes", "show", str(failing.item_id), "--json", stdout=out)
    (shown,) = json.loads(out.getvalue())["alerts"]
    assert shown["channel"] == "webhook" and shown["state"] == "failing"
    assert shown["attempts"] == 1 and "Connection refused" in shown["why"]
    assert dt.datetime.fromisoformat(shown["next_try"]) == failing.next_try_at
    assert shown["sent_at"] is None

    out = StringIO()
    call_command("outcomes", "show", str(failing.item_id), stdout=out)
    assert "webhook: failing after 1 attempt: " in out.getvalue()

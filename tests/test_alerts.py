"""Operators are told once per item that a run waits for them, by email and
by a POST to RUNDESK_ALERT_URL, sent by the sweep; an alert that cannot be
sent changes nothing for the run.  (Delivery itself: test_alert_delivery.py.)"""

from __future__ import annotations

import json

import pytest
from django.contrib.auth.models import Group, User
from django.core import mail

from runs.models import Alert, AlertState, OutcomeItem, RunStatus
from runs.sweep import sweep
from tests.faultruns import run_with
from tests.receivers import LocalServer, status

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def operators() -> list[User]:
    group, _ = Group.objects.get_or_create(name="operators")
    people = [
        User.objects.create_user("olga", email="olga@example.test"),
        User.objects.create_user("omar", email=""),  # no address: not mailed
    ]
    for person in people:
        person.groups.add(group)
    User.objects.create_user("vera", email="vera@example.test")  # not an operator
    return people


def test_a_run_that_starts_waiting_alerts_the_operators_once(operators, settings, journal):
    with LocalServer(status(204)) as alerts:
        settings.RUNDESK_ALERT_URL = alerts.url
        run, outcome = run_with([{"point": "delivery_timeout"}])
        assert outcome == RunStatus.NEEDS_OPERATOR
        item = OutcomeItem.objects.get(run=run)
        assert sorted(sweep().alerted) == sorted(item.alerts.values_list("pk", flat=True))
        assert sweep().alerted == []  # told once
        assert len(alerts.requests) == 1 and len(mail.outbox) == 1
        _, body = alerts.requests[0]
        sent = json.loads(body)
        assert (sent["item"], sent["run"], sent["kind"]) == (item.pk, run.pk, "effect")
        assert sent["inbox"].endswith(f"/inbox/{item.pk}/")
        assert mail.outbox[0].to == ["olga@example.test"]
        assert f"run {run.pk} waits" in mail.outbox[0].subject


def test_an_alert_that_cannot_be_sent_changes_nothing_for_the_run(settings, journal, caplog):
    with LocalServer(status(500)) as broken:
        settings.RUNDESK_ALERT_URL = broken.url
        run, outcome = run_with([{"point": "delivery_timeout"}])
        swept = sweep()
        assert len(broken.requests) == 1
    assert outcome == RunStatus.NEEDS_OPERATOR
    assert swept.alerted == [] and "HTTP 500" in caplog.text
    run.refresh_from_db()
    assert run.status == RunStatus.NEEDS_OPERATOR
    assert Alert.objects.get().state == AlertState.FAILING
    settings.RUNDESK_ALERT_URL = "http://127.0.0.1:9"  # nothing listens
    again, outcome = run_with([{"point": "delivery_timeout"}])
    sweep()
    assert outcome == RunStatus.NEEDS_OPERATOR
    assert OutcomeItem.objects.filter(run=again).count() == 1
    assert Alert.objects.get(item__run=again).state == AlertState.FAILING


def test_an_unknown_checkpoint_alerts_nobody(settings, journal):
    with LocalServer(status(204)) as alerts:
        settings.RUNDESK_ALERT_URL = alerts.url
        settings.RUNDESK_SETTLE_SECONDS = 0.5
        fault = {"point": "drop_connection_at_commit", "write": "checkpoint", "action": 1}
        run, outcome = run_with([{**fault, "outcome": "late", "stall_ms": 2000}])
        assert outcome == RunStatus.COMPLETED  # the run went on: nobody is waited for
        assert OutcomeItem.objects.filter(run=run).exists()
        assert not Alert.objects.exists()
        sweep()
        assert alerts.requests == []

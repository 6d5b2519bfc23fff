"""Telling the operators that a run waits for them: once per outcome item
that holds a run, by email to the `operators` group (Django's mail
settings) and by a JSON POST to RUNDESK_ALERT_URL.

An alert is durable work (runs.models.Alert): `item_opened` writes one row
per configured channel in the transaction that opens the item, and the
sweep (runs/sweep.py: an executor's, or Celery beat's) delivers due rows
with `deliver_due`.  A row is claimed by moving its next_try_at forward (a
lease on the attempt, under SKIP LOCKED, committed at once), sent with no
transaction open, and its answer recorded only if the lease is still its
own: two sweeps never send the same row at once, and one that dies
mid-send leaves the row due again when the lease ends.  A receiver that
answers 2xx has it, and is not sent it again; a failure is kept (why, the
next try) and tried again after a backoff that doubles up to a cap.  An
alert never slows, fails or changes the run.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.core.mail import send_mail
from django.db import DatabaseError, transaction
from django.db.models import F
from django.db.models.functions import Now

from runs.models import (
    HOLDING_KINDS,
    Alert,
    AlertChannel,
    AlertState,
    OutcomeItem,
    OutcomeKind,
    OutcomeState,
)

logger = logging.getLogger(__name__)


class NotSent(Exception):
    """Why a channel did not take the alert (kept as the row's last_error)."""


@dataclass
class Delivered:
    """What one `deliver_due` did, by alert id."""

    sent: list[int] = field(default_factory=list)
    failing: list[int] = field(default_factory=list)
    withdrawn: list[int] = field(default_factory=list)


def item_opened(item: OutcomeItem) -> None:
    """Writes the alerts of a newly opened item that holds its run, one per
    channel configured now.  Called inside the transaction that creates the
    item: the alert commits with it, or neither does."""
    if item.kind not in HOLDING_KINDS:
        return  # an unknown checkpoint holds nothing: the run went on
    channels = []
    if _recipients(item.kind).exists():
        channels.append(AlertChannel.EMAIL)
    if settings.RUNDESK_ALERT_URL:
        channels.append(AlertChannel.WEBHOOK)
    Alert.objects.bulk_create([Alert(item=item, channel=channel) for channel in channels])


def deliver_due() -> Delivered:
    """Sends the alerts that are due, one at a time, for about
    RUNDESK_ALERT_TIMEOUT seconds at most (a send already started may take
    one timeout more): the executor whose sweep this is goes back to its
    runs, and what is left is the next sweep's.  A database error ends this
    round; its claim, if any, ends with its lease."""
    delivered = Delivered()
    deadline = time.monotonic() + settings.RUNDESK_ALERT_TIMEOUT
    try:
        while time.monotonic() < deadline and (claimed := _claim()) is not None:
            _attempt(claimed, delivered)
    except DatabaseError as error:
        logger.warning("alerts: left to the next sweep: %s", str(error).strip())
    return delivered


@dataclass
class Claimed:
    alert: Alert
    until: dt.datetime  # its lease: the next_try_at the claim wrote


def _lease(channel: str) -> dt.timedelta:
    """How long an attempt holds its row: its channel's timeout bounds each
    blocking step (connect, send, read the answer), with a margin.  A
    receiver slower than this may be sent the alert again by another sweep;
    the Idempotency-Key header lets it tell."""
    if channel == AlertChannel.EMAIL:
        timeout = settings.EMAIL_TIMEOUT
    else:
        timeout = settings.RUNDESK_ALERT_TIMEOUT
    return dt.timedelta(seconds=3 * timeout + 5)


def _claim() -> Claimed | None:
    with transaction.atomic():
        alert = (
            Alert.objects.due()
            .select_for_update(skip_locked=True)
            .only("id", "item_id", "channel", "attempts")
            .first()
        )
        if alert is None:
            return None
        Alert.objects.filter(pk=alert.pk).update(next_try_at=Now() + _lease(alert.channel))
        until = Alert.objects.filter(pk=alert.pk).values_list("next_try_at", flat=True).get()
    return Claimed(alert, until)


def _attempt(claimed: Claimed, delivered: Delivered) -> None:
    alert = claimed.alert
    item = OutcomeItem.objects.select_related("run").get(pk=alert.item_id)
    if item.state != OutcomeState.OPEN:
        if _record(claimed, state=AlertState.WITHDRAWN, next_try_at=None):
            delivered.withdrawn.append(alert.pk)
        return
    try:
        _send(alert, item)
    except NotSent as error:
        why = str(error)
        logger.warning("alert %s (%s, item %s) not sent: %s", alert.pk, alert.channel, item.pk, why)
        if _record(
            claimed,
            state=AlertState.FAILING,
            attempts=F("attempts") + 1,
            last_error=why,
            next_try_at=Now() + retry_after(alert.attempts + 1),
        ):
            delivered.failing.append(alert.pk)
        return
    if _record(
        claimed,
        state=AlertState.SENT,
        attempts=F("attempts") + 1,
        last_error="",
        next_try_at=None,
        sent_at=Now(),
    ):
        delivered.sent.append(alert.pk)


def _record(claimed: Claimed, **changes: Any) -> bool:
    """Keeps an attempt's answer if the row is still this attempt's: a
    lease that ran out may have let another sweep send it since."""
    return bool(
        Alert.objects.filter(pk=claimed.alert.pk, next_try_at=claimed.until).update(**changes)
    )


def retry_after(attempts: int) -> dt.timedelta:
    """How long after its `attempts`-th failed attempt an alert is tried
    again: RUNDESK_ALERT_RETRY_SECONDS, doubled each time, at most
    RUNDESK_ALERT_RETRY_MAX_SECONDS."""
    first = settings.RUNDESK_ALERT_RETRY_SECONDS
    return dt.timedelta(
        seconds=min(first * 2 ** min(attempts - 1, 32), settings.RUNDESK_ALERT_RETRY_MAX_SECONDS)
    )


def _recipients(kind: str) -> Any:
    # An approval item is the approvers' to decide (runs/approvals.py);
    # every other item the operators'.
    group = "approvers" if kind == OutcomeKind.APPROVAL else "operators"
    return (
        User.objects.filter(groups__name=group, is_active=True)
        .exclude(email="")
        .values_list("email", flat=True)
        .distinct()
    )


def _send(alert: Alert, item: OutcomeItem) -> None:
    """Sends one alert, with no transaction open; raises NotSent."""
    message = {
        "item": item.pk,
        "kind": item.kind,
        "run": item.run_id,
        "summary": item.summary,
        "opened_at": item.created_at.isoformat(),
        "inbox": f"{settings.RUNDESK_SITE_URL}/inbox/{item.pk}/",
    }
    if alert.channel == AlertChannel.EMAIL:
        _email(message, list(_recipients(item.kind)))
    else:
        _post(message, f"rundesk-alert-{alert.pk}")


def _email(message: dict[str, Any], recipients: list[str]) -> None:
    if not recipients:
        raise NotSent("no active operator has an email address")
    try:
        send_mail(
            f"[Rundesk] run {message['run']} waits for an operator ({message['kind']})",
            f"{message['summary']}\n\nDecide it in the inbox: {message['inbox']}\n",
            None,
            recipients,
        )
    except Exception as error:  # whatever the mail backend raises: kept, tried again
        raise NotSent(f"email not accepted: {error!r}") from error


def _post(message: dict[str, Any], key: str) -> None:
    url = settings.RUNDESK_ALERT_URL
    if not url:
        raise NotSent("RUNDESK_ALERT_URL is not set")
    request = urllib.request.Request(  # noqa: S310 (settings.env_url allows http(s) only)
        url,
        data=json.dumps(message).encode(),
        # The same key on every attempt: a receiver whose answer was lost
        # can tell the alert it already has.
        headers={"Content-Type": "application/json", "Idempotency-Key": key},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=settings.RUNDESK_ALERT_TIMEOUT) as answer:  # noqa: S310
            status = answer.status
    except urllib.error.HTTPError as error:
        raise NotSent(f"HTTP {error.code} {error.reason}") from error
    except Exception as error:  # refused, timed out, reset, bad name: kept, tried again
        raise NotSent(f"POST not delivered: {error!r}") from error
    if not 200 <= status < 300:
        raise NotSent(f"HTTP {status}: not a 2xx answer")

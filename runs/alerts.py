"""Telling the operators that a run waits for them: once per outcome item
that holds a run, by email to the `operators` group (Django's mail
settings) and by a JSON POST to RUNDESK_ALERT_URL.

An alert is an observation: it is sent on its own thread after the item's
transaction commits, each channel with its own timeout, and a failure is
logged; it never slows, fails or changes the run.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.request
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.core.mail import send_mail
from django.db import connection, transaction

from runs.models import HOLDING_KINDS, OutcomeItem

logger = logging.getLogger(__name__)


def item_opened(item: OutcomeItem) -> None:
    """Schedules the alert of a newly opened item that holds its run."""
    if item.kind not in HOLDING_KINDS:
        return  # an unknown checkpoint holds nothing: the run went on
    transaction.on_commit(
        lambda: threading.Thread(
            target=_send, args=(item.pk,), name=f"alert-{item.pk}", daemon=True
        ).start()
    )


def _send(item_id: int) -> None:
    try:
        item = OutcomeItem.objects.select_related("run").get(pk=item_id)
        alert = {
            "item": item.pk,
            "kind": item.kind,
            "run": item.run_id,
            "summary": item.summary,
            "opened_at": item.created_at.isoformat(),
            "inbox": f"{settings.RUNDESK_SITE_URL}/inbox/{item.pk}/",
        }
        recipients = list(
            User.objects.filter(groups__name="operators", is_active=True)
            .exclude(email="")
            .values_list("email", flat=True)
        )
    except Exception:
        logger.exception("alert for item %s: not sent", item_id)
        return
    finally:
        connection.close()
    _email(alert, recipients)
    _post(alert)


def _email(alert: dict[str, Any], recipients: list[str]) -> None:
    if not recipients:
        return
    try:
        send_mail(
            f"[Rundesk] run {alert['run']} waits for an operator ({alert['kind']})",
            f"{alert['summary']}\n\nDecide it in the inbox: {alert['inbox']}\n",
            None,
            recipients,
        )
    except Exception as error:
        logger.warning("alert for item %s: email not sent: %s", alert["item"], error)


def _post(alert: dict[str, Any]) -> None:
    if not settings.RUNDESK_ALERT_URL:
        return
    request = urllib.request.Request(  # noqa: S310 (settings.env_url allows http(s) only)
        settings.RUNDESK_ALERT_URL,
        data=json.dumps(alert).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=settings.RUNDESK_ALERT_TIMEOUT):  # noqa: S310
            pass
    except Exception as error:
        logger.warning("alert for item %s: POST not delivered: %s", alert["item"], error)

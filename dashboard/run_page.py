"""The run page's account of what the run is doing now (runs/words.py
says it), and the cancel form it offers: a cancel asks for a reason and a
confirmation, as an abandon asks for a reason."""

from __future__ import annotations

import datetime as dt
from typing import Any

from django import forms

from runs.models import Run, RunStatus
from runs.timeline import EventKind
from runs.words import cancel_words, left_out, queue_words, status_now


class CancelForm(forms.Form):
    """A cancel: why (kept on the run, as an abandon's reason is), and a
    tick saying the operator means it (the page works without JavaScript,
    so no dialog stands in for it)."""

    reason = forms.CharField(
        max_length=4000,
        strip=True,
        error_messages={"required": "Say why the run is cancelled: it is kept with the run."},
        widget=forms.Textarea(attrs={"rows": 2, "maxlength": 4000}),
    )
    confirm = forms.BooleanField(
        error_messages={"required": "Tick the box to confirm the cancel: nothing was cancelled."},
    )


def cancel_reason(run: Run) -> str:
    """The reason given with the run's cancel (its cancel_requested event)."""
    if run.cancel_requested_at is None:
        return ""
    data = (
        run.events.filter(kind=EventKind.CANCEL_REQUESTED)
        .order_by("-created_at", "-id")
        .values_list("data", flat=True)
        .first()
    )
    return str((data or {}).get("reason") or "")


def run_now(run: Run, now: dt.datetime, cancel_form: CancelForm | None = None) -> dict[str, Any]:
    """What the run page's status, lease and cancel lines say at `now`, what
    a completed run's answer leaves out, and the cancel form (as sent, with
    its errors, after a refused cancel)."""
    said = status_now(run, now)
    run.status_label = said.words
    return {
        "status_warning": said.warning,
        # The lease line says it too, where the owner is named.
        "lease_expired": said.warning and run.status == RunStatus.RUNNING,
        "queue_said": queue_words(run, now),
        "cancel_said": cancel_words(run, cancel_reason(run), now),
        "cancel_form": cancel_form or CancelForm(),
        # A completed run whose answer leaves work out says what, at its top
        # (Run.objects.completed_with_gaps() lists it so).
        "left_out": left_out(run) if run.status == RunStatus.COMPLETED else [],
    }

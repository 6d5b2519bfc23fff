"""The holds page: the active holds (what each stops, who added it and why,
the dispatches in flight when it came, the runs waiting on it) and the
released ones with their figures; an operator adds and releases holds here
(rules and words in runs/holds.py)."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import permission_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST, require_safe

from dashboard.security import rejects_bad_input
from runs import holds
from runs.decisions import OPERATE
from runs.models import HoldWait
from runs.registry import installed
from runs.words import human_duration


def _tools() -> list[tuple[str, str]]:
    names = sorted({tool.name for agent in installed().values() for tool in agent.tools})
    return [("", "every effect (name the agent)"), *((name, name) for name in names)]


def _agents() -> list[tuple[str, str]]:
    return [("", "every agent"), *((name, name) for name in sorted(installed()))]


class HoldForm(forms.Form):
    """What to hold, and why."""

    tool = forms.ChoiceField(choices=_tools, required=False)
    agent = forms.ChoiceField(choices=_agents, required=False)
    reason = forms.CharField(
        max_length=holds.REASON_MAX,
        strip=True,
        error_messages={"required": "Say why the tool is held: it is kept with the hold."},
        widget=forms.Textarea(attrs={"rows": 2, "maxlength": holds.REASON_MAX}),
    )


class ReleaseForm(forms.Form):
    reason = forms.CharField(
        max_length=holds.REASON_MAX,
        strip=True,
        error_messages={"required": "Say why the hold is released: it is kept with it."},
    )


@require_safe
@rejects_bad_input
def holds_page(request: HttpRequest) -> HttpResponse:
    return _page(request, HoldForm())


def _page(request: HttpRequest, form: HoldForm, status: int = 200) -> HttpResponse:
    active, released = holds.listing(timezone.now())
    waiting = holds.waiting_on([audit.hold.pk for audit in active])
    context: dict[str, Any] = {
        "active": [_row(audit, waiting.get(audit.hold.pk, [])) for audit in active],
        "released": [_row(audit) for audit in released],
        "form": form,
        "can_operate": request.user.has_perm(OPERATE),
    }
    return render(request, "holds.html", context, status=status)


def _row(audit: holds.Audit, waits: list[HoldWait] | None = None) -> dict[str, Any]:
    return {
        "audit": audit,
        "hold": audit.hold,
        "waits": (waits or [])[: holds.WAITS_SHOWN],
        "waited": human_duration(audit.seconds),
        "longest": human_duration(audit.longest),
    }


@require_POST
@permission_required(OPERATE, raise_exception=True)
@rejects_bad_input
def hold_add(request: HttpRequest) -> HttpResponse:
    form = HoldForm(request.POST)
    if not form.is_valid():
        return _page(request, form, status=400)
    scope = holds.Scope(tool=form.cleaned_data["tool"], agent=form.cleaned_data["agent"])
    try:
        hold = holds.add(scope, user=request.user, reason=form.cleaned_data["reason"])
    except holds.HoldRefused as refused:
        form.add_error(None, f"Not held: {refused}.")
        return _page(request, form, status=409)
    messages.success(request, holds.added_words(hold))
    return redirect("holds")


@require_POST
@permission_required(OPERATE, raise_exception=True)
@rejects_bad_input
def hold_release(request: HttpRequest, hold_id: int) -> HttpResponse:
    form = ReleaseForm(request.POST)
    if not form.is_valid():
        messages.error(request, f"Hold {hold_id} not released: say why.")
        return redirect("holds")
    try:
        released = holds.release(hold_id, user=request.user, reason=form.cleaned_data["reason"])
    except holds.HoldRefused as refused:
        messages.error(request, f"Not released: {refused}.")
        return redirect("holds")
    messages.success(request, holds.released_count_words(released))
    return redirect("holds")

"""An approval item's page: the proposed input as a person reads it (an
email: to, subject, body), what the run published so far, who may approve,
and the three choices: approve, edit and approve, reject with a reason.

Pages do HTTP only: every decision goes through runs.approvals.
decide_approval, which holds the rules (the approver permission, one
winner, idempotency by request token, the edit valid for the tool's input
schema).  The permission is also checked here, in the view: approvers
decide, operators without it and viewers read.
"""

from __future__ import annotations

import uuid
from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import permission_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from dashboard.security import form_lock_waits, rejects_bad_input
from runs.agent import Tool
from runs.approvals import (
    APPROVE,
    CHOICES,
    Rendered,
    decide_approval,
    editable,
    input_diff,
    rendered,
)
from runs.decisions import REASON_MAX, DecisionRefused, Request, Who
from runs.inbox import history
from runs.models import Approval, DecisionChoice, OutcomeItem, OutcomeKind
from runs.words import declared_tool

TOKEN_MAX = 100  # OperatorDecision.request_token
# An input field longer than this, or of several lines, is edited in a text area.
SHORT = 80


class ApprovalForm(forms.Form):
    """The choice, the request token, the reason, and for an edit the
    tool's editable fields (edit_<name>), checked against its schema."""

    choice = forms.ChoiceField(choices=[(str(c), c.label) for c in CHOICES])
    token = forms.CharField(max_length=TOKEN_MAX)
    reason = forms.CharField(max_length=REASON_MAX, required=False, strip=True)

    def __init__(self, *args: Any, approval: Approval, tool: Tool | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.approval, self.tool = approval, tool
        for name in editable(tool):
            value = approval.proposed.get(name, "")
            long = not isinstance(value, str) or "\n" in value or len(value) > SHORT
            self.fields[f"edit_{name}"] = forms.CharField(
                label=name.replace("_", " ").capitalize(),
                required=False,
                strip=False,
                initial=value,
                widget=forms.Textarea(attrs={"rows": 10}) if long else forms.TextInput(),
            )

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        if cleaned.get("choice") == DecisionChoice.APPROVE_EDITED:
            if self.tool is None:
                raise forms.ValidationError("this tool is not installed here: it cannot be edited")
            refusal = self.tool.refusal(self.edited())
            if refusal:
                # input.to: '...' does not match ...: the field it names.
                name = refusal.removeprefix("input.").split(":")[0].split(".")[0].split("[")[0]
                field = f"edit_{name}"
                self.add_error(field if field in self.fields else None, refusal)
        return cleaned

    def edited(self) -> dict[str, Any]:
        """The proposed input with the edited fields in place.  A browser
        sends a text area's line breaks as CRLF: kept as the person typed
        them, as LF."""
        edit = dict(self.approval.proposed)
        for name in editable(self.tool):
            value = self.cleaned_data.get(f"edit_{name}")
            if value is not None:
                edit[name] = value.replace("\r\n", "\n")
        return edit


def approval_page(
    request: HttpRequest, item: OutcomeItem, form: ApprovalForm | None = None
) -> HttpResponse:
    """The page of an approval item (inbox.item_detail sends it here)."""
    return render(
        request, "approval.html", _context(request, item, form), status=400 if form else 200
    )


def _context(request: HttpRequest, item: OutcomeItem, form: ApprovalForm | None) -> dict[str, Any]:
    approval = item.approval
    tool = declared_tool(item.run, approval.tool).tool
    mail: Rendered = rendered(approval.proposed)
    return {
        "item": item,
        "approval": approval,
        "run": item.run,
        "mail": mail,
        "sent": rendered(approval.sent) if approval.edited else None,
        "diff": input_diff(approval.proposed, approval.sent) if approval.edited else [],
        "published": item.evidence.get("published", []),
        "approvers": item.evidence.get("approvers", {}),
        "form": form or ApprovalForm(approval=approval, tool=tool),
        "token": uuid.uuid4().hex,
        "can_approve": request.user.has_perm(APPROVE),
        "decisions": history(item.decisions.all()),
        "alerts": list(item.alerts.all()),
        "now": timezone.now(),
    }


@require_POST
@permission_required(APPROVE, raise_exception=True)
@rejects_bad_input
def approval_decide(request: HttpRequest, item_id: int) -> HttpResponse:
    with form_lock_waits():
        item = get_object_or_404(
            OutcomeItem.objects.select_related("run", "approval"),
            pk=item_id,
            kind=OutcomeKind.APPROVAL,
            # An imported run's approval item has no gate here to decide.
            approval__isnull=False,
        )
    tool = declared_tool(item.run, item.approval.tool).tool
    form = ApprovalForm(request.POST, approval=item.approval, tool=tool)
    if not form.is_valid():
        return approval_page(request, item, form)
    choice = form.cleaned_data["choice"]
    asked = Request(
        choice=choice,
        who=Who(user=request.user),
        token=form.cleaned_data["token"],
        reason=form.cleaned_data["reason"],
    )
    try:
        decided = decide_approval(
            item.pk, asked, form.edited() if choice == DecisionChoice.APPROVE_EDITED else None
        )
    except DecisionRefused as refused:
        messages.error(request, f"Not decided: {refused}.")
    else:
        decision = decided.decision
        said = "Already recorded" if decided.repeated else "Recorded"
        messages.success(
            request, f"{said}: {decision.get_choice_display()} by {decision.decided_by}."
        )
    return redirect("inbox-item", item_id=item.pk)

"""Admin for the runtime models: staff read them here and change nothing.
Runs, actions, receipts and the rest are written by their owners under a
lease (runs/leases.py); an admin form that saved a whole row back would
write a stale lease epoch, or documents nobody checked, under a live run.
Operators act through the product's own pages (cancel, the outcome inbox)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.utils.decorators import method_decorator

from dashboard.security import rejects_bad_input
from runs.bulk import BulkJob
from runs.models import (
    Action,
    AnswerRevision,
    Checkpoint,
    OperatorDecision,
    OutcomeItem,
    Receipt,
    Run,
    RunEvent,
)


class ReadOnly:
    """No add, change or delete, for a ModelAdmin or an inline: the change
    page becomes a view page, and its POST, the add and delete pages and
    the delete action are refused (403)."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ReadOnlyAdmin(ReadOnly, admin.ModelAdmin):
    # A list filter's value goes into the query as it is: NUL in it would
    # be a 500, not an answer.
    @method_decorator(rejects_bad_input)
    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        return super().changelist_view(request, extra_context)


@admin.register(Run)
class RunAdmin(ReadOnlyAdmin):
    list_display = ["id", "question", "status", "phase", "lease_epoch", "created_at"]
    list_filter = ["status", "phase"]
    search_fields = ["question"]


@admin.register(Action)
class ActionAdmin(ReadOnlyAdmin):
    list_display = ["id", "run", "step_key", "kind", "effect_class", "state", "epoch", "attempts"]
    list_filter = ["state", "effect_class", "kind"]
    search_fields = ["step_key"]
    list_select_related = ["run"]


@admin.register(Receipt)
class ReceiptAdmin(ReadOnlyAdmin):
    list_display = ["action", "run", "step_key", "result_digest", "epoch", "created_at"]
    list_select_related = ["action", "run"]


@admin.register(AnswerRevision)
class AnswerRevisionAdmin(ReadOnlyAdmin):
    list_display = ["run", "number", "is_final", "epoch", "committed_at"]
    list_select_related = ["run"]


@admin.register(RunEvent)
class RunEventAdmin(ReadOnlyAdmin):
    list_display = ["run", "kind", "message", "created_at"]
    list_filter = ["kind"]
    list_select_related = ["run"]


@admin.register(Checkpoint)
class CheckpointAdmin(ReadOnlyAdmin):
    list_display = ["run", "number", "after_action", "outcome", "xid", "epoch", "created_at"]
    list_filter = ["outcome"]
    list_select_related = ["run", "after_action"]


@admin.register(OutcomeItem)
class OutcomeItemAdmin(ReadOnlyAdmin):
    list_display = ["subject", "run", "kind", "state", "xid", "created_at", "resolved_at"]
    list_filter = ["state", "kind"]
    search_fields = ["subject", "summary"]
    list_select_related = ["run"]


@admin.register(OperatorDecision)
class OperatorDecisionAdmin(ReadOnlyAdmin):
    """Decisions are immutable (a trigger, migration 0008): made through the
    inbox or `manage.py outcomes`, read here."""

    list_display = [
        "id",
        "run",
        "item",
        "choice",
        "decided_by",
        "state_before",
        "state_after",
        "created_at",
    ]
    list_filter = ["choice", "state_after"]
    search_fields = ["decided_by", "reason", "reference", "request_token"]
    list_select_related = ["run", "item"]


@admin.register(BulkJob)
class BulkJobAdmin(ReadOnlyAdmin):
    """Bulk jobs (runs/bulk.py): operators make and stop them on /bulk/."""

    list_display = [
        "id",
        "action",
        "choice",
        "kind",
        "requested_by",
        "state",
        "total",
        "created_at",
    ]
    list_filter = ["action", "state"]

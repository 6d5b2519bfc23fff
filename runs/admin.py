"""Admin for every model.  Receipts, answer revisions, checkpoints, outcome
items and events are facts or records: the admin shows them and never offers
to change or delete them (outcome items are decided in the operators' inbox)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from runs.models import (
    Action,
    AnswerRevision,
    Checkpoint,
    OutcomeItem,
    Receipt,
    Run,
    RunEvent,
)


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    list_display = ["id", "question", "status", "phase", "lease_epoch", "created_at"]
    list_filter = ["status", "phase"]
    search_fields = ["question"]
    readonly_fields = [
        "status",
        "status_reason",
        "phase",
        "phase_reason",
        "lease_owner",
        "lease_epoch",
        "lease_expires_at",
        "created_at",
        "updated_at",
        "started_at",
        "finished_at",
    ]

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


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

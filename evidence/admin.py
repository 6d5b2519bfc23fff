"""Admin for the evidence models: records, shown and never changed here
(runs.admin.ReadOnly)."""

from __future__ import annotations

from django.contrib import admin

from evidence.models import (
    BundleExport,
    CaptureGap,
    CaptureStats,
    EvidenceCopy,
    LockIncident,
    LockWait,
    ModelCall,
    Source,
)
from runs.admin import ReadOnly, ReadOnlyAdmin


@admin.register(Source)
class SourceAdmin(ReadOnlyAdmin):
    list_display = ["run", "path", "digest", "bytes", "changed", "created_at"]
    list_select_related = ["run"]


@admin.register(ModelCall)
class ModelCallAdmin(ReadOnlyAdmin):
    list_display = ["run", "action", "provider", "created_at"]
    list_select_related = ["run", "action"]


@admin.register(EvidenceCopy)
class EvidenceCopyAdmin(ReadOnlyAdmin):
    list_display = ["run", "model_call", "input_bytes", "output_bytes", "truncated", "created_at"]
    list_select_related = ["run"]


@admin.register(CaptureGap)
class CaptureGapAdmin(ReadOnlyAdmin):
    list_display = ["run", "model_call", "reason", "count", "detail", "created_at", "saved_at"]
    list_filter = ["reason"]
    list_select_related = ["run"]


@admin.register(CaptureStats)
class CaptureStatsAdmin(ReadOnlyAdmin):
    list_display = ["run", "captured", "lost"]


class LockWaitInline(ReadOnly, admin.TabularInline):
    model = LockWait
    extra = 0
    fields = ["waiter_pid", "waiter_role", "blocker_pid", "blocker_role", "mode", "locked"]


@admin.register(LockIncident)
class LockIncidentAdmin(ReadOnlyAdmin):
    list_display = ["id", "source", "started_at", "processes", "has_cycle", "summary"]
    list_filter = ["source", "has_cycle"]
    inlines = [LockWaitInline]


@admin.register(BundleExport)
class BundleExportAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "run",
        "requested_by",
        "state",
        "include_evidence",
        "rows_written",
        "rows_total",
        "bytes",
        "created_at",
        "expires_at",
    ]
    list_filter = ["state", "include_evidence"]
    list_select_related = ["run"]

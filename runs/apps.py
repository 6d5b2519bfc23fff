from __future__ import annotations

from django.apps import AppConfig


class RunsConfig(AppConfig):
    name = "runs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from runs import (
            bulk,  # noqa: F401 (its models, BulkJob and BulkJobItem)
            checks,  # noqa: F401 (registers them)
        )

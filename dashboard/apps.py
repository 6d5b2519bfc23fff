from __future__ import annotations

from django.apps import AppConfig


class DashboardConfig(AppConfig):
    """The operator UI, the JSON API and the metrics: what only the top
    layer keeps (API tokens, saved views) lives in its models."""

    name = "dashboard"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from runs import retention

        # An API submission names the run it made: retention removes it
        # with the run (a token used again afterwards submits anew).
        retention.also_remove(
            "dashboard_apisubmission",
            "DELETE FROM dashboard_apisubmission WHERE run_id = ANY(%(runs)s)",
        )

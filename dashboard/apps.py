from __future__ import annotations

from django.apps import AppConfig


class DashboardConfig(AppConfig):
    """The operator UI, the JSON API and the metrics: what only the top
    layer keeps (API tokens, saved views) lives in its models."""

    name = "dashboard"
    default_auto_field = "django.db.models.BigAutoField"

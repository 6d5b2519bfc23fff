"""What every page is given: `inbox`, a template context processor, gives
every page the count of open outcome items that need someone, which its
navigation shows.  The
words pages say live below them, in runs/words.py."""

from __future__ import annotations

import functools
from typing import Any

from django.http import HttpRequest

from runs.models import OutcomeItem
from runs.sql import unless_locked


def inbox(request: HttpRequest) -> dict[str, Any]:
    """The count of open outcome items that need someone (their run has not
    ended: an ended run's items block nothing), for the navigation's badge.
    Counted only when a page shows it (htmx fragments do not) and once per
    page: a callable the template calls, cached.  Served by outcome_open_idx."""
    user = getattr(request, "user", None)  # none before the auth middleware ran
    if user is None or not user.is_authenticated:
        return {}

    @functools.cache
    def open_items() -> int | None:
        # None (shown as "?") when a stranger holds the table: the page
        # itself may not need it, and its transaction goes on
        # (dashboard.security.PageLockWaitsMiddleware).
        return unless_locked(OutcomeItem.objects.in_inbox().needing_someone().count)

    return {"inbox_open": open_items}

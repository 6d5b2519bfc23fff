"""The request the views are given, typed: django-htmx's middleware adds
`request.htmx` (HtmxDetails), which HttpRequest does not declare.  This is
django-htmx's own idiom for type hints."""

from __future__ import annotations

from django.http import HttpRequest
from django_htmx.middleware import HtmxDetails


class HtmxHttpRequest(HttpRequest):
    htmx: HtmxDetails


def asks_for(request: HtmxHttpRequest, target: str) -> bool:
    """Whether htmx asked for the element with id `target` alone (a region
    that polls the page's own URL, such as a list's rows)."""
    return bool(request.htmx) and request.htmx.target == target

"""The Content-Security-Policy every page is served with.

Scripts come only from the site itself (htmx and plotly.js are served from
static/): no inline script, no eval, no other origin.  plotly.js sets
inline styles on the SVG it draws, hence 'unsafe-inline' for styles only.
"""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse

POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self' 'unsafe-inline'",
        "img-src 'self' data:",
        "font-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)


class RequestSizeLimitMiddleware:
    """Refuses a request body over MAX_REQUEST_BYTES before anything reads
    it (the CSRF check parses uploads): nobody fills the disk with one."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            return HttpResponse("bad Content-Length", status=400, content_type="text/plain")
        if length > settings.MAX_REQUEST_BYTES:
            return HttpResponse(
                f"request body over {settings.MAX_REQUEST_BYTES} bytes",
                status=413,
                content_type="text/plain",
            )
        return self.get_response(request)


class ContentSecurityPolicyMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        response.setdefault("Content-Security-Policy", POLICY)
        return response

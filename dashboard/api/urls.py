"""/api/: the API's operations (ninja routers, one module per kind of
thing, one function per operation: adding one is adding a function), its
OpenAPI document, and the page where a user makes and revokes tokens."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth.decorators import login_not_required
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.urls import URLPattern, path, re_path
from ninja import NinjaAPI

from dashboard.api import bulk, errors, items, runs, tokens
from dashboard.api.auth import AUTHENTICATED
from dashboard.api.errors import ApiError, refusal
from dashboard.security import nul_parameter

app_name = "api"


def _authenticated(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """The OpenAPI document, to whoever the operations answer (a token or a
    session): it describes this installation's agents and choices."""

    @wraps(view)
    def checked(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if request.method not in ("GET", "HEAD"):
            return HttpResponseNotAllowed(["GET", "HEAD"])  # said in JSON by _json_answers
        for auth in AUTHENTICATED:
            try:
                if auth(request):
                    return view(request, *args, **kwargs)
            except ApiError as error:
                return refusal(error)
        return refusal(ApiError(401, errors.UNAUTHENTICATED))

    return checked


class RundeskAPI(NinjaAPI):
    def get_openapi_operation_id(self, operation: Any) -> str:
        # The operation's function name (listRuns reads better than ninja's
        # module-qualified default, and stays stable when a module moves).
        name = operation.view_func.__name__
        first, *rest = name.split("_")
        return first + "".join(part.title() for part in rest)


api = RundeskAPI(
    title="Rundesk API",
    version="1",
    description="Runs, their outcome items and decisions: viewers read, operators act. "
    "Authenticate with 'Authorization: Bearer <token>' (a token made at /api/tokens/).",
    auth=AUTHENTICATED,
    urls_namespace=app_name,
    # No docs page: Swagger UI loads its scripts from another origin,
    # which the site's Content-Security-Policy refuses.
    docs_url=None,
    docs_decorator=_authenticated,
)
errors.install(api)
api.add_router("", runs.router)
api.add_router("", items.router)
api.add_router("", bulk.router)


def _json_answers(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """An API address answers JSON whoever asks: no sign-in redirect (the
    operations authenticate themselves: 401), a NUL refused as the pages
    refuse it, and a method it does not take said in JSON (ninja's 405 is
    plain text)."""

    @login_not_required
    @wraps(view)
    def answered(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if (name := nul_parameter(request)) is not None:
            return refusal(
                ApiError(400, f"parameter {name!r} holds a NUL character (%00)", field=name)
            )
        response = view(request, *args, **kwargs)
        if response.status_code == 405 and not response.get("Content-Type", "").startswith(
            "application/json"
        ):
            allowed = response.get("Allow", "")
            answer = refusal(ApiError(405, f"{request.method} is not allowed here: {allowed} is"))
            answer["Allow"] = allowed
            return answer
        return response

    return answered


@login_not_required
def not_found(request: HttpRequest, rest: str = "") -> HttpResponse:
    """Any other address under /api/, in JSON."""
    message = f"/api/{rest} is no address of the API"
    if rest and not rest.endswith("/"):
        message += f" (its addresses end with a slash: /api/{rest}/ ?)"
    return refusal(ApiError(404, message))


def _patterns() -> list[Any]:
    patterns, _, _ = api.urls
    for pattern in patterns:
        if pattern.name == "api-root":
            # ninja's root (it finds the API's prefix by it) says where its
            # docs page is; there is none (docs_url).
            pattern.callback = not_found
        elif isinstance(pattern, URLPattern):
            pattern.callback = _json_answers(pattern.callback)
    return patterns


urlpatterns = [
    path("tokens/", tokens.tokens, name="tokens"),
    path("tokens/<int:token_id>/revoke/", tokens.revoke, name="token-revoke"),
    *_patterns(),
    re_path(r"^(?P<rest>.*)$", not_found),
]

"""Every refusal of the API is JSON, in one shape:

    {"error": {"code": "...", "message": "...", "field": "..."}}

`code` is stable (a client branches on it), `message` says what was wrong
in an operator's words, `field` names the parameter or body field at fault
where there is one.  The status says the class: 400 a request the API
cannot use, 401 no or a bad token, 403 no permission (or a session's post
without its CSRF token), 404, 405, 409 a request the state refuses (a
decision that lost the race), 503 a stranger's lock held what it needed
(`locked`) or the database did not answer (`unavailable`)."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import BadRequest, PermissionDenied
from django.db import OperationalError, connection, transaction
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from ninja import NinjaAPI, Schema
from ninja.errors import AuthenticationError, HttpError, ValidationError

from dashboard.security import PAGE_LOCK_WAIT, FormLocked
from runs.sql import lock_refused

CODES = {
    400: "bad_request",
    401: "unauthenticated",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    503: "locked",
}

# What a request that authenticated nothing is told.
UNAUTHENTICATED = (
    "authenticate: send an API token as 'Authorization: Bearer <token>' "
    "(make one at /api/tokens/), or sign in"
)


class ErrorBody(Schema):
    code: str
    message: str
    field: str | None = None
    # The decision that stands, when one refused this request (409).
    decision: int | None = None


class ErrorOut(Schema):
    error: ErrorBody


# The refusals an operation's document declares: a read's, an act's.
READ = {status: ErrorOut for status in (400, 401, 404, 405, 503)}
ACT = {**READ, 403: ErrorOut, 409: ErrorOut}


class ApiError(Exception):
    """A refusal, said as the API says them all."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        field: str | None = None,
        decision: int | None = None,
        code: str = "",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.field, self.decision = status, message, field, decision
        self.code = code or CODES.get(status, "error")


def refusal(error: ApiError) -> JsonResponse:
    body: dict[str, Any] = {"code": error.code, "message": error.message}
    if error.field is not None:
        body["field"] = error.field
    if error.decision is not None:
        body["decision"] = error.decision
    response = JsonResponse({"error": body}, status=error.status)
    if error.status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="rundesk"'
    if error.status == 503:
        response["Retry-After"] = "5"
    return response


LOCKED = (
    "what this request needs is locked by another session (see the lock pages), given up "
    f"on after {PAGE_LOCK_WAIT}: nothing was changed; try again once it is free"
)


def _invalid(error: ValidationError) -> ApiError:
    """The first of pydantic's complaints, its field named as the client
    wrote it (`input`, `limit`), not as ninja nests it (body.payload.input)."""
    first = error.errors[0]
    where = [str(part) for part in first.get("loc", ())]
    if where and where[0] in ("body", "query", "path"):
        where = where[1:]
    if where and where[0] in ("payload", "filters"):  # the operations' parameter names
        where = where[1:]
    message = first.get("msg", "invalid")
    return ApiError(400, message, field=".".join(where) or None, code="invalid")


def _unanswered(request: HttpRequest, error: OperationalError) -> HttpResponse:
    """A lock refused (the pages' PAGE_LOCK_WAIT bounds every request) is a
    503 that says so, as is a database that does not answer; the
    transaction it aborted is rolled back."""
    if connection.in_atomic_block:
        transaction.set_rollback(True)
    if lock_refused(error):
        return refusal(ApiError(503, LOCKED))
    return refusal(
        ApiError(
            503,
            "the database did not answer (restarting, or out of connections): "
            "whether a change asked for was made, reading it again tells",
            code="unavailable",
        )
    )


def install(api: NinjaAPI) -> None:
    """Makes every error `api` answers one of the shape above."""
    handlers: list[tuple[type[Exception], Any]] = [
        (ApiError, lambda request, error: refusal(error)),
        (ValidationError, lambda request, error: refusal(_invalid(error))),
        # ninja's own, when no authentication answered ("Unauthorized").
        (AuthenticationError, lambda request, error: refusal(ApiError(401, UNAUTHENTICATED))),
        # ninja's others: a session's post without its CSRF token (403).
        (HttpError, lambda request, error: refusal(ApiError(error.status_code, str(error)))),
        (Http404, lambda request, error: refusal(ApiError(404, str(error) or "not found"))),
        (BadRequest, lambda request, error: refusal(ApiError(400, str(error)))),
        (PermissionDenied, lambda request, error: refusal(ApiError(403, str(error)))),
        (FormLocked, lambda request, error: refusal(ApiError(503, LOCKED))),
        (OperationalError, _unanswered),
    ]
    for kind, handler in handlers:
        api.add_exception_handler(kind, handler)

"""Who an API request is: a user's API token (Authorization: Bearer
<token>, dashboard.models.ApiToken), or the session of a user signed in to
the pages.  A token is sent by a script, never by a browser on its own, so
a token's request needs no CSRF token; a session's post does (ninja's
SessionAuth checks it, as Django's middleware checks the pages').  Either
way the request acts as its user, with the pages' permissions: viewers
read, operators act (runs.operate_run, the operators group)."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja.security import HttpBearer, SessionAuth

from dashboard.api.errors import ApiError
from dashboard.models import ApiToken
from dashboard.security import form_lock_waits
from runs.decisions import OPERATE


class BearerToken(HttpBearer):
    def __call__(self, request: HttpRequest) -> Any:
        header = request.headers.get("Authorization", "")
        if not header:
            return None  # perhaps a session
        scheme, _, secret = header.strip().partition(" ")
        # A header that does not authenticate is refused, not passed over
        # for the session: a script is told its token is wrong.
        if scheme.casefold() != "bearer" or not secret.strip():
            raise ApiError(401, "the Authorization header must be 'Bearer <token>'")
        return self.authenticate(request, secret.strip())

    def authenticate(self, request: HttpRequest, token: str) -> Any:
        # Bounded as the pages' sign-in is (a post's is not, by the pages'
        # middleware): a stranger's lock on the tokens is a 503, not a hang.
        with form_lock_waits():
            found = ApiToken.objects.authenticated(token)
        if found is None:
            raise ApiError(401, "this API token is not known, or was revoked")
        # What every check after this one asks (permissions, the pages'
        # middleware marking the answer private).
        request.user = found.user
        return found.user


class SignedIn(SessionAuth):
    def __call__(self, request: HttpRequest) -> Any:
        # Nobody signed in: no session to check a CSRF token against (401).
        if not request.user.is_authenticated:
            return None
        return super().__call__(request)  # the CSRF check of a post, then the user

    def authenticate(self, request: HttpRequest, key: str | None) -> Any:
        return request.user if request.user.is_authenticated else None


AUTHENTICATED = [BearerToken(), SignedIn()]


def operating(request: HttpRequest) -> None:
    """Refuses (403) a user without the operator permission: what the
    pages' actions check (permission_required), checked here in the view."""
    if not request.user.has_perm(OPERATE):
        raise ApiError(
            403,
            f"{request.user.get_username()} may read, not act: acting needs the operator "
            "permission (the operators group)",
        )

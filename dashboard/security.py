"""What the site accepts and how it is served: the Content-Security-Policy
every page is served with, signed-in pages kept out of caches, pages that
say the database cannot answer (a stranger's lock, an outage) instead of
hanging or failing, the request size limit, and the refusal of parameters
no query can hold (a NUL character).

Scripts come only from the site itself (htmx and plotly.js are served from
static/): no inline script, no eval, no other origin.  plotly.js sets
inline styles on the SVG it draws, hence 'unsafe-inline' for styles only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import wraps
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from django.conf import settings
from django.contrib.auth.middleware import LoginRequiredMiddleware
from django.contrib.auth.views import redirect_to_login
from django.contrib.messages import get_messages
from django.core.exceptions import BadRequest
from django.db import DatabaseError, OperationalError, connection, transaction
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest, HttpResponseForbidden
from django.middleware import csrf
from django.shortcuts import resolve_url
from django.template.loader import render_to_string
from django.utils.cache import patch_cache_control
from django.utils.http import url_has_allowed_host_and_scheme

from runs.sql import lock_refused, unless_locked, waits_bounded

# The longest a page waits for a lock someone else holds.
PAGE_LOCK_WAIT = "3s"
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


class FormAddressMiddleware:
    """A form's address opened as a page (a bookmark of /logout/, a link
    to a form's action) says what it is: Django's require_POST answers 405
    with an empty body, a blank page."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if response.status_code != 405 or response.content or request.method != "GET":
            return response
        allowed = response.get("Allow", "POST")
        page = render_to_string("405.html", {"allowed": allowed}, request=request)
        answer = HttpResponse(page, status=405)
        answer["Allow"] = allowed
        return answer


class ContentSecurityPolicyMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        response.setdefault("Content-Security-Policy", POLICY)
        return response


class SignInMiddleware(LoginRequiredMiddleware):
    """Every page needs a login (Django's LoginRequiredMiddleware), and a
    browser whose session ended comes back where it was once signed in
    again: a region's poll (htmx) takes the whole window to the sign-in
    page (HX-Redirect), where it swapped that page into the region it
    refreshes, and stopped; a form sent after the session ended comes back
    to the page it was sent from, not to its POST-only address (a GET there
    is refused)."""

    def handle_no_permission(self, request: HttpRequest, view_func: Any) -> HttpResponse:
        if request.headers.get("HX-Request"):
            came_from = request.headers.get("HX-Current-URL", "")
        elif request.method not in ("GET", "HEAD"):
            came_from = request.headers.get("Referer", "")
        else:
            return super().handle_no_permission(request, view_func)
        parts = urlsplit(_this_site(request, came_from))
        page = urlunsplit(("", "", parts.path or "/", parts.query, ""))
        login = redirect_to_login(
            page,
            resolve_url(self.get_login_url(view_func)),
            self.get_redirect_field_name(view_func),
        )
        if not request.headers.get("HX-Request"):
            return login
        response = HttpResponse(status=401)
        response["HX-Redirect"] = login.url
        return response


class PageLockWaitsMiddleware:
    """A page the database cannot answer now answers 503 at once, saying
    why, instead of a 500 or a hang.  A stranger's lock (a migration, a
    VACUUM FULL, a session left open in a transaction) is given up on after
    PAGE_LOCK_WAIT instead of holding a server thread for as long as the
    lock (a few pages polling every two seconds would take them all): each
    GET runs in one transaction whose lock waits are bounded (SET LOCAL: a
    pooler's server connection does not keep it); forms (POST) bound their
    own: what a form does up to and with its write runs in a transaction
    bounded the same way (`form_lock_waits`), and a lock refused there
    answers the same page, saying nothing was changed; what it shows
    afterwards is `shown_unless_locked`, saying what was done.  An htmx
    form gets the page's words in place of the page (htmx swaps no 503).
    A database that does not answer at all (restarting, out of
    connections) is said as such."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        form = request.method not in ("GET", "HEAD")
        try:
            # Who is signed in, before anything else reads it (the login
            # check, the CSRF check), under the same bound: a lock on the
            # session or the user table (a VACUUM FULL of django_session, a
            # migration of auth_user) held every page, then answered 500.
            # A database that cannot be reached at all took nothing.
            with waits_bounded(PAGE_LOCK_WAIT):
                _signed_in(request)
        except OperationalError as error:
            # The session could not be read, nor then the messages it
            # holds: trying again would wait for the database a second time
            # (the pool's whole timeout when it is down).
            return unavailable(request, locked=lock_refused(error), form=form, session_read=False)
        if form:
            return self.get_response(request)
        try:
            with waits_bounded(PAGE_LOCK_WAIT):
                return self.get_response(request)
        except OperationalError as error:  # the transaction could not begin or end
            return unavailable(request, locked=lock_refused(error))

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if isinstance(exception, FormLocked):  # rolled back: nothing was changed
            return unavailable(request, locked=True, form=True)
        if not isinstance(exception, OperationalError):
            return None
        if request.method not in ("GET", "HEAD"):
            # A form the database stopped answering (signing in included):
            # whether its change was made is for the page to show.
            return unavailable(request, locked=False, form=True, done=None)
        transaction.set_rollback(True)
        return unavailable(request, locked=lock_refused(exception))


def csrf_failure(request: HttpRequest, reason: str = "") -> HttpResponse:
    """A form Django's CSRF check refused (CSRF_FAILURE_VIEW), saying which
    check failed: Django renders a site's own 403_csrf.html without its
    reason, and an origin the server does not know (a proxy, TLS not
    declared) is not an old page."""
    context = {"why": csrf_words(reason), "reason": reason}
    return HttpResponseForbidden(render_to_string("403_csrf.html", context, request=request))


def csrf_words(reason: str) -> str:
    """What a CSRF refusal's `reason` (django.middleware.csrf) means."""
    if reason.endswith("does not match any trusted origins."):
        return (
            "The form came from an address that is not this site's as the server knows it "
            "(behind a proxy or TLS: set RUNDESK_TLS=1, ALLOWED_HOSTS or CSRF_TRUSTED_ORIGINS, "
            "as the README's Deploying section says)."
        )
    if reason.startswith("Referer checking failed"):
        return (
            "Over HTTPS the browser must say which page of this site sent the form (its "
            "Referer header), and it sent none this check accepts (none, a malformed one, or one "
            "not over HTTPS): a browser setting or an extension may remove or change it."
        )
    if reason == csrf.REASON_NO_CSRF_COOKIE:
        return "The browser did not send this site's cookie: cookies may be blocked for this site."
    return (
        "The form was sent without the token that proves this site made it, or with one of "
        "an older session: the page may be older than your sign-in."
    )


def _this_site(request: HttpRequest, url: str) -> str:
    """`url` if it is a page of this site (a header the client sends is
    never put in a link otherwise: javascript:, another site)."""
    allowed = url_has_allowed_host_and_scheme(
        url, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    )
    return url if allowed else ""


class FormLocked(Exception):
    """What a form does up to its write was held by a lock, and rolled back."""


@contextmanager
def form_lock_waits() -> Iterator[None]:
    """For what a form (POST) does up to and with its write: one
    transaction whose lock waits end after PAGE_LOCK_WAIT.  A lock refused
    rolls it all back and raises FormLocked (the middleware answers 503,
    saying nothing was changed); no other error is taken for one."""
    try:
        with waits_bounded(PAGE_LOCK_WAIT):
            yield
    except DatabaseError as error:
        if lock_refused(error):
            raise FormLocked() from error
        raise


def shown_unless_locked(
    request: HttpRequest, show: Callable[[], HttpResponse], page: str, say: Callable[[], None]
) -> HttpResponse:
    """What an htmx form answers once its work is done: `show()` (the
    region it renders again, saying what was done), its lock waits
    bounded.  Held by a stranger's lock, the lock page's words instead,
    with what `say()` says was done and a link to `page`."""
    shown = unless_locked(show, PAGE_LOCK_WAIT)
    if shown is not None:
        return shown
    say()
    return unavailable(request, locked=True, form=True, done=True, back=page)


def unavailable(
    request: HttpRequest,
    *,
    locked: bool,
    form: bool = False,
    done: bool | None = False,
    back: str = "",
    session_read: bool = True,
) -> HttpResponse:
    """The page that says the database could not answer: held by a lock
    (`locked`), for a form (`form`) that did what it was asked (`done`),
    nothing, or what is not known (None), with the messages waiting to be
    said (what was done).  It reads nothing from the database (messages
    the session holds, where it cannot be read, are not said; where it
    could not be read already, `session_read` False, it is not tried
    again).  An htmx
    form gets its words in place of the page it came from (htmx swaps no
    503); a region's poll gets the 503, and its region stays as it was
    until the next poll."""
    context = {
        "locked": locked,
        "form": form,
        "done": done,
        "wait": PAGE_LOCK_WAIT,
        "said": _said(request) if session_read else [],
        "back": back or _this_site(request, request.headers.get("HX-Current-URL", "")),
    }
    if form and getattr(request, "htmx", False):
        response = HttpResponse(render_to_string("503.html#held", context))
        response["HX-Retarget"], response["HX-Reswap"] = "body", "innerHTML"
        return response
    response = HttpResponse(render_to_string("503.html", context), status=503)
    response["Retry-After"] = "5"
    return response


def _signed_in(request: HttpRequest) -> bool:
    """Reads the session and the user (request.user is read lazily, once),
    and keeps the answer for PrivatePagesMiddleware."""
    request.signed_in = request.user.is_authenticated
    return request.signed_in


def _said(request: HttpRequest) -> list[str]:
    """The messages waiting to be said; none where the session that may
    hold them cannot be read (the database is down, the session table is
    held by a lock: given up on after PAGE_LOCK_WAIT)."""
    try:
        # Within a page's transaction its bound holds (and a savepoint in an
        # aborted one would fail: a session read already is no query).
        with nullcontext() if connection.in_atomic_block else waits_bounded(PAGE_LOCK_WAIT):
            return [str(message) for message in get_messages(request)]
    except DatabaseError:
        return []


class PrivatePagesMiddleware:
    """A signed-in user's pages are theirs alone: kept by no shared cache,
    nor by the browser once left (a run page shows model output as it came)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        # Read already by PageLockWaitsMiddleware (no query: a sign-in on
        # the way sets it anew); where it could not be read (the database
        # down, the session locked), private.
        signed_in = request.user.is_authenticated if hasattr(request, "signed_in") else True
        if signed_in and not response.has_header("Cache-Control"):
            patch_cache_control(response, private=True, no_store=True)
        return response


def nul_parameter(request: HttpRequest) -> str | None:
    """The name of the first GET or POST parameter whose name or value holds
    a NUL character.  PostgreSQL refuses NUL in text, so such a value fails
    as a 500 at the first query that uses it."""
    for params in (request.GET, request.POST):
        for name, values in params.lists():
            if "\x00" in name or any("\x00" in value for value in values):
                return name
    return None


def not_understood(request: HttpRequest, problem: str) -> HttpResponse:
    """The page that says what of a request was not understood (400), in
    the site's layout, with a way back: the page without its parameters,
    or, for a form, the page it was sent from."""
    if request.method in ("GET", "HEAD"):
        back = request.path
    else:
        back = _this_site(request, request.headers.get("Referer", "")) or resolve_url("runs-list")
    context = {"problem": problem, "back": back}
    return HttpResponseBadRequest(render_to_string("400.html", context, request=request))


def rejects_bad_input(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Answers 400, saying what was wrong, to a NUL character in any
    parameter, and to the BadRequest the view raises on a parameter it
    cannot use (a malformed cursor, a status that is none of the statuses)."""

    @wraps(view)
    def checked(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if (name := nul_parameter(request)) is not None:
            return not_understood(
                request,
                f"parameter {name!r} holds a NUL character (%00), which no text here may contain",
            )
        try:
            return view(request, *args, **kwargs)
        except BadRequest as error:
            return not_understood(request, str(error))

    return checked

"""What the top layer keeps for itself: nothing below it (runs, evidence)
reads these tables."""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import IntegrityError, models, transaction
from django.db.models import Q
from django.db.models.functions import Now
from django.urls import reverse
from django.utils import timezone
from django.utils.http import urlencode

from runs.bulk import TOKEN_MAX, BulkJob, Created, DryRun, Refused, create_job
from runs.models import Run, digest

# What starts every API token: a secret pasted somewhere it should not be
# is recognised as Rundesk's (and secret scanners can be told the prefix).
TOKEN_PREFIX = "rdk_"  # noqa: S105 (a prefix, no secret)
# The characters of a token kept in clear, to tell tokens apart on their page.
SHOWN_CHARACTERS = 8
# A token's last use is written at most this often (seconds): a script
# polling the API writes no row per request.
LAST_USED_EVERY = 60


def token_digest(secret: str) -> str:
    """What is stored of a token: the SHA-256 of its secret.  The secret
    has 256 bits of randomness, so no salt or slow hash is needed: nobody
    guesses one from its digest."""
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class Issued:
    """A token just made, and its secret: shown once, never stored."""

    token: ApiToken
    secret: str


class ApiTokenQuerySet(models.QuerySet["ApiToken"]):
    def active(self) -> ApiTokenQuerySet:
        return self.filter(revoked_at__isnull=True)

    def issue(self, user: Any, name: str) -> Issued:
        secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
        token = self.create(
            user=user,
            name=name.strip(),
            digest=token_digest(secret),
            shown=secret[: len(TOKEN_PREFIX) + SHOWN_CHARACTERS],
        )
        return Issued(token, secret)

    def authenticated(self, secret: str) -> ApiToken | None:
        """The active token whose secret this is, of an active user, its
        last use noted; None for any other secret."""
        token = (
            self.active()
            .filter(digest=token_digest(secret), user__is_active=True)
            .select_related("user")
            .first()
        )
        if token is not None:
            now = timezone.now()
            # A conditional update: concurrent requests write it once.
            self.filter(pk=token.pk).filter(
                Q(last_used_at__isnull=True)
                | Q(last_used_at__lt=now - dt.timedelta(seconds=LAST_USED_EVERY))
            ).update(last_used_at=now)
        return token


class ApiToken(models.Model):
    """A user's token for the JSON API (Authorization: Bearer <secret>):
    it acts as its user, with the same permissions as the pages.  Only the
    digest of its secret is stored; revoked, it authenticates nothing."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    name = models.CharField(max_length=100, help_text="What the token is for")
    digest = models.CharField(max_length=64, unique=True, help_text="SHA-256 of the secret")
    # The secret's first characters, to tell tokens apart: too few to use.
    shown = models.CharField(max_length=20)
    created_at = models.DateTimeField(db_default=Now())
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = ApiTokenQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.CheckConstraint(condition=~Q(name=""), name="api_token_named"),
            # One active token of a name per user: revoking "ci" names the one meant.
            models.UniqueConstraint(
                fields=["user", "name"],
                condition=Q(revoked_at__isnull=True),
                name="api_token_name_unique_per_user",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.shown}…)"

    def revoke(self) -> bool:
        """Revokes the token; False if it was revoked already."""
        now = timezone.now()
        revoked = ApiToken.objects.filter(pk=self.pk, revoked_at__isnull=True).update(
            revoked_at=now
        )
        if revoked:
            self.revoked_at = now
        return bool(revoked)


class TokenReused(Exception):
    """A request token used before for another request."""


@dataclass(frozen=True)
class Submitted:
    """The run a submission queued, or (`repeated`) the one an earlier
    request with the same token queued: this one changed nothing."""

    run: Run
    repeated: bool = False


class ApiSubmissionQuerySet(models.QuerySet["ApiSubmission"]):
    def submitted(
        self, user: Any, token: str, asked: dict[str, Any], submit: Callable[[], Run]
    ) -> Submitted:
        """`submit()` once per (user, token): a repeat of the same request
        (`asked`) finds the run the first one queued, also when the two
        run at once (the unique constraint decides; the loser finds the
        winner's).  TokenReused for another request under the same token."""
        request_digest = digest(asked)
        if (earlier := self._earlier(user, token, request_digest)) is not None:
            return Submitted(earlier, repeated=True)
        try:
            with transaction.atomic():
                run = submit()
                self.create(user=user, request_token=token, request_digest=request_digest, run=run)
        except IntegrityError:
            if (earlier := self._earlier(user, token, request_digest)) is not None:
                return Submitted(earlier, repeated=True)
            raise
        return Submitted(run)

    def _earlier(self, user: Any, token: str, request_digest: str) -> Run | None:
        earlier = self.filter(user=user, request_token=token).select_related("run").first()
        if earlier is None:
            return None
        if earlier.request_digest != request_digest:
            raise TokenReused(
                f"this request token was used for another submission (run {earlier.run_id})"
            )
        return earlier.run


class ApiSubmission(models.Model):
    """A run submitted through the API under a client's request token: a
    repeat of the request (a retry after a lost answer) finds this run
    instead of queueing a second one.  Its request's digest tells a repeat
    from another request that reuses the token."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    request_token = models.CharField(max_length=100)
    request_digest = models.CharField(max_length=64)
    # Deleted with its run (retention purges ended runs).
    run = models.OneToOneField(Run, on_delete=models.CASCADE, related_name="+")
    created_at = models.DateTimeField(db_default=Now())

    objects = ApiSubmissionQuerySet.as_manager()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["user", "request_token"], name="api_submission_token_unique"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.request_token} -> run {self.run_id}"


# The runs list's parameters a saved view keeps; the page cursor (before)
# is not one: a view opens at its first page.
VIEW_PARAMETERS = (
    "status",
    "agent",
    "unknown",
    "gaps",
    "drills",
    "q",
    "label",
    "time",
    "from",
    "to",
    "sort",
)


class SavedViewQuerySet(models.QuerySet["SavedView"]):
    def visible_to(self, user: models.Model) -> SavedViewQuerySet:
        """The views `user` may open: their own and the shared ones."""
        return (
            self.filter(Q(owner=user) | Q(shared=True))
            .select_related("owner")
            .order_by("name", "id")
        )


class SavedView(models.Model):
    """A runs-list filter an operator keeps under a name; shared, every
    signed-in user may open it by its URL (/views/ID/), private only its
    owner.  Only its owner changes or removes it."""

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="saved_views"
    )
    name = models.CharField(max_length=100)
    # The runs list's query string (VIEW_PARAMETERS only), as urlencode writes it.
    query = models.TextField(blank=True)
    shared = models.BooleanField(default=False)
    created_at = models.DateTimeField(db_default=Now())

    objects = SavedViewQuerySet.as_manager()

    class Meta:
        ordering = ["name", "id"]
        constraints = [
            models.UniqueConstraint(fields=["owner", "name"], name="saved_view_name_per_owner"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.owner_id})"

    @property
    def list_url(self) -> str:
        """The runs list, filtered as the view says."""
        return reverse("runs-list") + (f"?{self.query}" if self.query else "")

    @staticmethod
    def kept_query(pairs: list[tuple[str, str]]) -> str:
        """What a view keeps of a runs-list query: its parameters, in order,
        the empty ones and the page cursor left out."""
        return urlencode([(k, v) for k, v in pairs if k in VIEW_PARAMETERS and v.strip()])


class ApiBulkRequestQuerySet(models.QuerySet["ApiBulkRequest"]):
    def earlier(self, user: Any, token: str, asked: dict[str, Any]) -> BulkJob | None:
        """The job an earlier request with this token made, when this one
        (`asked`) repeats it; TokenReused when the token was used for
        another request (another user's, another body)."""
        earlier = self.filter(request_token=token).select_related("job").first()
        if earlier is None:
            return None
        if earlier.user_id != user.pk or earlier.request_digest != digest(asked):
            raise TokenReused(
                f"this request token was used for another bulk request (job {earlier.job_id})"
            )
        return earlier.job

    def start(
        self, user: Any, token: str, asked: dict[str, Any], planned: DryRun, reason: str
    ) -> Created:
        """The job for the runs `planned` (the dry run of `asked`) says
        would change, made by runs.bulk.create_job as the confirm page makes
        it, and recorded with what was asked, in one transaction; Refused
        when the dry run refuses the selection or nothing would change.  A
        twin of this request started at once finds the winner's job (the
        job's unique token decides; its record commits with it)."""
        if planned.refused:
            raise Refused(planned.refused)
        if not planned.changing:
            raise Refused(
                f"nothing would change on the {planned.total} runs selected: no job was made"
            )
        with transaction.atomic():
            created = create_job(
                planned.ask,
                planned.selection,
                planned.changing_ids,
                user=user,
                reason=reason,
                token=token,
            )
            if not created.repeated:
                self.create(
                    user=user, request_token=token, request_digest=digest(asked), job=created.job
                )
                return created
        if (earlier := self.earlier(user, token, asked)) is None:
            raise TokenReused(
                f"this request token was used for bulk job {created.job.pk}, "
                "started on the pages or by the command"
            )
        return Created(earlier, repeated=True)


class ApiBulkRequest(models.Model):
    """A bulk job started through the API under a client's request token:
    its request's digest tells a repeat (a retry after a lost answer: the
    same job) from another request that reuses the token (refused).  The
    job's own token (runs.bulk) makes it once; this row says what was asked."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    # Unique as the job's is: one token, one job, whoever asked.
    request_token = models.CharField(max_length=TOKEN_MAX, unique=True)
    request_digest = models.CharField(max_length=64)
    job = models.OneToOneField(BulkJob, on_delete=models.CASCADE, related_name="+")
    created_at = models.DateTimeField(db_default=Now())

    objects = ApiBulkRequestQuerySet.as_manager()

    def __str__(self) -> str:
        return f"{self.request_token} -> bulk job {self.job_id}"

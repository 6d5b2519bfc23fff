"""What the top layer keeps for itself: nothing below it (runs, evidence)
reads these tables."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.db.models.functions import Now
from django.urls import reverse
from django.utils.http import urlencode

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

"""Admin for what the top layer keeps: staff see every user's API tokens
(never a secret: none is kept) and revoke one that leaked; nobody adds or
edits one here (its user makes it, and sees its secret once)."""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from dashboard.models import ApiToken
from runs.admin import ReadOnlyAdmin


@admin.register(ApiToken)
class ApiTokenAdmin(ReadOnlyAdmin):
    list_display = ["name", "user", "shown", "created_at", "last_used_at", "revoked_at"]
    list_filter = [("revoked_at", admin.EmptyFieldListFilter)]
    search_fields = ["name", "user__username"]
    fields = ["user", "name", "shown", "created_at", "last_used_at", "revoked_at"]
    actions = ["revoke"]

    @admin.action(description="Revoke the selected tokens")
    def revoke(self, request: HttpRequest, tokens: QuerySet[ApiToken]) -> None:
        revoked = sum(token.revoke() for token in tokens)
        self.message_user(request, f"{revoked} token(s) revoked.", messages.SUCCESS)

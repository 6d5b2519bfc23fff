from __future__ import annotations

import json
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import IntegrityError

from dashboard.models import ApiToken


class Command(BaseCommand):
    help = (
        "API tokens (Authorization: Bearer) of a user: `create USER --name N` prints the "
        "token once (only its digest is kept), `revoke USER --name N`, `list [USER]`."
    )

    def add_arguments(self, parser: Any) -> None:
        actions = parser.add_subparsers(dest="action", required=True)
        create = actions.add_parser("create", help="make a token; its secret is printed once")
        revoke = actions.add_parser("revoke", help="revoke a user's active token of that name")
        listed = actions.add_parser("list", help="tokens, a user's or everyone's")
        for action in (create, revoke):
            action.add_argument("user", help="the user's name")
            action.add_argument("--name", required=True, help="the token's name")
        listed.add_argument("user", nargs="?", help="the user's name (all users when absent)")
        for action in (create, revoke, listed):
            action.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        action = options["action"]
        if action == "list":
            tokens = ApiToken.objects.select_related("user")
            if options["user"]:
                tokens = tokens.filter(user=self._user(options["user"]))
            self._say(options, [self._row(token) for token in tokens.order_by("created_at")])
            return
        user, name = self._user(options["user"]), options["name"].strip()
        if action == "create":
            if not name or "\x00" in name:
                raise CommandError("--name must be some text (no NUL)")
            try:
                issued = ApiToken.objects.issue(user, name)
            except IntegrityError:
                raise CommandError(
                    f"{user.get_username()} has an active token named {name!r}: revoke it first"
                ) from None
            row = {**self._row(issued.token), "token": issued.secret}
            if options["json"]:
                self.stdout.write(json.dumps(row))
            else:
                self.stdout.write(
                    f"token {name!r} of {user.get_username()} (shown once, keep it safe):\n"
                    f"{issued.secret}"
                )
            return
        token = ApiToken.objects.active().filter(user=user, name=name).first()
        if token is None:
            raise CommandError(f"{user.get_username()} has no active token named {name!r}")
        token.revoke()
        self._say(options, self._row(token), f"token {name!r} of {user.get_username()} revoked")

    def _user(self, name: str) -> Any:
        try:
            return get_user_model().objects.get_by_natural_key(name)
        except get_user_model().DoesNotExist:
            raise CommandError(f"there is no user {name!r}") from None

    def _row(self, token: ApiToken) -> dict[str, Any]:
        return {
            "id": token.pk,
            "user": token.user.get_username(),
            "name": token.name,
            "starts_with": token.shown,
            "created_at": token.created_at.isoformat(),
            "last_used_at": token.last_used_at.isoformat() if token.last_used_at else None,
            "revoked_at": token.revoked_at.isoformat() if token.revoked_at else None,
        }

    def _say(self, options: dict[str, Any], value: Any, said: str = "") -> None:
        if options["json"]:
            self.stdout.write(json.dumps(value))
        elif said:
            self.stdout.write(said)
        else:
            for row in value:
                state = f"revoked {row['revoked_at']}" if row["revoked_at"] else "active"
                self.stdout.write(
                    f"{row['id']}\t{row['user']}\t{row['name']}\t{row['starts_with']}…\t{state}"
                )

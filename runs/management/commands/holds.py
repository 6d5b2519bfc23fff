"""`manage.py holds add|list|release`: an operator's stop on a tool, or on
every effect of an agent, before it is dispatched (runs/holds.py)."""

from __future__ import annotations

import json
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.base_user import AbstractBaseUser
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from runs import holds
from runs.models import Hold
from runs.words import human_duration

HELP = """Tool holds.

  holds add --tool send_email [--agent support] --reason R --as USER
      holds a tool, of one agent or of every agent: runs reaching its
      boundary wait, dispatching nothing, until it is released
  holds add --effects --agent support --reason R --as USER
      holds every effect of one agent
  holds list [--json]
      the active holds, then the released ones, with how many runs waited
  holds release ID --reason R --as USER
      every run waiting on it goes back to the queue at once
"""


class Command(BaseCommand):
    help = HELP

    def add_arguments(self, parser: Any) -> None:
        commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

        add = commands.add_parser("add", help="hold a tool, or every effect of an agent")
        what = add.add_mutually_exclusive_group(required=True)
        what.add_argument("--tool", help="the tool to hold")
        what.add_argument(
            "--effects", action="store_true", help="every effect of --agent (required then)"
        )
        add.add_argument("--agent", default="", help="only this agent's (default: every agent's)")
        self._person(add)

        listing = commands.add_parser("list", help="active and released holds")
        listing.add_argument("--json", action="store_true")

        release = commands.add_parser("release", help="release a hold: its runs go on")
        release.add_argument("hold_id", type=int, metavar="ID")
        self._person(release)

    def _person(self, parser: Any) -> None:
        parser.add_argument("--reason", required=True, help="why: kept with the hold")
        parser.add_argument(
            "--as",
            dest="username",
            required=True,
            metavar="USER",
            help="the person: a user with the operator permission",
        )
        parser.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        {"add": self.add, "list": self.list, "release": self.release}[options["command"]](options)

    def _user(self, username: str) -> AbstractBaseUser:
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"there is no user {username!r}")
        return user

    def add(self, options: dict[str, Any]) -> None:
        if options["effects"] and not options["agent"]:
            raise CommandError("--effects holds every effect of one agent: name it with --agent")
        scope = holds.Scope(tool=options["tool"] or "", agent=options["agent"])
        try:
            hold = holds.add(scope, user=self._user(options["username"]), reason=options["reason"])
        except holds.HoldRefused as refused:
            raise CommandError(f"not held: {refused}") from None
        audit = holds.audited(Hold.objects.filter(pk=hold.pk), timezone.now())[0]
        in_flight = ", ".join(f"run {each['run']} {each['step_key']}" for each in hold.in_flight)
        self._emit(
            options,
            holds.as_json(audit),
            [
                f"hold {hold.pk}: {audit.scope} held by {hold.added_by}: {hold.reason}",
                f"in flight when it was added (they go on): {in_flight or 'none'}",
            ],
        )

    def release(self, options: dict[str, Any]) -> None:
        try:
            released = holds.release(
                options["hold_id"], user=self._user(options["username"]), reason=options["reason"]
            )
        except holds.HoldRefused as refused:
            raise CommandError(f"not released: {refused}") from None
        hold = released.hold
        self._emit(
            options,
            {"id": hold.pk, "released_by": hold.released_by, "runs_resumed": released.resumed},
            [holds.released_count_words(released)],
        )

    def list(self, options: dict[str, Any]) -> None:
        active, released = holds.listing(timezone.now())
        document = {
            "active": [holds.as_json(audit) for audit in active],
            "released": [holds.as_json(audit) for audit in released],
        }
        text = [_line(audit) for audit in active] or ["no active holds"]
        if released:
            text += ["", "released:"] + [_line(audit) for audit in released]
        self._emit(options, document, text)

    def _emit(self, options: dict[str, Any], document: dict[str, Any], text: list[str]) -> None:
        if options["json"]:
            self.stdout.write(json.dumps(document, ensure_ascii=False))
        else:
            self.stdout.write("\n".join(text))


def _line(audit: holds.Audit) -> str:
    hold = audit.hold
    line = (
        f"#{hold.pk}  {audit.scope}  by {hold.added_by}: {hold.reason}  "
        f"waiting {audit.waiting}, waited {audit.waited} "
        f"({human_duration(audit.seconds)} in all)"
    )
    if hold.released_at:
        line += f"  released by {hold.released_by}: {hold.release_reason}"
    return line

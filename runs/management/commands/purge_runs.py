"""`manage.py purge_runs --older-than DURATION [--status S ...] [--bundle-to DIR]
[--dry-run] [--json]`: retention by hand (runs/retention.py; beat runs it
daily when RUNDESK_PURGE_AFTER is set).  Exit 0 only when every purgeable
run went, or, dry, nothing was changed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from runs import durations, retention
from runs.lifecycle import TERMINAL_STATUSES


class Command(BaseCommand):
    help = (
        "Removes runs that ended (completed, failed, cancelled) longer than DURATION ago, with "
        "every row of theirs, in short batches; never a run with an open item, nor one queued, "
        "running or waiting for an operator.  With --bundle-to, each run's investigation bundle "
        "is written and verified there first, and a run whose bundle fails is kept."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--older-than",
            required=True,
            metavar="DURATION",
            help="ended longer ago than this: 45s, 30m, 12h, 90d, 2w, or ISO 8601 (P90D)",
        )
        parser.add_argument(
            "--status",
            action="append",
            choices=[str(status) for status in TERMINAL_STATUSES],
            help="only runs that ended so (repeatable); default: every ended status",
        )
        parser.add_argument(
            "--bundle-to", metavar="DIR", help="write each run's bundle here (run-ID.zip) first"
        )
        parser.add_argument(
            "--no-evidence",
            action="store_true",
            help="with --bundle-to: bundles without the copies of model calls",
        )
        parser.add_argument(
            "--batch", type=int, default=retention.BATCH, help="runs removed per transaction"
        )
        parser.add_argument(
            "--rest",
            type=float,
            default=retention.REST,
            metavar="FACTOR",
            help="after each batch, rest FACTOR times as long as the batch took (0: none; the "
            "default leaves the runs executing three quarters of the time)",
        )
        parser.add_argument("--dry-run", action="store_true", help="change nothing: say what")
        parser.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            older_than = durations.parse(options["older_than"])
        except ValueError as error:
            raise CommandError(f"--older-than: {error}") from None
        if options["batch"] < 1:
            raise CommandError("--batch must be at least 1")
        if not 0 <= options["rest"] <= 100:
            raise CommandError("--rest must be from 0 to 100")
        folder = Path(options["bundle_to"]) if options["bundle_to"] else None
        if folder is not None and not folder.is_dir():
            raise CommandError(f"--bundle-to {folder}: there is no such folder")
        purged = retention.purge(
            older_than,
            statuses=options["status"],
            bundle_to=folder,
            dry_run=options["dry_run"],
            batch=options["batch"],
            rest=options["rest"],
            include_evidence=not options["no_evidence"],
        )
        self.stdout.write(json.dumps(purged.json()) if options["json"] else purged.said())
        if purged.refused or purged.stopped:
            raise CommandError(
                f"{len(purged.refused)} runs kept because their bundle failed"
                + (f"; stopped early: {purged.stopped}" if purged.stopped else "")
            )

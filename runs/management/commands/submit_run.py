from __future__ import annotations

import datetime as dt
import json
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from django.utils import timezone

from runs.submission import submit
from runs.tasks import execute_run, hand_over


class Command(BaseCommand):
    help = "Queues a research run and prints its id."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--question", required=True)
        parser.add_argument(
            "--doc",
            action="append",
            required=True,
            dest="docs",
            help="a document path relative to RUNDESK_CORPUS_DIR (repeat for several)",
        )
        parser.add_argument("--faults", default="", help="fault plan, as JSON (runs/faults.py)")
        parser.add_argument("--budget", type=int, help="action budget")
        parser.add_argument("--deadline-seconds", type=float, help="deadline from now")
        parser.add_argument(
            "--celery",
            action="store_true",
            help="also hand the run to a Celery worker (an executor may take it first)",
        )
        parser.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            faults = json.loads(options["faults"]) if options["faults"] else []
        except json.JSONDecodeError as error:
            raise CommandError(f"--faults is not valid JSON: {error}") from None
        deadline = None
        if options["deadline_seconds"] is not None:
            try:
                deadline = timezone.now() + dt.timedelta(seconds=options["deadline_seconds"])
            except (OverflowError, ValueError):
                raise CommandError(
                    f"--deadline-seconds {options['deadline_seconds']}: no date is that far "
                    "from now"
                ) from None
        with transaction.atomic():
            try:
                run = submit(
                    question=options["question"],
                    documents=options["docs"],
                    faults=faults,
                    action_budget=options["budget"],
                    deadline=deadline,
                )
            except ValueError as error:
                raise CommandError(str(error)) from None
        if options["celery"] and (refused := hand_over(execute_run, run.pk)):
            # The run is queued all the same: the sweep hands it out.
            self.stderr.write(
                f"run {run.pk} is queued, but handing it to Celery failed ({refused}): "
                f"the sweep hands it out within {settings.RUNDESK_REDELIVER_SECONDS:g} s "
                "once the broker answers. Do not submit it again."
            )
        if options["json"]:
            self.stdout.write(json.dumps({"run_id": run.pk}))
        else:
            self.stdout.write(f"run {run.pk} queued")

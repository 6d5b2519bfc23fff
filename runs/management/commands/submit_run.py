from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from django.utils import timezone

from runs.finding import parse_labels
from runs.submission import submit
from runs.tasks import execute_run, hand_over


class Command(BaseCommand):
    help = (
        "Queues a run of an installed agent on its input (--agent, --input) and prints its id; "
        "--question and --doc are the research agent's input, said short."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--agent", default="research", help="an installed agent's name")
        parser.add_argument(
            "--input",
            help="the run's input as JSON, or @FILE to read it from a file (the agent's shape)",
        )
        parser.add_argument("--question", help="research: the question")
        parser.add_argument(
            "--doc",
            action="append",
            dest="docs",
            help="research: a document path relative to RUNDESK_CORPUS_DIR (repeat for several)",
        )
        parser.add_argument("--faults", default="", help="fault plan, as JSON (runs/faults.py)")
        parser.add_argument(
            "--label",
            action="append",
            dest="labels",
            default=[],
            metavar="KEY=VALUE",
            help="a label operators find the run by (repeat for several)",
        )
        parser.add_argument("--budget", type=int, help="action budget")
        parser.add_argument("--deadline-seconds", type=float, help="deadline from now")
        parser.add_argument(
            "--celery",
            action="store_true",
            help="also hand the run to a Celery worker (an executor may take it first)",
        )
        parser.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        shorthand = options["question"] is not None or options["docs"] is not None
        if shorthand and options["agent"] != "research":
            raise CommandError("--question and --doc are the research agent's: use --input")
        if shorthand == (options["input"] is not None):
            raise CommandError("give --input (or, for the research agent, --question and --doc)")
        input = read_input(options["input"]) if options["input"] is not None else None
        try:
            faults = json.loads(options["faults"]) if options["faults"] else []
        except json.JSONDecodeError as error:
            raise CommandError(f"--faults is not valid JSON: {error}") from None
        try:
            labels = parse_labels(options["labels"])
        except ValueError as error:
            raise CommandError(f"--label: {error}") from None
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
                    options["agent"],
                    input,
                    question=options["question"],
                    documents=options["docs"],
                    faults=faults,
                    action_budget=options["budget"],
                    deadline=deadline,
                    labels=labels,
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


def read_input(given: str) -> dict[str, Any]:
    """--input's JSON object, given as text or as @FILE."""
    if given.startswith("@"):
        try:
            given = Path(given[1:]).read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise CommandError(f"--input {given}: cannot read it: {error}") from None
    try:
        input = json.loads(given)
    except json.JSONDecodeError as error:
        raise CommandError(f"--input is not valid JSON: {error}") from None
    if not isinstance(input, dict):
        raise CommandError("--input must be a JSON object")
    return input

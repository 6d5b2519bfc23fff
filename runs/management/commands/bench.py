"""`manage.py bench`: the arguments, and which benchmark of runs/benchmarks/
they ask for."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from runs.benchmarks import bundle, capture, evidence_locked, pages, scale, steps

# tests/test_bundles.py measures exports with it, imported from here.
from runs.benchmarks.bundle import measured_command as measured_command


class Command(BaseCommand):
    help = (
        "Measures one executor step (boundary + no-op read + receipt) against a single-row "
        "INSERT + COMMIT on the same database; with --capture, the cost of handing a copy "
        "to evidence capture while the database is stalled for it; with --evidence-locked, a "
        "whole run while another session holds every evidence table locked."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--steps", type=int, default=500)
        parser.add_argument("--capture", action="store_true")
        parser.add_argument(
            "--evidence-locked",
            action="store_true",
            help="the same run with no lock, and with every evidence table locked by another "
            "session for the run's whole life (SHARE, ACCESS EXCLUSIVE)",
        )
        parser.add_argument("--rounds", type=int, default=3, help="with --evidence-locked")
        parser.add_argument(
            "--bundle",
            action="store_true",
            help="export time and peak memory of investigation bundles of runs with 10,000 "
            "and 200,000 events, each export in its own process",
        )
        parser.add_argument(
            "--dashboard",
            action="store_true",
            help="server time of the dashboard's pages at 100 and 100,000 runs (own databases)",
        )
        parser.add_argument(
            "--scale",
            action="store_true",
            help="runs/s with 1, 2 and 4 Celery worker processes, 100-run batches (own database "
            "and queue)",
        )
        parser.add_argument(
            "--broker",
            default=scale.FILESYSTEM,
            metavar="URL",
            help="with --scale: the broker (redis://, amqp://); the filesystem broker by default",
        )
        parser.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["steps"] < 1:
            raise CommandError("--steps must be at least 1")
        if options["scale"]:
            try:
                report: Any = scale.report(options["broker"])
            except RuntimeError as error:
                raise CommandError(f"bench --scale: {error}") from error
        elif options["dashboard"]:
            report = {"pages": pages.measure()}
        elif options["bundle"]:
            report = bundle.report([10_000, 200_000])
        elif options["evidence_locked"]:
            if options["rounds"] < 1:
                raise CommandError("--rounds must be at least 1")
            report = evidence_locked.report(options["rounds"])
        elif options["capture"]:
            report = capture.report(options["steps"])
        else:
            report = steps.report(options["steps"])
        if options["json"]:
            self.stdout.write(json.dumps(report))
        else:
            for key, value in report.items():
                self.stdout.write(f"{key}: {value}")

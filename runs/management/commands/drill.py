"""`manage.py drill [--scenario NAME ...] [--json]`: the fault drills of
runs/drills.py, on this installation's database.  Exit 0 only if every
scenario that ran passed."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from runs.drills import SCENARIOS, DrillRunning, describe, report, run_drill, start_drill


class Command(BaseCommand):
    help = (
        "Runs fault drills: each scenario causes one failure on purpose on real runs "
        "(marked as drills) and answers four questions from the data."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--scenario",
            action="append",
            choices=sorted(SCENARIOS),
            help="run only this scenario (repeatable); default: all",
        )
        parser.add_argument("--list", action="store_true", help="list the scenarios and stop")
        parser.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["list"]:
            for name in SCENARIOS:
                self.stdout.write(f"{name}: {describe(name)}")
            return
        try:
            drill = start_drill(options["scenario"] or list(SCENARIOS), "manage.py drill")
        except DrillRunning as running:
            raise CommandError(f"not started: {running}") from None
        drilled = run_drill(drill)
        summary = report(drilled)
        if options["json"]:
            self.stdout.write(json.dumps(summary, indent=2))
        else:
            for line in drilled.leftovers:
                self.stdout.write(f"before the drill: {line}")
            for result in drilled.results:
                self.stdout.write(f"{result.verdict:8} {result.scenario} ({result.seconds} s)")
                if result.verdict != "passed":
                    for line in result.detail.splitlines():
                        self.stdout.write(f"         {line}")
            self.stdout.write(
                f"{summary['passed']} passed, {summary['failed']} failed, "
                f"{summary['not_run']} not run"
            )
        if summary["failed"]:
            raise CommandError(f"{summary['failed']} drill scenario(s) failed", returncode=1)

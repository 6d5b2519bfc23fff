"""`manage.py drill [--scenario NAME ...] [--agent NAME ...] [--json]`: the
fault drills of runs/drills.py, on this installation's database, against
each chosen agent (default: every installed agent that declares a drill
input).  Exit 0 only if every scenario that ran passed."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from runs.drills import (
    SCENARIOS,
    DrillRunning,
    describe,
    report,
    run_drill,
    start_drill,
    undrilled,
)


class Command(BaseCommand):
    help = (
        "Runs fault drills: each scenario causes one failure on purpose on real runs "
        "(marked as drills) of each chosen agent and answers four questions from the data."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--scenario",
            action="append",
            choices=sorted(SCENARIOS),
            help="run only this scenario (repeatable); default: all",
        )
        parser.add_argument(
            "--agent",
            action="append",
            help="run against this installed agent only (repeatable, or a comma list); "
            "default: every installed agent that declares a drill input",
        )
        parser.add_argument("--list", action="store_true", help="list the scenarios and stop")
        parser.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["list"]:
            for name in SCENARIOS:
                self.stdout.write(f"{name}: {describe(name)}")
            return
        agents = [
            name.strip()
            for given in options["agent"] or []
            for name in given.split(",")
            if name.strip()
        ]
        try:
            drill = start_drill(options["scenario"] or list(SCENARIOS), "manage.py drill", agents)
        except DrillRunning as running:
            raise CommandError(f"not started: {running}") from None
        except ValueError as refused:
            raise CommandError(f"not started: {refused}") from None
        drilled = run_drill(drill)
        summary = report(drilled)
        if options["json"]:
            self.stdout.write(json.dumps(summary, indent=2))
        else:
            for line in drilled.leftovers:
                self.stdout.write(f"before the drill: {line}")
            if not agents and (skipped := undrilled()):
                self.stdout.write(f"not drilled (no drill input): {', '.join(skipped)}")
            width = max((len(result.agent) for result in drilled.results), default=0)
            for result in drilled.results:
                self.stdout.write(
                    f"{result.verdict:8} {result.agent:{width}} {result.scenario} "
                    f"({result.seconds} s)"
                )
                if result.verdict != "passed":
                    for line in result.detail.splitlines():
                        self.stdout.write(f"         {line}")
            self.stdout.write(
                f"{summary['passed']} passed, {summary['failed']} failed, "
                f"{summary['not_run']} not run"
            )
        if summary["failed"]:
            raise CommandError(f"{summary['failed']} drill scenario(s) failed", returncode=1)

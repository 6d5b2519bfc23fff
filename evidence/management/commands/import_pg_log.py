from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from evidence import locks, pglog
from evidence.models import IncidentSource


class Command(BaseCommand):
    help = (
        "Finds every 'deadlock detected' report in a PostgreSQL server log (any "
        "log_line_prefix) or in application output quoting one, and stores each as a lock "
        "incident with its processes, wait-for edges and cycle."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("file", help="the log file, or - for standard input")
        parser.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        name = options["file"]
        try:
            raw = sys.stdin.buffer.read() if name == "-" else Path(name).read_bytes()
        except OSError as error:
            raise CommandError(f"cannot read {name}: {error.strerror}") from None
        reports = pglog.parse(raw.decode(errors="replace"))
        incidents = []
        for report in reports:
            cycle = report.graph.cycle()
            incident = locks.store(
                IncidentSource.LOG,
                report.graph,
                summary=f"deadlock of {len(report.graph.processes)} processes from {name}"
                + (f"; reported by {report.reporter}" if report.reporter else ""),
            )
            incidents.append({"id": incident.pk, **report.as_json(), "cycle": cycle})
        if options["json"]:
            self.stdout.write(json.dumps({"incidents": incidents}))
        else:
            self.stdout.write(f"{len(incidents)} deadlock reports imported from {name}")
            for incident in incidents:
                cycle = " -> ".join(str(pid) for pid in incident["cycle"])
                self.stdout.write(f"  incident {incident['id']}: cycle {cycle}")

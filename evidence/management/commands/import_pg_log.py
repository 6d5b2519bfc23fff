from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from evidence import pglog


class Command(BaseCommand):
    help = (
        "Finds every 'deadlock detected' report in a PostgreSQL server log (stderr with any "
        "log_line_prefix, csvlog or jsonlog, gzip-compressed or not; in any language of the "
        "catalogs PostgreSQL 15 installs) or in "
        "application output quoting one, and stores each as a lock incident with its processes, "
        "wait-for edges, cycle and the lock waits logged before it, and what it could not read."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("file", help="the log file, or - for standard input")
        parser.add_argument(
            "--format",
            choices=pglog.FORMATS,
            default="auto",
            help="the log's format (default: as its content says)",
        )
        parser.add_argument(
            "--encoding",
            default="utf-8",
            help="the log's encoding (default utf-8; a server writes its log in its database's "
            "encoding, as SHOW server_encoding names it (LATIN1, WIN1251, EUC_JP) or as Python "
            "does (latin-1, cp1251, euc-jp))",
        )
        parser.add_argument(
            "--log-timezone",
            help="the server's log_timezone (e.g. Asia/Manila), for times written with an "
            "abbreviation that names several zones (CST, IST, PST) or with none",
        )
        parser.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        name = options["file"]
        try:
            raw = sys.stdin.buffer.read() if name == "-" else Path(name).read_bytes()
        except OSError as error:
            raise CommandError(f"cannot read {name}: {error.strerror}") from None
        try:
            zone = pglog.log_timezone(options["log_timezone"] or "")
        except pglog.LogFormatError as error:
            raise CommandError(f"--log-timezone: {error}") from None
        try:
            text, warning = pglog.decode(raw, options["encoding"])
            reports = pglog.parse(text, options["format"], zone)
            imported = pglog.store(reports, name)
        except pglog.LogFormatError as error:
            raise CommandError(f"{name}: {error}; nothing was imported") from None
        if warning:
            self.stderr.write(f"{name}: {warning}")
        incidents = [{"id": incident.pk, **report.as_json()} for report, incident in imported]
        before = len(reports) - len(imported)
        if options["json"]:
            self.stdout.write(json.dumps({"incidents": incidents, "imported_before": before}))
            return
        self.stdout.write(f"{len(incidents)} deadlock reports imported from {name}")
        if before:
            self.stdout.write(f"  {pglog.imported_before(before)}")
        for incident in incidents:
            cycle = incident["cycle"]
            self.stdout.write(
                f"  incident {incident['id']} (line {incident['line']}): "
                + (" -> ".join(str(pid) for pid in [*cycle, cycle[0]]) if cycle else "no cycle")
                + f", {incident['time'] or 'time unknown'}"
                + (
                    f", {len(incident['lead_up'])} lock waits before it"
                    if incident["lead_up"]
                    else ""
                )
            )
            for line in incident["unread"]:
                self.stdout.write(f"    not read: {line}")

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from evidence import bundles
from runs.models import Run


class Command(BaseCommand):
    help = (
        "Writes a run's investigation bundle: one sealed, redacted zip with the run's rows, "
        "a self-contained report.html and a manifest of every file's SHA-256.  Prints the "
        "seal: give it to the recipient through another channel."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("run_id", type=int)
        parser.add_argument("-o", "--output", help="the zip to write (default: run-ID.zip)")
        parser.add_argument(
            "--no-evidence",
            action="store_true",
            help="leave the evidence copies (model inputs and outputs) out",
        )
        parser.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        run_id = options["run_id"]
        if not Run.objects.filter(pk=run_id).exists():
            raise CommandError(f"there is no run {run_id}")
        path = Path(options["output"] or f"run-{run_id}.zip")
        try:
            exported = bundles.export(run_id, path, include_evidence=not options["no_evidence"])
        except OSError as error:
            raise CommandError(f"cannot write {path}: {error.strerror}") from None
        manifest = exported.manifest
        report = {
            "path": str(path),
            "run_id": run_id,
            "seal": exported.seal,
            "rows": exported.rows,
            "bytes": path.stat().st_size,
            "evidence_included": manifest["evidence_included"],
            "redacted": manifest["redacted"],
        }
        if options["json"]:
            self.stdout.write(json.dumps(report))
            return
        redacted = sum(sum(kinds.values()) for kinds in manifest["redacted"].values())
        self.stdout.write(
            f"run {run_id}: {path} ({report['bytes']} bytes, {exported.rows} rows, "
            f"{redacted} secrets redacted)\nseal {exported.seal}"
        )

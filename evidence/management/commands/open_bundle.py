from __future__ import annotations

import json
import sys
from typing import Any

from django.core.management.base import BaseCommand

from evidence.opening import OpenRefused, open_bundle


class Command(BaseCommand):
    help = (
        "Verifies an investigation bundle and opens it in the dashboard as an imported run: "
        "read-only, marked with its origin and seal, never executed or resumed here.  "
        "Opening the same bundle again answers with the run it was opened as.  A bundle that "
        "does not verify is refused (exit 1) and nothing is written; so is one that would "
        "inflate, hold or take more than the limits (RUNDESK_OPEN_BUNDLE_MAX_BYTES, "
        "_MAX_FILE_BYTES, _MAX_ROWS, _SECONDS), named in the refusal."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("path")
        parser.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            opened = open_bundle(options["path"])
        except OpenRefused as refused:
            if options["json"]:
                self.stdout.write(
                    json.dumps(
                        {
                            "run_id": None,
                            "imported": False,
                            "origin": None,
                            "refused": str(refused),
                            "failures": refused.failures,
                        }
                    )
                )
            self.stderr.write(f"refused: {refused}; nothing was written")
            for failure in refused.failures:
                if failure != str(refused):
                    self.stderr.write(f"FAILED {failure}")
            sys.exit(1)
        origin = opened.origin
        if options["json"]:
            self.stdout.write(
                json.dumps(
                    {"run_id": opened.run.pk, "imported": opened.first_time, "origin": origin}
                )
            )
            return
        said = "opened as" if opened.first_time else "already open as"
        self.stdout.write(
            f"{said} run {opened.run.pk}: run {origin['run_id']} of {origin['installation']}, "
            f"exported {origin['exported_at']}; read-only\nseal {origin['seal']}, "
            f"{origin['signed_by']}"
        )

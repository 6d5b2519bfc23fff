from __future__ import annotations

import json
import sys
from typing import Any

from django.core.management.base import BaseCommand

from evidence import bundles


class Command(BaseCommand):
    help = (
        "Checks an investigation bundle: the manifest's seal and every file's size and "
        "SHA-256; names each file that fails.  Exits 0 only if everything matches."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("path")
        parser.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        checked = bundles.verify(options["path"])
        manifest = checked.manifest
        if options["json"]:
            self.stdout.write(
                json.dumps(
                    {
                        "ok": checked.ok,
                        "failures": checked.failures,
                        "run_id": manifest.get("run_id"),
                        "seal": manifest.get("seal"),
                        "installation": manifest.get("installation"),
                        "exported_at": manifest.get("exported_at"),
                    }
                )
            )
        elif checked.ok:
            self.stdout.write(
                f"ok: run {manifest['run_id']} from {manifest['installation']}, exported "
                f"{manifest['exported_at']}, {len(manifest['files'])} files match\n"
                f"seal {manifest['seal']}"
            )
        else:
            for failure in checked.failures:
                self.stderr.write(f"FAILED {failure}")
        if not checked.ok:
            sys.exit(1)

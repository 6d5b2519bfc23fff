from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from evidence import bundles
from runs.durable_files import sync_folder
from runs.models import Run


class Command(BaseCommand):
    help = (
        "Writes a run's investigation bundle: one signed, redacted zip with the run's rows, "
        "a self-contained report.html and a manifest of every file's SHA-256, signed with "
        "this installation's key.  An existing file is left alone unless --force; a bundle "
        "that cannot be written whole leaves no file."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("run_id", type=int)
        parser.add_argument("-o", "--output", help="the zip to write (default: run-ID.zip)")
        parser.add_argument(
            "--no-evidence",
            action="store_true",
            help="leave every copy of the model's inputs and outputs out (copies of model calls, "
            "prompts, model answers, document texts, agent states): each is replaced by its "
            "SHA-256 and size",
        )
        parser.add_argument(
            "--force", action="store_true", help="replace the output file if it exists"
        )
        parser.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        run_id = options["run_id"]
        if not Run.objects.filter(pk=run_id).exists():
            raise CommandError(f"there is no run {run_id}")
        path = Path(options["output"] or f"run-{run_id}.zip")
        if path.exists() and not options["force"]:
            raise CommandError(f"{path} exists: give --force to replace it")
        exported = _write(path, run_id, not options["no_evidence"], options["force"])
        manifest = exported.manifest
        report = {
            "path": str(path),
            "run_id": run_id,
            "seal": exported.seal,
            "signer": exported.signer.as_json(),
            "rows": exported.rows,
            "bytes": path.stat().st_size,
            "evidence_included": manifest["evidence_included"],
            "redacted": manifest["redacted"],
            "left_out": manifest.get("left_out", {}),
        }
        if options["json"]:
            self.stdout.write(json.dumps(report))
            return
        redacted = sum(sum(kinds.values()) for kinds in manifest["redacted"].values())
        self.stdout.write(
            f"run {run_id}: {path} ({report['bytes']} bytes, {exported.rows} rows, "
            f"{redacted} secrets redacted)\n{exported.signer.words}\nseal {exported.seal}"
        )


def _write(path: Path, run_id: int, include_evidence: bool, force: bool) -> bundles.Exported:
    """Exports into a new file beside `path`, then gives it `path`'s name:
    replacing it only with `force` (else refused if it appeared
    meanwhile); whatever fails, the partial file goes."""
    try:
        fd, part = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    except OSError as error:
        raise CommandError(f"cannot write {path}: {error.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as out:
            exported = bundles.export(run_id, out, include_evidence=include_evidence)
            out.flush()
            os.fsync(out.fileno())
        if force:
            os.replace(part, path)
        else:
            os.link(part, path)  # fails if `path` exists: never replaced unasked
            os.unlink(part)
        sync_folder(path.parent)
    except FileExistsError:
        os.unlink(part)
        raise CommandError(f"{path} exists: give --force to replace it") from None
    except OSError as error:
        Path(part).unlink(missing_ok=True)
        raise CommandError(f"cannot write {path}: {error.strerror or error}") from None
    except BaseException:
        Path(part).unlink(missing_ok=True)
        raise
    return exported

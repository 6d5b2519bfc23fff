"""Celery task of the run page's "Export bundle": writes a BundleExport's
investigation bundle (evidence/bundles.py) into RUNDESK_BUNDLE_DIR.

The task takes the export's id and is idempotent: it only ever starts a
queued export (a conditional UPDATE), so a redelivered task for an export
that is running or done does nothing.  The file is written under a
temporary name and renamed when whole.  Beat's `sweep_bundles` (and each
run of the export task) removes the files of expired bundles, and fails
running exports whose worker was lost (their redelivered task leaves them
alone) and queued ones whose task was lost (no worker will take them).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import time
from dataclasses import dataclass

from celery import shared_task
from django.utils import timezone

from evidence import bundles
from evidence.models import BundleExport
from runs.durable_files import sync_folder

logger = logging.getLogger(__name__)

# Progress is written at most this often: one UPDATE per interval however
# many rows go by (the exporter reports every couple of thousand rows).
PROGRESS_SECONDS = 0.5


class Abandoned(Exception):
    """The export stopped being running under its writer (failed as
    stalled): the writer stops and removes its partial file."""


@dataclass
class Progress:
    """The exporter's progress callback: rows written / total into the
    export's row, throttled.  The first report is written at once (it
    carries the total), then at most every PROGRESS_SECONDS, and the one
    that reaches the total (the report is drawn after it)."""

    export: BundleExport
    last: float | None = None
    all_written: bool = False

    def __call__(self, written: int, total: int) -> None:
        now = time.monotonic()
        recent = self.last is not None and now - self.last < PROGRESS_SECONDS
        if recent and (self.all_written or written < total):
            return
        self.last, self.all_written = now, written >= total
        if not self.export.record_progress(written, total, timezone.now()):
            raise Abandoned(f"bundle {self.export.pk} is no longer running")


@shared_task(acks_late=True, reject_on_worker_lost=True)
def export_bundle(export_id: int) -> str:
    """Writes export `export_id`'s bundle; what happened, in a word."""
    now = timezone.now()
    remove_expired(now)
    export = BundleExport.objects.filter(pk=export_id).first()
    if export is None:
        return "missing"
    if not export.start(now):
        return f"already_{export.state}"  # redelivered, or taken by another worker
    return write(export)


def write(export: BundleExport) -> str:
    """Exports a started (running) export's bundle; "done", "failed" or
    "abandoned"."""
    part = export.part_path
    try:
        # Not for every account on the host: a bundle is redacted, but it is
        # still a run's whole story.  The service's group may read it (web
        # processes that serve it may run under another user of the group).
        part.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        with open(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640), "wb") as out:
            exported = bundles.export(
                export.run_id,
                out,
                include_evidence=export.include_evidence,
                progress=Progress(export),
            )
            out.flush()
            os.fsync(out.fileno())
        size = part.stat().st_size
        os.replace(part, export.path)
        sync_folder(part.parent)  # the bundle's folder
    except Abandoned:
        part.unlink(missing_ok=True)
        return "abandoned"
    except Exception as error:
        logger.exception("bundle %s of run %s failed", export.pk, export.run_id)
        part.unlink(missing_ok=True)
        export.fail(f"{type(error).__name__}: {error}", timezone.now())
        return "failed"
    if not export.finish(rows=exported.rows, size=size, seal=exported.seal, now=timezone.now()):
        # Failed as stalled meanwhile: the row says failed, so no file.
        export.path.unlink(missing_ok=True)
        return "abandoned"
    logger.info(
        "bundle %s of run %s: %s bytes, seal %s", export.pk, export.run_id, size, export.seal
    )
    return "done"


@shared_task
def sweep_bundles() -> int:
    """Beat's bundle sweep (CELERY_BEAT_SCHEDULE): expired files go on
    time, and lost exports are failed, even when no export is asked for."""
    return remove_expired(timezone.now())


def remove_expired(now: dt.datetime) -> int:
    """Removes expired bundles' files (and marks them expired), fails
    running exports that stopped moving and queued ones no worker took;
    how many exports it changed."""
    changed = 0
    for export in BundleExport.objects.expired(now).only("pk", "file_name", "state"):
        changed += export.expire()
    for export in BundleExport.objects.stalled(now).only("pk", "file_name", "state"):
        if export.fail_stalled(now):
            export.part_path.unlink(missing_ok=True)
            changed += 1
    for export in BundleExport.objects.unclaimed(now).only("pk", "state"):
        changed += export.fail_unclaimed(now)
    return changed

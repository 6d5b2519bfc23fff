"""Research evidence: the sources a run read, the model calls it made, the
bounded copies of those calls (optional: capture, evidence/capture.py) and
the honest gaps where a copy could not be made; and the lock waits seen
among Rundesk's connections (evidence/locks.py, evidence/pglog.py); and
the investigation bundles operators export from the run page
(evidence/bundles.py, evidence/tasks.py)."""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path

from django.conf import settings
from django.db import models
from django.db.models import Exists, OuterRef, Q
from django.db.models.functions import Now
from django.utils import timezone

from runs.models import Action, Run


class Source(models.Model):
    """A document a run read, as it was when read."""

    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="sources")
    path = models.CharField(max_length=500)
    read_action = models.ForeignKey(Action, on_delete=models.PROTECT, related_name="+")
    digest = models.CharField(max_length=64)
    bytes = models.PositiveIntegerField()
    created_at = models.DateTimeField(db_default=Now())
    # Set by a refresh (evidence/sources.py): the file no longer matches.
    checked_at = models.DateTimeField(null=True, blank=True)
    changed = models.BooleanField(default=False)

    class Meta:
        ordering = ["run", "id"]
        constraints = [
            models.UniqueConstraint(fields=["run", "path"], name="source_once_per_run"),
        ]

    def __str__(self) -> str:
        return f"run {self.run_id} source {self.path}"


class ModelCall(models.Model):
    """The model record: one per model-call action.  The revisions that used
    it name its action (AnswerRevision.model_call_actions)."""

    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="model_calls")
    action = models.OneToOneField(Action, on_delete=models.PROTECT, related_name="model_call")
    provider = models.CharField(max_length=40)
    input_digest = models.CharField(max_length=64)
    output_digest = models.CharField(max_length=64)
    sources = models.ManyToManyField(Source, related_name="model_calls", blank=True)
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["run", "id"]

    def __str__(self) -> str:
        return f"run {self.run_id} model call {self.action_id}"


class EvidenceCopy(models.Model):
    """A bounded copy of a model call's inputs and observable output."""

    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="evidence_copies")
    model_call = models.ForeignKey(ModelCall, on_delete=models.PROTECT, related_name="copies")
    sources = models.ManyToManyField(Source, related_name="copies", blank=True)
    input = models.TextField()
    output = models.TextField()
    input_bytes = models.PositiveIntegerField(help_text="Size before any truncation")
    output_bytes = models.PositiveIntegerField(help_text="Size before any truncation")
    truncated = models.BooleanField(default=False)
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["run", "id"]

    def __str__(self) -> str:
        return f"copy of model call {self.model_call_id}"


class GapReason(models.TextChoices):
    QUEUE_FULL = "queue_full"
    LOCK_NOT_AVAILABLE = "lock_not_available"
    TOO_LARGE = "too_large"
    DB_ERROR = "db_error"
    SHUTDOWN = "shutdown"


class CaptureGap(models.Model):
    """A copy that was not made, and why.  Never reported as a save."""

    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="capture_gaps")
    model_call = models.ForeignKey(
        ModelCall, on_delete=models.PROTECT, related_name="gaps", null=True, blank=True
    )
    reason = models.CharField(max_length=30, choices=GapReason)
    detail = models.TextField(blank=True)
    count = models.PositiveIntegerField(default=1, help_text="Copies this row stands for")
    created_at = models.DateTimeField(db_default=Now())
    # A record that could not take its lock is tried again later by the
    # capture writer (evidence/retries.py): its gap is found by this key,
    # this installation's own (a bundle leaves it out).
    retry_key = models.UUIDField(null=True, blank=True)
    attempts = models.PositiveIntegerField(db_default=0, help_text="Tries again after the gap")
    # Set when a try again saved what this gap stood for: no longer missing.
    saved_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            # Serves the gaps page's latest gaps (a batch of gaps shares its time).
            models.Index(fields=["-created_at", "-id"], name="gap_time_idx"),
            # Serves capture's retry finding its gap (evidence/capture.py mark_saved).
            models.Index(
                fields=["retry_key"], name="gap_retry_idx", condition=Q(retry_key__isnull=False)
            ),
        ]

    def __str__(self) -> str:
        return f"run {self.run_id} gap ({self.reason})"

    @property
    def saved_later(self) -> str:
        """What the pages say of a gap a try again saved; "" otherwise."""
        if self.saved_at is None:
            return ""
        tries = f"{self.attempts} {'try' if self.attempts == 1 else 'tries'}"
        return f"saved later (at {timezone.localtime(self.saved_at):%H:%M:%S}, after {tries})"


class CaptureGapHour(models.Model):
    """Lost copies per hour and reason, kept with the gaps: the gaps page
    reads these, so its cost does not grow with the gap table."""

    hour = models.DateTimeField()
    reason = models.CharField(max_length=30, choices=GapReason)
    count = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["hour", "reason"], name="gap_hour_reason_unique")
        ]

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H}h {self.reason}: {self.count}"


class CaptureStats(models.Model):
    """Captured and lost copies of a run, kept by the capture writer."""

    run = models.OneToOneField(
        Run, on_delete=models.CASCADE, primary_key=True, related_name="capture_stats"
    )
    captured = models.PositiveIntegerField(default=0)
    lost = models.PositiveIntegerField(default=0)

    class Meta:
        # Serves the gaps page's runs that lost the most copies.
        indexes = [models.Index(fields=["-lost"], name="stats_lost_idx", condition=Q(lost__gt=0))]

    def __str__(self) -> str:
        return f"run {self.run_id}: {self.captured} captured, {self.lost} lost"


class IncidentSource(models.TextChoices):
    SAMPLER = "sampler"
    REPRODUCTION = "reproduction"
    LOG = "log"


class LockIncidentQuerySet(models.QuerySet["LockIncident"]):
    def local(self) -> LockIncidentQuerySet:
        """Incidents of this installation's server: sampled, reproduced or
        read from its logs here."""
        return self.filter(imported_run__isnull=True)

    def imported(self) -> LockIncidentQuerySet:
        """Incidents opened with an imported run's bundle (evidence/opening.py)."""
        return self.filter(imported_run__isnull=False)


class LockIncident(models.Model):
    """Lock waits that belong together: seen by the sampler in consecutive
    samples, arranged by `reproduce_contention`, or one "deadlock detected"
    report of a server log (evidence/pglog.py); or another installation's
    incident, opened with the bundle of one of its runs (`imported_run`)."""

    source = models.CharField(max_length=20, choices=IncidentSource)
    # For an imported report, the time its log gives; a log that gives none
    # leaves the import's time here, with time_known false: pages say
    # "time unknown", never that time.
    started_at = models.DateTimeField(db_default=Now())
    time_known = models.BooleanField(db_default=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    processes = models.PositiveIntegerField(default=0)
    has_cycle = models.BooleanField(default=False)
    cycle = models.JSONField(default=list, blank=True, help_text="pids, in wait-for order")
    summary = models.TextField(blank=True)
    unread = models.JSONField(
        db_default=[], blank=True, help_text="What an imported report had that could not be read"
    )
    # An imported report's digest (pglog.Report.digest): a log imported
    # again, or one that overlaps it, stores none of its reports twice.
    report_digest = models.CharField(max_length=64, blank=True, db_default="")
    # The process PostgreSQL ended to break a deadlock: the one whose log
    # line carries the report (its ERROR "deadlock detected"), of an imported
    # report that names it.  A sampled incident knows none.
    victim_pid = models.IntegerField(null=True, blank=True)
    # Set: another installation's incident, opened with this imported run's
    # bundle.  Its pids, queries and times are that server's; only the run's
    # own side of each wait is known here.
    imported_run = models.ForeignKey(
        Run,
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="imported_lock_incidents",
    )

    objects = LockIncidentQuerySet.as_manager()

    class Meta:
        ordering = ["-started_at", "-id"]
        indexes = [models.Index(fields=["started_at"], name="incident_time_idx")]
        constraints = [
            models.UniqueConstraint(
                fields=["report_digest"],
                condition=~Q(report_digest=""),
                name="incident_report_once",
                violation_error_message="this report was imported before",
            ),
            # The digest is how a log import here knows a report it stored
            # before: a bundle's incident never stops the real report of
            # this server's log from being stored.
            models.CheckConstraint(
                condition=Q(imported_run__isnull=True) | Q(report_digest=""),
                name="incident_imported_not_a_log_import",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.source} incident {self.pk}"

    @property
    def is_imported(self) -> bool:
        return self.imported_run_id is not None


class LockWait(models.Model):
    """One wait-for edge: `waiter` waits for a lock `blocker` holds.  An
    imported report's lead-up waits are the waits the server logged before
    it (log_lock_waits: "still waiting"), not edges of its graph."""

    incident = models.ForeignKey(LockIncident, on_delete=models.CASCADE, related_name="waits")
    waiter_pid = models.IntegerField()
    waiter_role = models.CharField(max_length=100, blank=True)
    waiter_run = models.ForeignKey(
        Run, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    waiter_query = models.TextField(blank=True)
    blocker_pid = models.IntegerField()
    blocker_role = models.CharField(max_length=100, blank=True)
    blocker_run = models.ForeignKey(
        Run, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    blocker_query = models.TextField(blank=True)
    lock_type = models.CharField(max_length=40, blank=True)
    mode = models.CharField(max_length=40, blank=True)
    locked = models.CharField(max_length=300, blank=True, help_text="What is locked")
    first_seen = models.DateTimeField(db_default=Now())
    last_seen = models.DateTimeField(db_default=Now())
    waited_ms = models.PositiveIntegerField(default=0)
    lead_up = models.BooleanField(db_default=False)

    class Meta:
        ordering = ["incident", "id"]
        constraints = [
            models.CheckConstraint(
                condition=~Q(waiter_pid=models.F("blocker_pid")), name="wait_not_self"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.waiter_pid} waits for {self.blocker_pid}"


class BundleState(models.TextChoices):
    QUEUED = "queued", "waiting for a worker"
    RUNNING = "running", "exporting"
    DONE = "done", "ready"
    FAILED = "failed", "failed"
    # Done once; its file was removed when it expired.
    EXPIRED = "expired", "expired, file removed"


ACTIVE_BUNDLE_STATES = [BundleState.QUEUED, BundleState.RUNNING]
# A running export that has not moved for this long lost its worker (a
# redelivered task leaves a running export alone): it is marked failed.
BUNDLE_STALLED_AFTER = dt.timedelta(minutes=15)
# A queued export no worker took for this long lost its task (the broker
# lost it, or it was never delivered): it is marked failed, and a new
# export can be asked for.  Workers take one task at a time, so a busy
# queue delays an export by its runs: an hour is well past that.
BUNDLE_UNCLAIMED_AFTER = dt.timedelta(hours=1)
# A failed export stays on the "Needs you" page this long, unless a later
# export of its run was asked for (someone acted on it).
BUNDLE_FAILURE_SHOWN = dt.timedelta(hours=24)


def bundle_file_name() -> str:
    # Not guessable from the run id: the directory may be shared.
    return f"{uuid.uuid4()}.zip"


class BundleExportQuerySet(models.QuerySet["BundleExport"]):
    def for_run(self, run: Run) -> BundleExportQuerySet:
        """The run's exports, latest first (bundle_run_latest_idx)."""
        return self.filter(run=run).order_by("-created_at", "-id")

    def active(self) -> BundleExportQuerySet:
        return self.filter(state__in=ACTIVE_BUNDLE_STATES)

    def expired(self, now: dt.datetime) -> BundleExportQuerySet:
        """Done exports whose file is no longer offered (bundle_expiry_idx)."""
        return self.filter(state=BundleState.DONE, expires_at__lte=now)

    def stalled(self, now: dt.datetime) -> BundleExportQuerySet:
        """Running exports no worker has moved for BUNDLE_STALLED_AFTER
        (bundle_running_idx)."""
        return self.filter(state=BundleState.RUNNING, progressed_at__lt=now - BUNDLE_STALLED_AFTER)

    def failing(self, now: dt.datetime) -> BundleExportQuerySet:
        """Exports that failed within BUNDLE_FAILURE_SHOWN, or that no
        worker moves (stalled or unclaimed: the sweep fails them soon), and
        whose run has no later export: nobody has asked again yet.  Oldest
        first."""
        broken = (
            Q(state=BundleState.FAILED, finished_at__gte=now - BUNDLE_FAILURE_SHOWN)
            | Q(state=BundleState.RUNNING, progressed_at__lt=now - BUNDLE_STALLED_AFTER)
            | Q(state=BundleState.QUEUED, created_at__lt=now - BUNDLE_UNCLAIMED_AFTER)
        )
        later = BundleExport.objects.filter(
            run=OuterRef("run"), created_at__gt=OuterRef("created_at")
        )
        return self.filter(broken).exclude(Exists(later)).order_by("created_at", "id")

    def unclaimed(self, now: dt.datetime) -> BundleExportQuerySet:
        """Queued exports no worker took for BUNDLE_UNCLAIMED_AFTER: their
        task was lost.  (Few rows are queued; the table is small.)"""
        return self.filter(state=BundleState.QUEUED, created_at__lt=now - BUNDLE_UNCLAIMED_AFTER)


class BundleExport(models.Model):
    """An investigation bundle an operator asked for on the run page: a
    Celery task writes it (evidence/tasks.py) into RUNDESK_BUNDLE_DIR, where
    it is kept RUNDESK_BUNDLE_KEEP_HOURS.

    Every change of state is a conditional UPDATE on the state it expects,
    its row count checked: a redelivered task, a second worker, or the
    sweep that fails a stalled export never overwrite one another."""

    run = models.ForeignKey(
        # bundle_run_latest_idx leads with run: no index of its own.
        Run,
        on_delete=models.CASCADE,
        related_name="bundle_exports",
        db_index=False,
    )
    requested_by = models.CharField(max_length=150)
    include_evidence = models.BooleanField(default=True)
    state = models.CharField(max_length=20, choices=BundleState, default=BundleState.QUEUED)
    rows_written = models.PositiveBigIntegerField(default=0)
    rows_total = models.PositiveBigIntegerField(default=0, help_text="0 until counted")
    file_name = models.CharField(max_length=100, default=bundle_file_name, editable=False)
    bytes = models.PositiveBigIntegerField(null=True, blank=True)
    seal = models.CharField(max_length=64, blank=True)
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(db_default=Now())
    started_at = models.DateTimeField(null=True, blank=True)
    progressed_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)

    objects = BundleExportQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(state__in=BundleState.values), name="bundle_state_valid"
            ),
            models.UniqueConstraint(fields=["file_name"], name="bundle_file_name_unique"),
            # Done means a sealed file that is offered until a known time.
            models.CheckConstraint(
                condition=~Q(state=BundleState.DONE)
                | Q(
                    bytes__isnull=False,
                    seal__regex=r"^[0-9a-f]{64}$",
                    finished_at__isnull=False,
                    expires_at__isnull=False,
                ),
                name="bundle_done_is_sealed",
            ),
            models.CheckConstraint(
                condition=~Q(state=BundleState.FAILED) | ~Q(error=""),
                name="bundle_failure_says_why",
            ),
        ]
        indexes = [
            # Serves the run page's latest exports (BundleExport.objects.for_run).
            models.Index(fields=["run", "-created_at", "-id"], name="bundle_run_latest_idx"),
            # Serves the removal of expired files (BundleExport.objects.expired).
            models.Index(
                fields=["expires_at"], name="bundle_expiry_idx", condition=Q(state="done")
            ),
            # Serves the search for stalled exports (BundleExport.objects.stalled).
            models.Index(
                fields=["progressed_at"], name="bundle_running_idx", condition=Q(state="running")
            ),
        ]

    def __str__(self) -> str:
        return f"bundle {self.pk} of run {self.run_id} ({self.state})"

    @property
    def path(self) -> Path:
        return Path(settings.RUNDESK_BUNDLE_DIR) / self.file_name

    @property
    def part_path(self) -> Path:
        """Where the file is written; renamed to `path` once complete, so a
        file under its final name is always a whole bundle."""
        return self.path.with_name(f".{self.file_name}.part")

    @property
    def is_active(self) -> bool:
        return self.state in ACTIVE_BUNDLE_STATES

    @property
    def download_name(self) -> str:
        return f"rundesk-run-{self.run_id}.zip"

    def is_lost(self, now: dt.datetime) -> bool:
        """Active, but no worker has moved it for long: its task or its
        worker was lost (the sweep marks it failed; until then, nothing
        waits for it)."""
        if self.state == BundleState.QUEUED:
            return self.created_at < now - BUNDLE_UNCLAIMED_AFTER
        if self.state == BundleState.RUNNING:
            moved = self.progressed_at or self.started_at
            return moved is not None and moved < now - BUNDLE_STALLED_AFTER
        return False

    def is_downloadable(self, now: dt.datetime) -> bool:
        return (
            self.state == BundleState.DONE and self.expires_at is not None and now < self.expires_at
        )

    def _move(self, expected: list[str], *, where: Q | None = None, **changes: object) -> bool:
        """Applies `changes` if the row is still in one of the `expected`
        states (and matches `where`); False (nothing changed) otherwise."""
        rows = BundleExport.objects.filter(where or Q(), pk=self.pk, state__in=expected)
        moved = rows.update(**changes)
        if moved:
            for name, value in changes.items():
                setattr(self, name, value)
        return moved == 1

    def start(self, now: dt.datetime) -> bool:
        """Takes a queued export; False for any other (a redelivered task)."""
        return self._move(
            [BundleState.QUEUED], state=BundleState.RUNNING, started_at=now, progressed_at=now
        )

    def record_progress(self, written: int, total: int, now: dt.datetime) -> bool:
        """False when the export is no longer running (failed as stalled):
        its writer stops."""
        return self._move(
            [BundleState.RUNNING], rows_written=written, rows_total=total, progressed_at=now
        )

    def finish(self, *, rows: int, size: int, seal: str, now: dt.datetime) -> bool:
        keep = dt.timedelta(hours=settings.RUNDESK_BUNDLE_KEEP_HOURS)
        return self._move(
            [BundleState.RUNNING],
            state=BundleState.DONE,
            rows_written=rows,
            rows_total=rows,
            bytes=size,
            seal=seal,
            progressed_at=now,
            finished_at=now,
            expires_at=now + keep,
        )

    def fail(self, error: str, now: dt.datetime) -> bool:
        return self._move(
            ACTIVE_BUNDLE_STATES,
            state=BundleState.FAILED,
            error=error or "failed",
            finished_at=now,
        )

    def fail_stalled(self, now: dt.datetime) -> bool:
        """Fails the export if it is still running and still has not moved
        (its writer may have reported progress since it was found)."""
        return self._move(
            [BundleState.RUNNING],
            where=Q(progressed_at__lt=now - BUNDLE_STALLED_AFTER),
            state=BundleState.FAILED,
            error="its worker stopped before the bundle was written",
            finished_at=now,
        )

    def fail_unclaimed(self, now: dt.datetime) -> bool:
        """Fails the export if it is still queued and was asked for longer
        than BUNDLE_UNCLAIMED_AFTER ago (a worker may have taken it since
        it was found)."""
        return self._move(
            [BundleState.QUEUED],
            where=Q(created_at__lt=now - BUNDLE_UNCLAIMED_AFTER),
            state=BundleState.FAILED,
            error="no worker took it: its task was lost; export again",
            finished_at=now,
        )

    def expire(self) -> bool:
        """Removes the file of an expired export, then says so.  The file
        goes first: a crash between the two leaves a row the next sweep
        finishes, never a file nobody will remove."""
        self.path.unlink(missing_ok=True)
        return self._move([BundleState.DONE], state=BundleState.EXPIRED)

"""Research evidence: the sources a run read, the model calls it made, the
bounded copies of those calls (optional: capture, evidence/capture.py) and
the honest gaps where a copy could not be made; and the lock waits seen
among Rundesk's connections (evidence/locks.py, evidence/pglog.py)."""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

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

    class Meta:
        ordering = ["-created_at", "-id"]
        # Serves the gaps page's latest gaps (a batch of gaps shares its time).
        indexes = [models.Index(fields=["-created_at", "-id"], name="gap_time_idx")]

    def __str__(self) -> str:
        return f"run {self.run_id} gap ({self.reason})"


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

    run = models.OneToOneField(Run, on_delete=models.CASCADE, primary_key=True, related_name="+")
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


class LockIncident(models.Model):
    """Lock waits that belong together: seen by the sampler in consecutive
    samples, arranged by `reproduce_contention`, or one "deadlock detected"
    report of a server log."""

    source = models.CharField(max_length=20, choices=IncidentSource)
    started_at = models.DateTimeField(db_default=Now())
    ended_at = models.DateTimeField(null=True, blank=True)
    processes = models.PositiveIntegerField(default=0)
    has_cycle = models.BooleanField(default=False)
    cycle = models.JSONField(default=list, blank=True, help_text="pids, in wait-for order")
    summary = models.TextField(blank=True)

    class Meta:
        ordering = ["-started_at", "-id"]
        indexes = [models.Index(fields=["started_at"], name="incident_time_idx")]

    def __str__(self) -> str:
        return f"{self.source} incident {self.pk}"


class LockWait(models.Model):
    """One wait-for edge: `waiter` waits for a lock `blocker` holds."""

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

    class Meta:
        ordering = ["incident", "id"]
        constraints = [
            models.CheckConstraint(
                condition=~Q(waiter_pid=models.F("blocker_pid")), name="wait_not_self"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.waiter_pid} waits for {self.blocker_pid}"

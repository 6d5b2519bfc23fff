"""Runs, actions, receipts, answer revisions, checkpoints, unknown outcomes
and the run timeline.

The rules a run lives by (docs/DESIGN.md) are enforced here by the database
itself where it can: identities are unique, receipts and answer revisions
cannot be changed once written (a trigger, see migration 0002), a running
run always has an owner.  Writes that must check the lease live in
runs/leases.py, because they check it in the same SQL statement.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
import os
import re
import socket
from typing import Any

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.db import models, transaction
from django.db.models import (
    Count,
    Exists,
    ExpressionWrapper,
    F,
    Func,
    OuterRef,
    Q,
    Subquery,
    Value,
)
from django.db.models.functions import Cast, Coalesce, Concat, Now

from runs import lifecycle
from runs.finding import finding_indexes
from runs.lifecycle import ACTIVE_STATUSES, TERMINAL_STATUSES, RunStatus
from runs.timeline import EventKind

# One encoder for every canonical text (json.dumps with options makes one
# per call: half of its time for a step's small values).
_CANONICAL = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)


def canonical_json(value: Any) -> str:
    """A JSON value in canonical form (sorted keys, no spaces): the text
    `digest` hashes.  The hot path sends the same text as the jsonb value,
    so each value is serialised once.  What is no JSON (NaN, an object
    JSON cannot encode, keys that cannot be sorted) raises ValueError or
    TypeError."""
    return _CANONICAL.encode(value)


def digest(value: Any) -> str:
    """SHA-256 of a JSON value in canonical form."""
    return text_digest(canonical_json(value))


def text_digest(canonical: str) -> str:
    return hashlib.sha256(canonical.encode()).hexdigest()


def action_identity(run_id: int, step_key: str) -> str:
    """An action's identity outside the database: how the tool journal and
    operators name it.  Unique in this database only (run ids repeat across
    installations and after a restore): never a receiver's key."""
    return f"rundesk:run-{run_id}:{step_key}"


def new_idempotency_key() -> str:
    """The key an action is sent under (Idempotency-Key, the outbox's file
    name): this installation's name and a random value, so that no action of
    another installation, or of this one's database made anew or restored,
    is ever sent under it.  A receiver that keeps keys can then never answer
    one report with another's cached success.  Drawn once, with the boundary
    (Action.idempotency_key); a resend reads it back."""
    return f"rundesk:{_key_name(settings.RUNDESK_INSTALLATION)}:{os.urandom(16).hex()}"


@functools.cache
def _key_name(installation: str) -> str:
    """The installation's name as keys carry it: letters, digits, dots and
    dashes only, as the key goes into an HTTP header and a file name as it
    is.  Worked out once (every step draws a key)."""
    named = installation or socket.gethostname()
    return re.sub(r"[^A-Za-z0-9.-]+", "-", named).strip("-")[:63] or "rundesk"


# A run's statuses (RunStatus, TERMINAL_STATUSES, ACTIVE_STATUSES) and the
# transitions between them have their own home: runs/lifecycle.py.


class Phase(models.TextChoices):
    RESEARCH = "research"
    FINALIZING = "finalizing"  # only answers: no new tool reads
    DONE = "done"


def page_cursor(row: models.Model) -> str:
    """Where a page newest first (by created_at, id) stops: the next page
    starts after this row."""
    return f"{row.created_at.isoformat()}|{row.pk}"  # type: ignore[attr-defined]


def read_cursor(cursor: str) -> tuple[dt.datetime, int]:
    """The instant and id a page_cursor names, the instant in UTC (Python
    reads offsets PostgreSQL refuses, up to 23:59); ValueError when it is
    not a page cursor."""
    created, _, pk = cursor.rpartition("|")
    try:
        moment = dt.datetime.fromisoformat(created)
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=dt.UTC)
        return moment.astimezone(dt.UTC), int(pk)
    except (ValueError, OverflowError):
        raise ValueError(f"not a page cursor: {cursor!r}") from None


def older_than(queryset: models.QuerySet, cursor: str) -> models.QuerySet:
    """The rows after `cursor` (page_cursor) in (-created_at, -id) order;
    ValueError when it is not one.  The first filter is the index condition;
    the second only sorts out the rows of the cursor's own instant."""
    created_at, row_id = read_cursor(cursor)
    return queryset.filter(created_at__lte=created_at).filter(
        Q(created_at__lt=created_at) | Q(id__lt=row_id)
    )


def _count_per_run(rows: models.QuerySet) -> Coalesce:
    """How many of `rows` belong to the outer query's run, as a correlated
    subquery (worked out for the rows of a page only)."""
    per_run = rows.filter(run=OuterRef("pk")).values("run").annotate(n=Count("*")).values("n")
    return Coalesce(Subquery(per_run), 0)


def reads_left_out() -> models.QuerySet[Action]:
    """Read actions (effect class read: a document, a model's summary, any
    agent's) whose work a run's answer goes without: refused (the tool
    answered, and its receipt holds why not) or failed (known not to have
    happened).  What words.left_out names, one by one."""
    return Action.objects.filter(effect_class=EffectClass.READ).filter(
        Q(state=ActionState.FAILED) | Q(receipt__result__has_key="refused")
    )


def _completed_with_gaps() -> Q:
    """A completed run whose answer leaves work out: a read of it refused
    or failed (reads_left_out), or research ended early, by its budget or
    deadline (phase_reason: only they move a run to finalizing, and they
    do it before a read not yet dispatched).  Derived from the run's own
    rows, for any agent: its status stays completed.  An EXISTS worked out
    for the rows of a page only, as listing's counts."""
    return Q(status=RunStatus.COMPLETED) & (
        Q(Exists(reads_left_out().filter(run=OuterRef("pk")))) | ~Q(phase_reason="")
    )


# The runs list's search, labels and sorts (runs/finding.py), each index
# named for the query it serves there.
FINDING_INDEXES = finding_indexes()

# What no PostgreSQL text can hold: NUL, and lone surrogates (UTF-8 cannot
# encode them).
UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


class RunQuerySet(models.QuerySet["Run"]):
    def local(self) -> RunQuerySet:
        """Runs of this installation: not imported from a bundle.  Every
        query that picks runs to claim, requeue, resume, settle or end
        starts here: an imported run keeps the status it had where it ran
        (running, waiting for an operator...) but nothing here executes it."""
        return self.filter(imported_at__isnull=True)

    def imported(self) -> RunQuerySet:
        """Runs opened from an investigation bundle (evidence/opening.py)."""
        return self.filter(imported_at__isnull=False)

    def listing(self) -> RunQuerySet:
        """The runs list's columns.  Correlated subqueries: PostgreSQL works
        them out for the rows of the page only, whatever the table's size;
        the capture counters are joined by primary key."""
        return self.annotate(
            actions_done=_count_per_run(Action.objects.filter(state=ActionState.COMPLETED)),
            unknown_open=_count_per_run(OutcomeItem.objects.filter(state=OutcomeState.OPEN)),
            gaps=Coalesce(F("capture_stats__lost"), 0),
            with_gaps=ExpressionWrapper(_completed_with_gaps(), models.BooleanField()),
        )

    def completed_with_gaps(self) -> RunQuerySet:
        """Completed runs whose answer leaves work out (_completed_with_gaps):
        the runs list's "completed with gaps"."""
        return self.filter(_completed_with_gaps())

    def with_open_unknowns(self) -> RunQuerySet:
        return self.filter(
            Exists(OutcomeItem.objects.filter(run=OuterRef("pk"), state=OutcomeState.OPEN))
        )

    def with_capture_gaps(self) -> RunQuerySet:
        return self.filter(capture_stats__lost__gt=0)

    def purgeable(self, older_than: dt.timedelta, statuses: list[str] | None = None) -> RunQuerySet:
        """Runs retention may remove (runs/retention.py): of this
        installation (an imported run was opened on purpose: an operator
        removes it), ended (TERMINAL_STATUSES, or those of them in
        `statuses`) longer than `older_than` ago (run_finished_idx), with no
        open item (an operator may still decide it) and no bundle export
        under way (it reads the run).  A run queued, running or waiting for
        an operator has not ended: never."""
        ended = [s for s in TERMINAL_STATUSES if statuses is None or s in statuses]
        return (
            self.local()
            .filter(status__in=ended, finished_at__lt=Now() - older_than)
            .exclude(
                Exists(OutcomeItem.objects.filter(run=OuterRef("pk"), state=OutcomeState.OPEN))
            )
            # evidence.models.ACTIVE_BUNDLE_STATES (evidence sits above this module).
            .exclude(bundle_exports__state__in=["queued", "running"])
        )

    def claimable(self) -> RunQuerySet:
        """Queued runs, and running runs whose owner stopped renewing its lease
        (a cancel asked of one of these is carried out by whoever claims it:
        executor.drive ends it before anything else).  What a claim takes
        (lifecycle.CLAIMABLE, of this process's kind of runs)."""
        return self.local().filter(
            Q(status=RunStatus.QUEUED) | Q(status=RunStatus.RUNNING, lease_expires_at__lt=Now())
        )

    def abandoned(self) -> RunQuerySet:
        """Running runs whose owner stopped renewing its lease: what the
        sweep requeues or ends (lifecycle.ABANDONED)."""
        return self.local().filter(status=RunStatus.RUNNING, lease_expires_at__lt=Now())

    def waiting_unheld(self) -> RunQuerySet:
        """Runs of this installation that wait for an operator and that no
        open item holds (HOLDING_KINDS; an unknown checkpoint's item holds
        nothing): only a decision on the run itself lets them go on."""
        return (
            self.local()
            .filter(status=RunStatus.NEEDS_OPERATOR)
            .exclude(Exists(OutcomeItem.objects.holding_runs().filter(run=OuterRef("pk"))))
            .exclude(Exists(HoldWait.objects.filter(run=OuterRef("pk"), until__isnull=True)))
        )

    def resume_if_settled(self, run_id: int, why: str) -> bool:
        """Puts a run that waits for an operator back in the queue when none
        of its outcome items holds it any more (HOLDING_KINDS): it continues
        from its receipts (lifecycle.RESUME).  Called in the transaction that
        settles an item or decides for the run, after locking the run row
        (locked), so two items settled at once cannot both leave the run
        waiting."""
        return lifecycle.resume(run_id, why, HOLDING_KINDS)

    def locked(self, run_id: int) -> Run | None:
        """Locks a run of this installation, whatever its status, and reads
        it again under the lock (None: no such run here).  The first lock
        of every transaction that settles an item or decides for a run
        (runs/decisions.py): the run row, then its items.  The owner's wait
        (decisions.resume_if_settled_meanwhile) takes them in the same order:
        locking the item first, a decision that then finds the run waiting
        would deadlock with it.  A running run's fenced writes wait for the
        few statements of a decision at most."""
        return self.local().filter(pk=run_id).select_for_update(no_key=True).first()

    def claim_retry(self, run_id: int, seen_expiry: str | None) -> tuple[float, str | None] | None:
        """A run that could not be claimed: when to try again (seconds, and
        the lease expiry seen now), or None when nothing will come of it.
        Finished or waiting for an operator: never.  Claimable but locked
        this instant (another claim): in a second.  Owned with a lease still
        valid: once it expires, unless the owner renewed it since the last
        look (`seen_expiry`), which says it is alive.  Imported: never."""
        row = (
            self.local()
            .filter(pk=run_id)
            .annotate(now=Now())
            .values_list("status", "lease_expires_at", "now")
            .first()
        )
        if row is None or row[0] not in ACTIVE_STATUSES:
            return None
        status, expires, now = row
        if status == RunStatus.QUEUED or expires is None or expires <= now:
            return 1.0, None
        if seen_expiry is not None and expires.isoformat() != seen_expiry:
            return None
        return (expires - now).total_seconds() + 0.5, expires.isoformat()

    def waiting_in_queue(self, seconds: float) -> list[int]:
        """Queued runs nobody has taken for `seconds`: their hand-over to a
        worker may have been lost (runs/handover.py).  Marks them queued
        again from now, so each is handed out at most once per `seconds`.
        Of this process's kind only, as a claim (RUNDESK_DRILL_LAB: a
        drill's lab, or the installation): refreshing the other's
        `queued_at` would hold those runs back from their own sweep."""
        with transaction.atomic():
            stale = list(
                self.local()
                .filter(
                    status=RunStatus.QUEUED,
                    is_drill=settings.RUNDESK_DRILL_LAB,
                    queued_at__lt=Now() - dt.timedelta(seconds=seconds),
                )
                .order_by("queued_at")
                .select_for_update(skip_locked=True, no_key=True)
                .values_list("pk", flat=True)[:1000]
            )
            self.filter(pk__in=stale).update(queued_at=Now())
        return stale


class Run(models.Model):
    # The agent that runs it (runs/registry.py), and its version when the
    # run was submitted or last resumed under another (runs/submission.py).
    agent = models.CharField(max_length=63, default="research")
    agent_version = models.CharField(max_length=63, default="1")
    # What it was submitted with, in the shape its agent declares.
    input = models.JSONField(default=dict)
    # One line naming the run for operators (Agent.title): the research
    # agent's question.
    question = models.TextField()
    # The documents a research run reads (its input's, for the pages).
    documents = ArrayField(models.CharField(max_length=500), default=list)
    status = models.CharField(max_length=20, choices=RunStatus, default=RunStatus.QUEUED)
    status_reason = models.TextField(blank=True)
    phase = models.CharField(max_length=20, choices=Phase, default=Phase.RESEARCH)
    phase_reason = models.TextField(blank=True)
    action_budget = models.PositiveIntegerField(default=40)
    deadline = models.DateTimeField(null=True, blank=True)
    # The fault plan (runs/faults.py): faults injected at named points of the
    # real code path, for drills, demos and tests.
    faults = models.JSONField(default=list, blank=True)
    # Each fault fires at most once per run (runs/faults.py): a resumed run
    # does not meet it again.
    faults_fired = ArrayField(models.CharField(max_length=100), default=list, blank=True)

    lease_owner = models.CharField(max_length=200, blank=True)
    lease_epoch = models.BigIntegerField(default=0)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_by = models.CharField(max_length=150, blank=True)

    created_at = models.DateTimeField(db_default=Now())
    updated_at = models.DateTimeField(auto_now=True)
    # When it last became queued: a queued run nobody takes for long may have
    # lost its Celery task (runs/sweep.py hands it out again).
    queued_at = models.DateTimeField(db_default=Now())
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    # A run a fault drill made (runs/drills.py): hidden from the runs list
    # unless asked for, and never claimed by an executor's loop (the drill
    # drives it itself, or hands it to a Celery worker by its id).
    is_drill = models.BooleanField(default=False)

    # An imported run (evidence/opening.py; `imported_at` is set): a run of
    # another installation, opened from its investigation bundle.  It is
    # read-only here: it keeps the status it had there, but nothing claims,
    # resumes, cancels or decides it (RunQuerySet.local()).  The seal names
    # the bundle: opening it again finds this run (run_import_seal_unique).
    origin_seal = models.CharField(max_length=64, blank=True)
    origin_installation = models.CharField(max_length=200, blank=True)
    origin_run_id = models.BigIntegerField(null=True, blank=True)
    origin_exported_at = models.DateTimeField(null=True, blank=True)
    origin_format = models.CharField(max_length=40, blank=True)
    # The bundle's manifest as verified: every file's SHA-256, what was
    # redacted where (counts), whether copies of model calls were included.
    origin_manifest = models.JSONField(null=True, blank=True)
    imported_at = models.DateTimeField(null=True, blank=True, help_text="Set: an imported run")
    # Labels given at submission (`submit_run --label key=value`): what the
    # operators find runs by (runs/finding.py), never read by the runtime.
    labels = models.JSONField(default=dict, db_default=Value({}, models.JSONField()), blank=True)

    objects = RunQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        permissions = [("operate_run", "Can operate runs: cancel, resume, decide outcomes")]
        constraints = [
            models.CheckConstraint(condition=Q(lease_epoch__gte=0), name="run_epoch_not_negative"),
            models.CheckConstraint(condition=Q(action_budget__gte=1), name="run_budget_positive"),
            # An imported run that was running where it ran has no owner
            # here (run_imported_never_owned).
            models.CheckConstraint(
                condition=~Q(status=RunStatus.RUNNING)
                | Q(imported_at__isnull=False)
                | (~Q(lease_owner="") & Q(lease_expires_at__isnull=False)),
                name="run_running_has_owner",
            ),
            # Nothing executes an imported run: a claim (which names an
            # owner) of one fails here, whatever query picked it.
            models.CheckConstraint(
                condition=Q(imported_at__isnull=True) | Q(lease_owner=""),
                name="run_imported_never_owned",
            ),
            models.CheckConstraint(
                condition=Q(
                    imported_at__isnull=True,
                    origin_seal="",
                    origin_run_id__isnull=True,
                    origin_exported_at__isnull=True,
                )
                | (
                    Q(
                        imported_at__isnull=False,
                        origin_run_id__isnull=False,
                        origin_exported_at__isnull=False,
                    )
                    & ~Q(origin_seal="")
                ),
                name="run_imported_has_origin",
            ),
            # One imported run per bundle: opening it again finds this one.
            models.UniqueConstraint(
                fields=["origin_seal"], condition=~Q(origin_seal=""), name="run_import_seal_unique"
            ),
            models.CheckConstraint(
                condition=Q(status__in=TERMINAL_STATUSES, finished_at__isnull=False)
                | (~Q(status__in=TERMINAL_STATUSES) & Q(finished_at__isnull=True)),
                name="run_finished_iff_terminal",
            ),
            models.CheckConstraint(
                condition=~Q(status=RunStatus.COMPLETED) | Q(phase=Phase.DONE),
                name="run_completed_is_done",
            ),
        ]
        indexes = [
            # Serves the runs list, newest first, keyset-paginated (page_cursor).
            models.Index(fields=["-created_at", "-id"], name="run_listing_idx"),
            # The same, filtered by status.
            models.Index(fields=["status", "-created_at", "-id"], name="run_status_listing_idx"),
            # Serves the executor's claim of the oldest queued runs, in the
            # claim's order: it reads the runs it takes, not the whole queue.
            models.Index(
                fields=["created_at", "id"],
                name="run_queued_idx",
                condition=Q(status=RunStatus.QUEUED),
            ),
            # Serves claimable(): runs whose lease expired (owner died).
            models.Index(
                fields=["lease_expires_at"],
                name="run_running_lease_idx",
                condition=Q(status=RunStatus.RUNNING),
            ),
            *FINDING_INDEXES,
            # purgeable() (runs ended before a time) and /metrics' durations
            # of the runs ended lately are served by FINDING_INDEXES'
            # run_finished_idx (finished_at, id): only ended runs are in it.
        ]

    def __str__(self) -> str:
        return f"run {self.pk}: {self.question[:60]}"

    @property
    def is_finished(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @property
    def is_active(self) -> bool:
        """Queued or running here.  An imported run never is, whatever
        status it had where it ran: nothing here executes it."""
        return self.status in ACTIVE_STATUSES and not self.is_imported

    @property
    def is_imported(self) -> bool:
        return self.imported_at is not None

    def request_cancel(self, by: str, reason: str = "") -> bool:
        """Cancel, asked by `by` (an operator's user name) for `reason`.  A
        run nobody owns (queued, or waiting for an operator) ends at once,
        the reason in its status reason, as an abandon's is; a running one's
        owner stops before its next boundary (its fenced writes see the
        request), and if that owner died, whoever claims the run or the sweep
        ends it (lifecycle.CANCEL, END_CANCELLED).  The reason is also on the
        cancel_requested event, which the run page reads after the run ended
        (however it ended).  Open outcome items stay open and visible: a
        cancelled run waits for nothing.  False if the run had already
        ended, the cancel was already asked, or the run is imported
        (read-only here)."""
        why = f"cancelled by {by}: {reason}" if reason else f"cancelled by {by}"
        with transaction.atomic():
            after = lifecycle.cancel(
                self.pk, by, why, [RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.NEEDS_OPERATOR]
            )
            if after is None:
                return False
            done = (
                "the run ended"
                if after == RunStatus.CANCELLED
                else "its owner stops before its next boundary"
            )
            asked = f"cancel requested by {by}" + (f" ({reason})" if reason else "")
            # The operator's reason is a record, as a decision's is: written
            # with the cancel, in its transaction, not left to the timeline's
            # writer (which may drop an event under load).
            RunEvent.objects.create(
                run_id=self.pk,
                kind=EventKind.CANCEL_REQUESTED,
                message=f"{asked}: {done}",
                data={"by": by, "reason": reason},
                created_at=dt.datetime.now(dt.UTC),
            )
        return True


class EffectClass(models.TextChoices):
    READ = "read"  # repeatable, no outside effect
    EFFECT = "effect"  # irreversible outside effect


class ActionState(models.TextChoices):
    DISPATCHED = "dispatched"  # boundary written, no receipt yet
    COMPLETED = "completed"  # receipt written
    FAILED = "failed"  # known not to have completed
    UNKNOWN = "unknown"  # may or may not have happened: only evidence settles it


class Action(models.Model):
    """One tool dispatch or model call.  Its identity (run, step_key) is fixed
    before dispatch by the boundary row and never reused for other work."""

    # No index of its own: action_identity_unique (run, step_key) serves it.
    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="actions", db_index=False)
    step_key = models.CharField(max_length=200)
    kind = models.CharField(max_length=40)
    effect_class = models.CharField(max_length=10, choices=EffectClass)
    input = models.JSONField()
    input_digest = models.CharField(max_length=64)
    state = models.CharField(max_length=20, choices=ActionState, default=ActionState.DISPATCHED)
    epoch = models.BigIntegerField(help_text="Lease epoch of the latest dispatch")
    attempts = models.PositiveIntegerField(default=1)
    # Written with the boundary, in its statement (Lease.record_boundary),
    # and sent with every dispatch of the action: a resend sends it again.
    # Rows from before it have the identity they were sent under; a row
    # inserted by hand gets a random one from the database.
    idempotency_key = models.TextField(
        default=new_idempotency_key,
        db_default=Concat(
            Value("rundesk:"), Cast(Func(function="gen_random_uuid"), models.TextField())
        ),
        editable=False,
    )
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(db_default=Now())
    dispatched_at = models.DateTimeField(db_default=Now())
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run", "id"]
        constraints = [
            models.UniqueConstraint(fields=["run", "step_key"], name="action_identity_unique"),
            models.UniqueConstraint(
                fields=["idempotency_key"], name="action_idempotency_key_unique"
            ),
            models.CheckConstraint(condition=Q(attempts__gte=1), name="action_attempts_positive"),
            # An effect is dispatched once under its identity, and again only
            # as often as operators' decisions authorise (OperatorDecision,
            # AUTHORISING): a trigger counts them (migration 0008).
        ]
        indexes = [
            # A hold's dispatches in flight (holds.in_flight), read while the
            # hold's short transaction holds every boundary back: the few
            # actions dispatched now, not the whole table.
            models.Index(
                fields=["kind"], condition=Q(state="dispatched"), name="action_dispatched_idx"
            ),
        ]

    def __str__(self) -> str:
        return self.identity

    @property
    def identity(self) -> str:
        return action_identity(self.run_id, self.step_key)


class Receipt(models.Model):
    """The immutable record that an action completed, under its original
    identity.  UPDATE and DELETE are refused by a trigger."""

    action = models.OneToOneField(
        Action, on_delete=models.PROTECT, primary_key=True, related_name="receipt"
    )
    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="receipts")
    step_key = models.CharField(max_length=200)
    result = models.JSONField()
    result_digest = models.CharField(max_length=64)
    epoch = models.BigIntegerField()
    xid = models.BigIntegerField(null=True, help_text="Transaction that wrote it (announced)")
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["run", "created_at"]

    def __str__(self) -> str:
        return f"receipt of run {self.run_id} {self.step_key}"

    def verifies(self, action: Action) -> bool:
        """True when this receipt is the one of `action`, under its original
        identity, and its result still matches the digest written with it."""
        return (
            self.action_id == action.pk
            and self.run_id == action.run_id
            and self.step_key == action.step_key
            and self.result_digest == digest(self.result)
        )


class AnswerRevision(models.Model):
    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="revisions")
    number = models.PositiveIntegerField()
    content = models.TextField()
    content_digest = models.CharField(max_length=64)
    # The model-call actions whose results this revision used.  Kept on the
    # revision's own row, with no foreign key to the evidence tables: a
    # publication must never wait on a lock anyone holds there.
    model_call_actions = ArrayField(models.BigIntegerField(), default=list, blank=True)
    is_final = models.BooleanField(default=False)
    epoch = models.BigIntegerField()
    xid = models.BigIntegerField(null=True, help_text="Transaction that wrote it (announced)")
    committed_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["run", "number"]
        constraints = [
            models.UniqueConstraint(fields=["run", "number"], name="revision_number_unique"),
            models.UniqueConstraint(
                fields=["run"], condition=Q(is_final=True), name="revision_one_final_per_run"
            ),
            models.CheckConstraint(condition=Q(number__gte=1), name="revision_number_positive"),
        ]

    def __str__(self) -> str:
        return f"run {self.run_id} revision {self.number}"


class CheckpointOutcome(models.TextChoices):
    COMMITTED = "committed"
    FAILED_BEFORE_WRITE = "failed_before_write"  # known not written
    UNKNOWN = "unknown"  # COMMIT sent, no answer: only evidence settles it
    # Settled by evidence or an operator.  The stored values and labels keep
    # the word "resolved": they are schema, and the bundles' and `outcomes
    # --json`'s values (docs/DESIGN.md, Words).
    SETTLED_COMMITTED = "resolved_committed", "Resolved Committed"
    SETTLED_NOT_WRITTEN = "resolved_not_written", "Resolved Not Written"


class Checkpoint(models.Model):
    """A save of the agent's state after a completed action (recovery
    class: it supports continuing, it never overrides a receipt).  A row is
    the checkpoint itself (its `state` is set: the checkpoint transaction
    wrote it) or the record of an attempt that did not write one, or whose
    outcome was unknown (no state).  Only `outcome`, `resolved_at` and
    `resolution` ever change (a trigger, migration 0004)."""

    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="checkpoints")
    after_action = models.ForeignKey(Action, on_delete=models.PROTECT, related_name="checkpoints")
    number = models.PositiveIntegerField(help_text="The run's step count when it was saved")
    epoch = models.BigIntegerField()
    outcome = models.CharField(max_length=30, choices=CheckpointOutcome)
    state = models.JSONField(null=True, blank=True)
    state_digest = models.CharField(max_length=64, blank=True)
    xid = models.BigIntegerField(null=True, help_text="Transaction id announced before COMMIT")
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(db_default=Now())
    resolved_at = models.DateTimeField(null=True, blank=True)
    resolution = models.TextField(blank=True)

    class Meta:
        ordering = ["run", "number", "id"]
        constraints = [
            # One saved state per checkpoint number: rows that only record an
            # attempt's outcome are not in it, so recording an unknown outcome
            # never waits on (or collides with) a transaction still in flight.
            models.UniqueConstraint(
                fields=["run", "number"],
                condition=Q(state__isnull=False),
                name="checkpoint_one_state_per_number",
            ),
            models.CheckConstraint(
                condition=Q(state__isnull=True)
                | Q(outcome__in=["committed", "resolved_committed"]),
                name="checkpoint_state_only_if_written",
            ),
        ]
        indexes = [
            # The sweep looks for checkpoints left unknown every few seconds
            # (outcomes.settle_left_checkpoints): few rows of a large table.
            models.Index(
                fields=["id"], condition=Q(outcome="unknown"), name="checkpoint_unknown_idx"
            ),
        ]

    def __str__(self) -> str:
        return f"run {self.run_id} checkpoint {self.number} ({self.outcome})"


class OutcomeKind(models.TextChoices):
    CHECKPOINT = "checkpoint"
    RECEIPT = "receipt"
    PUBLICATION = "publication"
    EFFECT = "effect"
    # An action that needs a person's approval before its boundary
    # (runs/approvals.py): the run waits until it is approved or refused.
    APPROVAL = "approval"


class OutcomeState(models.TextChoices):
    OPEN = "open"
    # The stored value and label keep "resolved" (schema, and the value of
    # `outcomes --json`'s "state"; docs/DESIGN.md, Words).
    SETTLED = "resolved", "Resolved"


# The items a run must wait for: an unknown receipt, publication or effect.
# An unknown checkpoint holds nothing (the run went on).
HOLDING_KINDS = [
    OutcomeKind.RECEIPT,
    OutcomeKind.PUBLICATION,
    OutcomeKind.EFFECT,
    OutcomeKind.APPROVAL,
]


class OutcomeItemQuerySet(models.QuerySet["OutcomeItem"]):
    def local(self) -> OutcomeItemQuerySet:
        """Items of this installation's runs (Run.objects.local()): an
        imported run's items are read, never settled or decided here."""
        return self.filter(run__imported_at__isnull=True)

    def in_inbox(self) -> OutcomeItemQuerySet:
        """What the operators' inbox lists: this installation's items, but
        a drill's (it staged them on purpose; the drills page reports it)."""
        return self.local().filter(run__is_drill=False)

    def holding_runs(self) -> OutcomeItemQuerySet:
        """Open items their run must wait for (HOLDING_KINDS)."""
        return self.filter(state=OutcomeState.OPEN, kind__in=HOLDING_KINDS)

    def needing_someone(self) -> OutcomeItemQuerySet:
        """Open items of runs that have not ended: what the inbox's badge
        counts.  Still worth an operator's decision even when it holds
        nothing this instant (an unknown checkpoint): the run goes on."""
        return self.filter(state=OutcomeState.OPEN).exclude(run__status__in=TERMINAL_STATUSES)

    def no_longer_blocking(self) -> OutcomeItemQuerySet:
        """Open items of runs that have ended (completed, failed, cancelled
        or abandoned): nothing waits for them any more; they stay decidable
        for the record."""
        return self.filter(state=OutcomeState.OPEN, run__status__in=TERMINAL_STATUSES)


class OutcomeItem(models.Model):
    """Something the runtime could not settle itself: a write whose COMMIT
    got no answer and whose evidence is inconclusive, or an effect whose
    answer was lost (only its receiver knows).  It stays open until evidence
    or an operator settles it; it is never guessed."""

    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="outcome_items")
    kind = models.CharField(max_length=20, choices=OutcomeKind)
    # What it is about, stable: one item per subject, e.g. "effect:action-12:attempt-1".
    subject = models.CharField(max_length=100, unique=True)
    action = models.ForeignKey(
        Action, on_delete=models.PROTECT, related_name="outcome_items", null=True, blank=True
    )
    checkpoint = models.ForeignKey(
        Checkpoint, on_delete=models.PROTECT, related_name="outcome_items", null=True, blank=True
    )
    revision_number = models.PositiveIntegerField(null=True, blank=True)
    xid = models.BigIntegerField(null=True, blank=True)
    summary = models.TextField()
    evidence = models.JSONField(default=dict)
    state = models.CharField(max_length=10, choices=OutcomeState, default=OutcomeState.OPEN)
    resolution = models.TextField(blank=True)
    created_at = models.DateTimeField(db_default=Now())
    resolved_at = models.DateTimeField(null=True, blank=True)

    objects = OutcomeItemQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(state=OutcomeState.OPEN, resolved_at__isnull=True)
                | Q(state=OutcomeState.SETTLED, resolved_at__isnull=False),
                name="outcome_resolved_has_time",
            ),
        ]
        indexes = [
            models.Index(
                fields=["created_at"], name="outcome_open_idx", condition=Q(state=OutcomeState.OPEN)
            ),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.subject} ({self.state})"


class AlertChannel(models.TextChoices):
    EMAIL = "email"  # to the active members of the `operators` group that have an address
    WEBHOOK = "webhook"  # a JSON POST to RUNDESK_ALERT_URL


class AlertState(models.TextChoices):
    PENDING = "pending"  # not tried yet
    SENT = "sent"  # the receiver took it (2xx; the mail server accepted it)
    FAILING = "failing"  # tried: last_error says why, next_try_at when again
    # Its item was settled before it went out: nobody waits for it any more.
    WITHDRAWN = "withdrawn"


# The states the sweep still sends (runs/alerts.py).
UNSENT = [AlertState.PENDING, AlertState.FAILING]


class AlertQuerySet(models.QuerySet["Alert"]):
    def due(self) -> AlertQuerySet:
        """Alerts to send now, the longest due first.  The database's clock
        decides, as it set next_try_at: executors on several hosts agree."""
        return self.filter(state__in=UNSENT, next_try_at__lte=Now()).order_by("next_try_at", "id")

    def failing(self) -> AlertQuerySet:
        """Alerts whose last attempt failed, the longest failing first: the
        operators may not have been told."""
        return self.filter(state=AlertState.FAILING).order_by("created_at", "id")


class Alert(models.Model):
    """Telling the operators that an item holds a run, on one channel.  The
    row is written in the transaction that opens the item, so the alert
    cannot be lost with a process that dies after the commit; the sweep
    sends it (runs/alerts.py), once per item and channel when the receiver
    answers."""

    item = models.ForeignKey(OutcomeItem, on_delete=models.PROTECT, related_name="alerts")
    channel = models.CharField(max_length=10, choices=AlertChannel)
    state = models.CharField(max_length=10, choices=AlertState, default=AlertState.PENDING)
    attempts = models.PositiveIntegerField(default=0)  # attempts finished
    last_error = models.TextField(blank=True)  # why the last attempt failed
    # When the sweep may try it (again).  While an attempt is under way, the
    # end of its lease: a sweep that died mid-send leaves it due again then.
    next_try_at = models.DateTimeField(null=True, blank=True, db_default=Now())
    sent_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(db_default=Now())

    objects = AlertQuerySet.as_manager()

    class Meta:
        ordering = ["item", "channel"]
        constraints = [
            models.UniqueConstraint(fields=["item", "channel"], name="alert_once_per_item_channel"),
            models.CheckConstraint(
                condition=Q(state__in=UNSENT, next_try_at__isnull=False, sent_at__isnull=True)
                | Q(state=AlertState.SENT, next_try_at__isnull=True, sent_at__isnull=False)
                | Q(state=AlertState.WITHDRAWN, next_try_at__isnull=True, sent_at__isnull=True),
                name="alert_state_times",
            ),
        ]
        indexes = [
            # Alert.objects.due(), the sweep's claim: "state IN ('pending',
            # 'failing') AND next_try_at <= now() ORDER BY next_try_at",
            # over the few rows still to send, not every alert ever sent.
            models.Index(
                fields=["next_try_at"], name="alert_due_idx", condition=Q(state__in=UNSENT)
            ),
        ]

    def __str__(self) -> str:
        return f"{self.channel} alert of item {self.item_id} ({self.state})"

    def said(self) -> str:
        """Where it stands, in a sentence for the item page and `outcomes show`."""
        tries = f"{self.attempts} attempt{'s' if self.attempts != 1 else ''}"
        when = self.next_try_at.isoformat(timespec="seconds") if self.next_try_at else ""
        if self.state == AlertState.SENT:
            return f"sent {self.sent_at.isoformat(timespec='seconds')} ({tries})"
        if self.state == AlertState.FAILING:
            return f"failing after {tries}: {self.last_error}; next try {when}"
        if self.state == AlertState.WITHDRAWN:
            return "not sent: the item was settled first"
        return f"pending: not sent yet; the sweep sends it from {when}"

    def json(self) -> dict[str, Any]:
        return {
            "channel": self.channel,
            "state": self.state,
            "attempts": self.attempts,
            "why": self.last_error,
            "next_try": self.next_try_at.isoformat() if self.next_try_at else None,
            "sent_at": self.sent_at.isoformat() if self.sent_at else None,
        }


class DecisionChoice(models.TextChoices):
    # An effect whose answer was lost (only its receiver knows).
    CONFIRMED_HAPPENED = "confirmed_happened", "confirmed: it happened"
    RESEND_SAME_IDENTITY = "resend_same_identity", "send again under the same identity"
    CONFIRMED_NOT_HAPPENED = "confirmed_not_happened", "confirmed: it did not happen"
    # A database write whose COMMIT got no answer.
    CHECK_AGAIN = "check_again", "check the evidence again"
    WRITTEN = "written", "written"
    NOT_WRITTEN = "not_written", "not written"
    # The run itself.
    RESUME = "resume", "resume the run"
    ABANDON = "abandon", "abandon the run"
    # An action that needs approval (runs/approvals.py).
    APPROVE = "approve", "approve"
    APPROVE_EDITED = "approve_edited", "approve with an edit"
    REJECT = "reject", "reject"


# The decisions that authorise dispatching an effect once more, under its
# original identity (and Idempotency-Key).
AUTHORISING = [DecisionChoice.RESEND_SAME_IDENTITY, DecisionChoice.CONFIRMED_NOT_HAPPENED]


class OperatorDecision(models.Model):
    """An operator's (or the system's) decision on an outcome item or a run:
    who, what, why, on what evidence.  Immutable (a trigger, migration 0008)
    and idempotent by its request token; an item is settled by one decision
    at most."""

    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="decisions")
    item = models.ForeignKey(
        OutcomeItem, on_delete=models.PROTECT, related_name="decisions", null=True, blank=True
    )
    action = models.ForeignKey(
        Action, on_delete=models.PROTECT, related_name="decisions", null=True, blank=True
    )
    user = models.ForeignKey(
        "auth.User", on_delete=models.PROTECT, related_name="+", null=True, blank=True
    )
    # The user's name, or "system: <how>" for a settlement by evidence.
    decided_by = models.CharField(max_length=150)
    choice = models.CharField(max_length=30, choices=DecisionChoice)
    reason = models.TextField(blank=True)
    reference = models.CharField(max_length=300, blank=True, help_text="e.g. a delivery id")
    evidence = models.JSONField(help_text="The evidence shown when deciding")
    evidence_digest = models.CharField(max_length=64)
    state_before = models.CharField(max_length=20)
    state_after = models.CharField(max_length=20)
    request_token = models.CharField(max_length=100, unique=True)
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["created_at", "id"]
        constraints = [
            # Two operators deciding one item at once: exactly one settles it.
            models.UniqueConstraint(
                fields=["item"],
                condition=Q(state_after=OutcomeState.SETTLED, item__isnull=False),
                name="decision_one_settles_an_item",
            ),
            models.CheckConstraint(
                condition=Q(user__isnull=True) | ~Q(reason=""), name="decision_person_says_why"
            ),
        ]
        indexes = [
            # Serves the authorised-dispatch count (AUTHORISING) of an action.
            models.Index(
                fields=["action"],
                name="decision_authorising_idx",
                condition=Q(choice__in=AUTHORISING),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.choice} by {self.decided_by}"


class RunEvent(models.Model):
    """Append-only timeline.  Written off the main path (runs/timeline.py):
    a failure to write an event never fails a protected write."""

    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="events")
    action = models.ForeignKey(
        Action, on_delete=models.PROTECT, related_name="events", null=True, blank=True
    )
    kind = models.CharField(max_length=40, choices=EventKind)
    message = models.TextField(blank=True)
    data = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField()

    class Meta:
        ordering = ["run", "created_at", "id"]
        indexes = [
            # Serves a run's timeline, in order, from a cursor.
            models.Index(fields=["run", "created_at", "id"], name="event_timeline_idx"),
            # Serves /metrics' lease takeovers: an owner resumed a run another
            # owner had (few rows of a large table).
            models.Index(
                fields=["id"], name="event_resumed_idx", condition=Q(kind=EventKind.RESUMED)
            ),
        ]

    def __str__(self) -> str:
        return f"run {self.run_id} {self.kind}"


class DrillState(models.TextChoices):
    RUNNING = "running"
    DONE = "done"


class Drill(models.Model):
    """One run of the fault drills (runs/drills.py), from `manage.py drill`
    or the drills page: which scenarios, against which agents, who started
    it, how far it got."""

    scenarios = ArrayField(models.CharField(max_length=60))
    # Each scenario runs against each of these agents (those that declare a
    # drill input); the drills before agents were the research agent's.
    agents = ArrayField(models.CharField(max_length=63), default=list)
    started_by = models.CharField(max_length=150)
    state = models.CharField(max_length=20, choices=DrillState, default=DrillState.RUNNING)
    error = models.TextField(blank=True)
    started_at = models.DateTimeField(db_default=Now())
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-started_at", "-id"]
        constraints = [
            # Two drills at once would kill processes and lock tables under
            # each other.
            models.UniqueConstraint(
                fields=["state"], condition=Q(state="running"), name="one_drill_running"
            ),
        ]

    def __str__(self) -> str:
        return f"drill {self.pk} ({self.state})"

    @property
    def planned(self) -> int:
        """How many results it is to give: each scenario for each agent."""
        return len(self.scenarios) * max(len(self.agents), 1)


class DrillVerdict(models.TextChoices):
    PASSED = "passed"
    FAILED = "failed"
    NOT_RUN = "not_run"


class DrillResult(models.Model):
    """One scenario of a drill: the four questions asked of it, each
    answered from the data (True, False, or None where it does not apply,
    with the reason in `detail`)."""

    drill = models.ForeignKey(Drill, on_delete=models.CASCADE, related_name="results")
    scenario = models.CharField(max_length=60)
    # The agent whose runs it staged (the results before agents: research's).
    agent = models.CharField(max_length=63, default="research")
    verdict = models.CharField(max_length=20, choices=DrillVerdict)
    seconds = models.FloatField()
    checks = models.JSONField(default=dict)
    detail = models.TextField(blank=True)
    run_ids = ArrayField(models.BigIntegerField(), default=list)
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            # The drills page: the newest results of each scenario for each agent.
            models.Index(
                fields=["scenario", "agent", "-created_at"], name="drill_result_history_idx"
            )
        ]

    def __str__(self) -> str:
        return f"{self.scenario} ({self.agent}): {self.verdict}"


# -- holds (runs/holds.py) ---------------------------------------------------------


class HoldQuerySet(models.QuerySet["Hold"]):
    def active(self) -> HoldQuerySet:
        return self.filter(released_at__isnull=True)

    def released(self) -> HoldQuerySet:
        return self.filter(released_at__isnull=False)


class Hold(models.Model):
    """An operator's stop on a tool (`tool`) of one agent (`agent`) or of
    every agent (agent ""), or on every effect of one agent (tool ""): a
    run reaching the boundary of an action it matches does not dispatch it
    and waits (HoldWait) until the hold is released (runs/holds.py)."""

    tool = models.CharField(max_length=40, blank=True)  # "": every effect of `agent`
    agent = models.CharField(max_length=63, blank=True)  # "": every agent
    reason = models.TextField()
    added_by = models.CharField(max_length=150)
    added_at = models.DateTimeField(db_default=Now())
    # The dispatches of what it holds that were already in flight when it
    # was added (boundaries without a receipt, committed before it): they
    # went on.  [{"action": id, "run": id, "step_key": ..., "tool": ...}]
    in_flight = models.JSONField(default=list, blank=True)
    released_by = models.CharField(max_length=150, blank=True)
    released_at = models.DateTimeField(null=True, blank=True)
    release_reason = models.TextField(blank=True)

    objects = HoldQuerySet.as_manager()

    class Meta:
        ordering = ["-added_at", "-id"]
        constraints = [
            # Every effect of every agent is not a hold: it is stopping the service.
            models.CheckConstraint(
                condition=~Q(tool="") | ~Q(agent=""), name="hold_names_a_tool_or_an_agent"
            ),
            models.CheckConstraint(condition=~Q(reason=""), name="hold_says_why"),
            models.CheckConstraint(condition=~Q(added_by=""), name="hold_says_who"),
            # Released by someone, for a reason, after it was added; or not at all.
            models.CheckConstraint(
                condition=Q(released_at__isnull=True, released_by="", release_reason="")
                | (Q(released_at__gte=F("added_at")) & ~Q(released_by="") & ~Q(release_reason="")),
                name="hold_release_complete",
            ),
            # One active hold per scope; also serves the boundary's look-up
            # of active holds (holds.HOLDING).
            models.UniqueConstraint(
                fields=["tool", "agent"],
                condition=Q(released_at__isnull=True),
                name="hold_one_active_per_scope",
            ),
        ]

    def __str__(self) -> str:
        return f"hold {self.pk}"

    @property
    def is_active(self) -> bool:
        return self.released_at is None


class HoldWait(models.Model):
    """A run's wait at a held boundary: from when it stopped (`since`) to
    when the hold's release put it back in the queue, or it ended
    (`until`).  The hold's audit figures (how many runs waited, how long)
    are sums of these."""

    hold = models.ForeignKey(Hold, on_delete=models.PROTECT, related_name="waits")
    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="hold_waits")
    step_key = models.CharField(max_length=200)
    since = models.DateTimeField(db_default=Now())
    until = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["since", "id"]
        constraints = [
            # A run waits at one boundary at a time.
            models.UniqueConstraint(
                fields=["run"], condition=Q(until__isnull=True), name="hold_wait_one_open_per_run"
            ),
            models.CheckConstraint(
                condition=Q(until__isnull=True) | Q(until__gte=F("since")),
                name="hold_wait_ends_after_it_starts",
            ),
        ]
        indexes = [
            # Serves the release: the open waits of a hold.
            models.Index(
                fields=["hold"], condition=Q(until__isnull=True), name="hold_wait_open_idx"
            ),
        ]

    def __str__(self) -> str:
        return f"run {self.run_id} waits on hold {self.hold_id}"


# -- approval gates (runs/approvals.py) ------------------------------------------------


class ApprovalState(models.TextChoices):
    PENDING = "pending"  # its item is open: the run waits
    APPROVED = "approved"  # the action may be dispatched, with `sent` as its input
    REJECTED = "rejected"  # refused by a person, or not approved in time


class Approval(models.Model):
    """The gate before an action that needs a person's approval: opened
    with its item (the inbox's), before the action's boundary, and decided
    once (pending -> approved or rejected; a trigger refuses any other
    change, migration 0023).  The boundary of a gated action can only be
    written with the input an approval sent: a trigger on runs_action
    compares its input digest with `sent_digest` (migration 0023)."""

    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="approvals")
    item = models.OneToOneField(OutcomeItem, on_delete=models.PROTECT, related_name="approval")
    step_key = models.CharField(max_length=200)
    tool = models.CharField(max_length=40)
    # What the agent proposed, as it asked for it, and its digest.
    proposed = models.JSONField()
    proposed_digest = models.CharField(max_length=64)
    # Who may approve (the group holding the approve permission), as shown.
    approvers = models.CharField(max_length=150)
    expires_at = models.DateTimeField()
    state = models.CharField(max_length=10, choices=ApprovalState, default=ApprovalState.PENDING)
    decision = models.OneToOneField(
        OperatorDecision,
        on_delete=models.PROTECT,
        related_name="approval",
        null=True,
        blank=True,
    )
    # The input dispatched: the proposed one, or an approver's edit of it.
    sent = models.JSONField(null=True, blank=True)
    sent_digest = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(db_default=Now())
    decided_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created_at", "id"]
        permissions = [("approve_action", "Can approve or reject actions that need approval")]
        constraints = [
            models.UniqueConstraint(fields=["run", "step_key"], name="approval_one_per_action"),
            models.CheckConstraint(
                condition=Q(
                    state=ApprovalState.PENDING,
                    decision__isnull=True,
                    sent__isnull=True,
                    sent_digest="",
                    decided_at__isnull=True,
                )
                | (
                    Q(
                        state=ApprovalState.APPROVED,
                        decision__isnull=False,
                        sent__isnull=False,
                        decided_at__isnull=False,
                    )
                    & ~Q(sent_digest="")
                )
                | Q(
                    state=ApprovalState.REJECTED,
                    decision__isnull=False,
                    sent__isnull=True,
                    sent_digest="",
                    decided_at__isnull=False,
                ),
                name="approval_decided_once",
            ),
        ]
        indexes = [
            # The sweep's expiry: pending approvals past their time, oldest first.
            models.Index(
                fields=["expires_at"],
                name="approval_pending_idx",
                condition=Q(state=ApprovalState.PENDING),
            ),
        ]

    def __str__(self) -> str:
        return f"approval of run {self.run_id} {self.step_key} ({self.state})"

    @property
    def edited(self) -> bool:
        return self.state == ApprovalState.APPROVED and self.sent_digest != self.proposed_digest


# -- summaries of runs, for the overview (runs/summaries.py) -------------------------


class SummaryGrain(models.TextChoices):
    MINUTE = "minute"  # the last hour's figures
    HOUR = "hour"  # the last day's and week's over time
    DAY = "day"  # the last week's durations


class SummaryMeasure(models.TextChoices):
    SUBMITTED = "submitted"  # runs submitted in the bucket
    # Runs that ended in the bucket, by how (their duration: submission to end).
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    # Actions of the runs that ended in the bucket (their duration: dispatch to end).
    STEP = "step"


class RunSummary(models.Model):
    """How many runs (or steps) of an agent were submitted or ended in a
    minute or an hour, their durations' sum and a histogram of them in
    fixed buckets (summaries.LATENCY_BOUNDS), from which the overview reads
    p50/p95/p99.  Written only by the roll-up (runs/summaries.py), which
    reads rows that the runs already committed: no statement of a run's main
    path reads, writes or waits on this table."""

    grain = models.CharField(max_length=10, choices=SummaryGrain)
    bucket = models.DateTimeField()  # the minute or hour's start
    agent = models.CharField(max_length=63)
    measure = models.CharField(max_length=20, choices=SummaryMeasure)
    count = models.BigIntegerField(default=0)
    seconds = models.FloatField(default=0)  # the durations' sum
    histogram = ArrayField(models.BigIntegerField(), default=list)

    class Meta:
        ordering = ["grain", "bucket", "agent", "measure"]
        constraints = [
            # Also serves the overview's read: one grain, buckets from a time on.
            models.UniqueConstraint(
                fields=["grain", "bucket", "agent", "measure"], name="run_summary_unique"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.agent} {self.measure} {self.grain} {self.bucket:%Y-%m-%d %H:%M}"


class SummaryCursor(models.Model):
    """How far the roll-up has read one source of runs (summaries.SOURCES):
    every run before (at, last_id) in its order is counted, none after."""

    source = models.CharField(max_length=20, primary_key=True)
    at = models.DateTimeField()
    last_id = models.BigIntegerField(default=0)
    rolled_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.source} up to {self.at.isoformat()} #{self.last_id}"


class SweepTurn(models.Model):
    """The installation's last sweep (runs/sweep.py), an executor's or
    Celery beat's: when it started and who took it.  One row: an executor
    whose sweep is due sweeps only if nobody did for half an interval
    (`sweep.take_turn`)."""

    id = models.PositiveSmallIntegerField(primary_key=True)
    started_at = models.DateTimeField()
    taken_by = models.CharField(max_length=200)

    class Meta:
        constraints = [models.CheckConstraint(condition=Q(id=1), name="sweep_turn_one_row")]

    def __str__(self) -> str:
        return f"swept at {self.started_at.isoformat()} by {self.taken_by}"


class PurgedCount(models.Model):
    """What retention removed that /metrics counts (runs/retention.py): a
    counter read from the rows still kept plus this, so it never goes down
    when a purge removes the rows it was counted from."""

    counter = models.CharField(max_length=60)
    label = models.CharField(max_length=60, blank=True)  # e.g. an alert's channel
    value = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["counter", "label"], name="purged_count_unique")
        ]

    def __str__(self) -> str:
        return f"{self.counter}{{{self.label}}} += {self.value}"

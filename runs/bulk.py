"""Bulk actions: one action on many runs, chosen by a runs-list filter or
by their ids, a dry run first, then a job a Celery worker carries out.

What a bulk job may ask: cancel, resume or abandon each run, or one
decision on every open outcome item of one kind (`decide`), such as
`check_again` on unknown checkpoints, which settles each one the evidence
can settle now.  Nothing here decides anything itself: each run's change
goes through the single action's own path (`Run.request_cancel`,
`decisions.decide_run`, `decisions.decide`), with its checks, its locks,
its lock-wait bound and its audit (a cancel's record, an
OperatorDecision naming the operator, the reason, and the job as its
reference).

**Dry run.** `dry_run` says, without writing anything, for each run
selected what the action would change and what it would refuse, and why:
the single action's own checks (`decisions.run_refusal`,
`decisions.check_offered`, what `request_cancel` refuses), on the run and
its items as they are now.  A selection larger than the cap
(RUNDESK_BULK_MAX_RUNS) is refused whole, saying so.

**The job.** `create_job` writes the job and one item per run the dry run
said would change (the ones it refused are left alone), in one
transaction, idempotent by the request token (the same token again finds
the same job).  `process` (the Celery task
`runs.tasks.bulk_job`) claims the items one at a time with SKIP LOCKED,
each in a transaction of its own with the run's change and its result, so
a worker that dies mid-item leaves that item pending and nothing half
done; another task for the same job (a redelivery, beat's
`redeliver_bulk_jobs` for a job nobody moves) carries on where it
stopped.  Every decision's request token is the job's and the run's or
item's (`bulk-<job>:run-<id>`): carried out twice, it is recorded once.
A run that changed between the dry run and the job is refused with why
(the single action's check, under its locks).  `request_stop` marks
every item not yet taken "not done: stopped by X"; the one in progress
finishes.

The models live here, beside their rules; runs/apps.py imports this
module when the app is ready, so Django knows them.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.contrib.postgres.fields import ArrayField
from django.core.exceptions import BadRequest
from django.db import DatabaseError, IntegrityError, models, transaction
from django.db.models import Count, Exists, OuterRef, Q
from django.db.models.functions import Now
from django.utils import timezone

from runs import selection
from runs.decisions import (
    LOCK_WAIT,
    OPERATE,
    REASON_MAX,
    DecisionRefused,
    Request,
    Who,
    check_offered,
    decide,
    decide_run,
    gather,
    offers,
    run_offers,
    run_refusal,
)
from runs.models import (
    UNSTORABLE,
    DecisionChoice,
    OutcomeItem,
    OutcomeKind,
    OutcomeState,
    Run,
    RunQuerySet,
    RunStatus,
)
from runs.sql import unless_locked
from runs.words import plain, status_words

logger = logging.getLogger(__name__)

# A job whose worker has not moved it for this long is handed out again
# (runs.tasks.redeliver_bulk_jobs): its worker died, or its task was lost.
# One item takes a lock wait (decisions.LOCK_WAIT) and a few statements.
STALLED_AFTER = dt.timedelta(seconds=60)
# How often a worker says it is moving the job (progressed_at): once per
# this many seconds, not once per run.
PROGRESS_SECONDS = 1.0
TOKEN_MAX = 100
TOKEN_PREFIX = "bulk-"  # noqa: S105 (a prefix, no secret)
RUN_DECISIONS = (DecisionChoice.RESUME, DecisionChoice.ABANDON)
ITEM_CHOICES = [choice for choice in DecisionChoice.values if choice not in RUN_DECISIONS]


class BulkAction(models.TextChoices):
    CANCEL = "cancel", "cancel"
    RESUME = "resume", "resume"
    ABANDON = "abandon", "abandon"
    DECIDE = "decide", "decide open items"


class BulkState(models.TextChoices):
    QUEUED = "queued"  # no worker has taken it yet
    RUNNING = "running"
    DONE = "done"  # every run's item carried out or refused
    STOPPED = "stopped"  # stopped midway: what was not done says so


class ItemResult(models.TextChoices):
    PENDING = "pending", "not done yet"
    DONE = "done", "done"
    REFUSED = "refused", "refused"
    STOPPED = "stopped", "not done: stopped"


UNFINISHED = [BulkState.QUEUED, BulkState.RUNNING]


class Refused(Exception):
    """A bulk request that cannot be taken; says why."""


# -- what is asked ------------------------------------------------------------------


@dataclass(frozen=True)
class Ask:
    """The action a job takes on each run: cancel, resume or abandon it,
    or `choice` on every open item of `kind` (action decide)."""

    action: str
    choice: str = ""
    kind: str = ""

    def check(self) -> None:
        if self.action not in BulkAction.values:
            raise Refused(f"{self.action!r} is not one of: {', '.join(BulkAction.values)}")
        if self.action != BulkAction.DECIDE:
            if self.choice or self.kind:
                raise Refused(f"{self.action} takes no choice or kind: those are for decide")
            return
        if self.kind not in OutcomeKind.values:
            raise Refused(f"decide needs the kind of items: one of {', '.join(OutcomeKind.values)}")
        if self.choice not in ITEM_CHOICES:
            raise Refused(f"decide needs a choice: one of {', '.join(ITEM_CHOICES)}")

    def words(self) -> str:
        if self.action == BulkAction.DECIDE:
            return (
                f"“{DecisionChoice(self.choice).label}” on every open "
                f"{plain(OutcomeKind, self.kind)} item"
            )
        return f"{BulkAction(self.action).label} each run"


@dataclass(frozen=True)
class Selection:
    """The runs a job acts on: a runs-list filter, or ids."""

    run_filter: selection.RunFilter | None = None
    ids: tuple[int, ...] = ()

    @classmethod
    def by_filter(cls, text: str) -> Selection:
        try:
            return cls(run_filter=selection.parse(text))
        except BadRequest as error:
            raise Refused(str(error)) from None

    @classmethod
    def by_ids(cls, text: str) -> Selection:
        parts = [part.strip() for part in text.replace(" ", ",").split(",") if part.strip()]
        bad = [part for part in parts if not (part.isascii() and part.isdigit())]
        if bad or not parts:
            raise Refused(f"ids must be run numbers separated by commas, not {text!r}")
        return cls(ids=tuple(dict.fromkeys(int(part) for part in parts)))

    def runs(self) -> RunQuerySet:
        if self.run_filter is not None:
            return self.run_filter.select(Run.objects.all())
        return Run.objects.filter(pk__in=self.ids)

    @property
    def query(self) -> str:
        """What the job records: the filter as a query string ("" by ids)."""
        return self.run_filter.query() if self.run_filter is not None else ""

    def words(self) -> str:
        if self.run_filter is None:
            return f"the {len(self.ids)} ids given"
        return f"the filter {self.query or '(none: every run)'}"


# -- the dry run --------------------------------------------------------------------


@dataclass
class RunPlan:
    """What the action would do to one run: each change, each refusal."""

    run: Run
    changes: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)

    @property
    def changes_something(self) -> bool:
        return bool(self.changes)


@dataclass
class DryRun:
    ask: Ask
    selection: Selection
    total: int
    cap: int
    plans: list[RunPlan] = field(default_factory=list)
    # Why the whole selection is refused ("" when it is not).
    refused: str = ""

    @property
    def changing(self) -> int:
        return sum(plan.changes_something for plan in self.plans)

    @property
    def refused_runs(self) -> int:
        return sum(not plan.changes_something for plan in self.plans)

    @property
    def run_ids(self) -> list[int]:
        return [plan.run.pk for plan in self.plans]

    @property
    def changing_ids(self) -> list[int]:
        """The runs a job made from this dry run acts on: those it said
        would change.  The ones it refused are left alone, as it said."""
        return [plan.run.pk for plan in self.plans if plan.changes_something]

    def json(self) -> dict[str, Any]:
        return {
            "action": self.ask.action,
            "choice": self.ask.choice,
            "kind": self.ask.kind,
            "filter": self.selection.query if self.selection.run_filter is not None else None,
            "ids": list(self.selection.ids) if self.selection.run_filter is None else None,
            "total": self.total,
            "cap": self.cap,
            "refused": self.refused or None,
            "would_change": self.changing,
            "would_refuse": self.refused_runs,
            "runs": [
                {
                    "id": plan.run.pk,
                    "status": plan.run.status,
                    "changes": plan.changes,
                    "refusals": plan.refusals,
                }
                for plan in self.plans
            ],
        }


def cap() -> int:
    return settings.RUNDESK_BULK_MAX_RUNS


def dry_run(chosen: Selection, ask: Ask) -> DryRun:
    """What `ask` would do to each run `chosen` selects, worked out now
    without writing anything."""
    ask.check()
    runs = chosen.runs().order_by("id")
    limit = cap()
    # Counted up to one past the cap: a selection of millions costs no more.
    total = runs.values("pk")[: limit + 1].count()
    planned = DryRun(ask, chosen, total, limit)
    if total > limit:
        planned.refused = (
            f"more than {limit} runs are selected ({chosen.words()}); a job acts on at most "
            f"{limit} (RUNDESK_BULK_MAX_RUNS): narrow the selection"
        )
        return planned
    if chosen.run_filter is None and (
        missing := sorted(set(chosen.ids) - set(runs.values_list("pk", flat=True)))
    ):
        planned.refused = f"there is no run {', '.join(map(str, missing))}"
        return planned
    if total == 0:
        planned.refused = f"no run is selected ({chosen.words()})"
        return planned
    planned.plans = [plan(run, ask) for run in runs]
    return planned


def plan(run: Run, ask: Ask) -> RunPlan:
    planned = RunPlan(run)
    if ask.action == BulkAction.CANCEL:
        if why := cancel_refusal(run):
            planned.refusals.append(why)
        elif run.status == RunStatus.RUNNING:
            planned.changes.append("cancel asked: its owner stops it before its next boundary")
        else:
            planned.changes.append("ends at once, cancelled")
    elif ask.action in (BulkAction.RESUME, BulkAction.ABANDON):
        if why := run_refusal(run, ask.action):
            planned.refusals.append(why)
        else:
            offer = next(o for o in run_offers(run) if o.choice == ask.action)
            planned.changes.append(offer.does)
    else:
        _plan_items(planned, ask)
    return planned


def _plan_items(planned: RunPlan, ask: Ask) -> None:
    run = planned.run
    if run.is_imported:
        planned.refusals.append(run_refusal(run, ask.choice))
        return
    items = list(_open_items(run, ask.kind))
    if not items:
        planned.refusals.append(f"no open {plain(OutcomeKind, ask.kind)} item")
    for item in items:
        item.run = run
        shown = gather(item)
        try:
            check_offered(item, shown, ask.choice)
        except DecisionRefused as refused:
            planned.refusals.append(f"item {item.pk} ({item.subject}): {refused}")
            continue
        offer = next(o for o in offers(item, shown) if o.choice == ask.choice)
        said = f"item {item.pk} ({item.subject}): {offer.does}"
        if ask.choice == DecisionChoice.CHECK_AGAIN:
            settles = shown["now"]["settles_as"]
            said += (
                " The evidence now cannot tell: it stays open."
                if settles == "unknown"
                else f" The evidence now settles it: {settles.replace('_', ' ')}."
            )
        planned.changes.append(said)


def _open_items(run: Run, kind: str) -> Iterable[OutcomeItem]:
    return (
        OutcomeItem.objects.filter(run=run, kind=kind, state=OutcomeState.OPEN)
        .select_related("action", "checkpoint")
        .order_by("id")
    )


def cancel_refusal(run: Run) -> str:
    """Why a cancel of `run` changes nothing ("": it would cancel it): what
    Run.request_cancel refuses (lifecycle.CANCEL)."""
    if run.is_imported:
        return f"run {run.pk} is imported and read-only: cancel it where it runs"
    if run.is_finished:
        return f"run {run.pk} has already ended: {status_words(run)}"
    if run.cancel_requested_at is not None:
        return f"its cancel was already asked by {run.cancel_requested_by}"
    return ""


# -- the job ------------------------------------------------------------------------


class BulkJobQuerySet(models.QuerySet["BulkJob"]):
    def with_counts(self) -> BulkJobQuerySet:
        """Each job with its items counted by result, in one query."""
        return self.annotate(
            **{
                f"n_{result}": Count("items", filter=Q(items__result=result))
                for result in ItemResult.values
            }
        )

    def stalled(self, now: dt.datetime) -> BulkJobQuerySet:
        """Unfinished jobs nobody has moved for STALLED_AFTER: their worker
        died or their task was lost (bulk_job_unfinished_idx)."""
        return self.filter(state__in=UNFINISHED).filter(
            Q(progressed_at__lt=now - STALLED_AFTER)
            | Q(progressed_at__isnull=True, created_at__lt=now - STALLED_AFTER)
        )


class BulkJob(models.Model):
    """A bulk action an operator confirmed: its selection, the action, who
    asked and why.  Its items (one per run, written with it) say what
    became of each run."""

    request_token = models.CharField(max_length=TOKEN_MAX, unique=True)
    user = models.ForeignKey("auth.User", on_delete=models.PROTECT, related_name="+")
    requested_by = models.CharField(max_length=150)
    # The runs-list filter it was chosen by, as a query string ("" when
    # chosen by ids); the runs themselves are its items.
    filter_query = models.TextField(blank=True)
    action = models.CharField(max_length=20, choices=BulkAction)
    choice = models.CharField(max_length=30, choices=DecisionChoice, blank=True)
    kind = models.CharField(max_length=20, choices=OutcomeKind, blank=True)
    reason = models.TextField()
    cap = models.PositiveIntegerField(help_text="RUNDESK_BULK_MAX_RUNS when it was made")
    total = models.PositiveIntegerField()
    state = models.CharField(max_length=20, choices=BulkState, default=BulkState.QUEUED)
    stop_requested_by = models.CharField(max_length=150, blank=True)
    stop_requested_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(db_default=Now())
    started_at = models.DateTimeField(null=True, blank=True)
    progressed_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = BulkJobQuerySet.as_manager()

    class Meta:
        app_label = "runs"
        ordering = ["-created_at", "-id"]
        constraints = [
            models.CheckConstraint(condition=~Q(reason=""), name="bulk_job_says_why"),
            models.CheckConstraint(condition=Q(total__lte=models.F("cap")), name="bulk_job_capped"),
            # A decision names its choice and the kind of items; nothing else does.
            models.CheckConstraint(
                condition=(Q(action="decide") & ~Q(choice="") & ~Q(kind=""))
                | (~Q(action="decide") & Q(choice="", kind="")),
                name="bulk_job_decision_named",
            ),
            models.CheckConstraint(
                condition=Q(state__in=UNFINISHED, finished_at__isnull=True)
                | (~Q(state__in=UNFINISHED) & Q(finished_at__isnull=False)),
                name="bulk_job_finished_iff_ended",
            ),
        ]
        indexes = [
            # Serves BulkJob.objects.stalled(): beat's look for jobs nobody
            # moves, among the few unfinished ones.
            models.Index(
                fields=["created_at"],
                name="bulk_job_unfinished_idx",
                condition=Q(state__in=UNFINISHED),
            ),
        ]

    def __str__(self) -> str:
        return f"bulk job {self.pk}: {self.action} ({self.state})"

    @property
    def ask(self) -> Ask:
        return Ask(self.action, self.choice, self.kind)

    @property
    def is_finished(self) -> bool:
        return self.state not in UNFINISHED

    def counts(self) -> dict[str, int]:
        found = dict(self.items.values_list("result").annotate(n=Count("*")))
        return {result: found.get(result, 0) for result in ItemResult.values}

    def start(self) -> bool:
        """Whether a worker may work on it: queued (now running) or running
        (a worker died, or another works on it too: items are claimed one
        by one)."""
        now = timezone.now()
        BulkJob.objects.filter(pk=self.pk, state=BulkState.QUEUED).update(
            state=BulkState.RUNNING, started_at=now, progressed_at=now
        )
        self.refresh_from_db(fields=["state", "started_at", "progressed_at"])
        return self.state == BulkState.RUNNING

    def finish(self) -> bool:
        """Ends the job once no item is pending: done, or stopped if a stop
        was asked.  False while an item is pending (another worker, or a
        stop, holds it) or when it had ended already."""
        pending = BulkJobItem.objects.filter(job=OuterRef("pk"), result=ItemResult.PENDING)
        ended = (
            BulkJob.objects.filter(pk=self.pk, state__in=UNFINISHED)
            .exclude(Exists(pending))
            .update(
                state=models.Case(
                    models.When(stop_requested_at__isnull=True, then=models.Value(BulkState.DONE)),
                    default=models.Value(BulkState.STOPPED),
                ),
                finished_at=timezone.now(),
            )
        )
        return ended == 1

    def request_stop(self, by: str) -> int:
        """Stops the job: every item not yet taken becomes "not done:
        stopped by `by`" (the one a worker is carrying out finishes).  How
        many were stopped; 0 if it had ended, or a stop was asked before."""
        now = timezone.now()
        with transaction.atomic():
            asked = BulkJob.objects.filter(
                pk=self.pk, state__in=UNFINISHED, stop_requested_at__isnull=True
            ).update(stop_requested_by=by, stop_requested_at=now)
            if not asked:
                return 0
            untaken = list(
                self.items.filter(result=ItemResult.PENDING)
                .select_for_update(skip_locked=True)
                .values_list("pk", flat=True)
            )
            stopped = BulkJobItem.objects.filter(pk__in=untaken).update(
                result=ItemResult.STOPPED, detail=f"not done: stopped by {by}", finished_at=now
            )
            self.finish()
        return stopped


class BulkJobItem(models.Model):
    """One run of a job, and what became of it: done (what changed),
    refused (why), or not done (stopped)."""

    job = models.ForeignKey(BulkJob, on_delete=models.CASCADE, related_name="items")
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="+")
    result = models.CharField(max_length=20, choices=ItemResult, default=ItemResult.PENDING)
    detail = models.TextField(blank=True)
    # The decisions it recorded (resume, abandon, decide): the audit rows.
    decisions = ArrayField(models.BigIntegerField(), default=list, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        app_label = "runs"
        ordering = ["job", "id"]
        constraints = [
            models.UniqueConstraint(fields=["job", "run"], name="bulk_item_once_per_run"),
            models.CheckConstraint(
                condition=Q(result=ItemResult.PENDING, finished_at__isnull=True)
                | (~Q(result=ItemResult.PENDING) & Q(finished_at__isnull=False) & ~Q(detail="")),
                name="bulk_item_result_says_what",
            ),
        ]
        indexes = [
            # Serves the workers' claim: the next pending item of a job.
            models.Index(
                fields=["job", "id"], name="bulk_item_pending_idx", condition=Q(result="pending")
            ),
        ]

    def __str__(self) -> str:
        return f"run {self.run_id} of bulk job {self.job_id}: {self.result}"


@dataclass(frozen=True)
class Created:
    job: BulkJob
    repeated: bool = False  # the token was used before: that job stands


def create_job(
    ask: Ask,
    chosen: Selection,
    run_ids: Iterable[int],
    *,
    user: AbstractBaseUser,
    reason: str,
    token: str,
) -> Created:
    """The job for the runs a dry run said would change (`run_ids`), or
    the one made earlier with the same request token.  Refused says why."""
    if (earlier := by_token(token, user, ask)) is not None:
        return Created(earlier, repeated=True)
    ask.check()
    if not user.has_perm(OPERATE):
        raise Refused(f"{user.get_username()} may not act on runs: the operator permission")
    reason = reason.strip()
    if not reason:
        raise Refused("say why: a reason is required")
    if len(reason.replace("\r\n", "\n")) > REASON_MAX or UNSTORABLE.search(reason):
        raise Refused(f"the reason must be text of at most {REASON_MAX} characters")
    ids = list(dict.fromkeys(run_ids))
    if not ids:
        raise Refused("no run is selected")
    if len(ids) > cap():
        raise Refused(
            f"{len(ids)} runs are selected; a job acts on at most {cap()} "
            "(RUNDESK_BULK_MAX_RUNS): narrow the selection"
        )
    if missing := sorted(
        set(ids) - set(Run.objects.filter(pk__in=ids).values_list("pk", flat=True))
    ):
        raise Refused(f"there is no run {', '.join(map(str, missing))}")
    try:
        with transaction.atomic():
            job = BulkJob.objects.create(
                request_token=token,
                user=user,
                requested_by=user.get_username(),
                filter_query=chosen.query,
                action=ask.action,
                choice=ask.choice,
                kind=ask.kind,
                reason=reason,
                cap=cap(),
                total=len(ids),
            )
            BulkJobItem.objects.bulk_create(BulkJobItem(job=job, run_id=run_id) for run_id in ids)
    except IntegrityError:
        # The same token, committed by a concurrent confirm: that one stands.
        if (earlier := by_token(token, user, ask)) is not None:
            return Created(earlier, repeated=True)
        raise
    return Created(job)


def by_token(token: str, user: AbstractBaseUser, ask: Ask) -> BulkJob | None:
    """The job made earlier with this request token, by this user for
    this action; Refused when the token was another's."""
    if not token or len(token) > TOKEN_MAX or UNSTORABLE.search(token):
        raise Refused("the request token is missing or too long: reload the page")
    earlier = BulkJob.objects.filter(request_token=token).first()
    if earlier is None:
        return None
    if earlier.user_id != user.pk or earlier.ask != ask:
        raise Refused("this request token was used for another bulk job")
    return earlier


# -- carrying it out ----------------------------------------------------------------


@dataclass
class Outcome:
    """What one run's action did: done, or refused (why)."""

    done: bool
    detail: str
    decisions: list[int] = field(default_factory=list)


def process(job_id: int) -> str:
    """Carries out job `job_id`'s pending items, one at a time; what
    became of the job, in a word.  Idempotent: a job that ended is left
    alone, and another worker on the same job takes other items."""
    job = BulkJob.objects.filter(pk=job_id).select_related("user").first()
    if job is None:
        return "missing"
    if not job.start():
        return f"already_{job.state}"
    who = Who(user=job.user)
    said = 0.0
    while True:
        if _carry_out_next(job, who) is not None:
            if time.monotonic() - said >= PROGRESS_SECONDS:
                BulkJob.objects.filter(pk=job.pk).update(progressed_at=timezone.now())
                said = time.monotonic()
            continue
        if job.finish():
            break
        if not BulkJobItem.objects.filter(job=job, result=ItemResult.PENDING).exists():
            break  # ended meanwhile (a stop ended it)
        # Pending items someone holds (another worker's run, a stop being
        # written): they end within a decision's lock wait.
        time.sleep(0.1)
    job.refresh_from_db(fields=["state"])
    return job.state


def _carry_out_next(job: BulkJob, who: Who) -> int | None:
    """The next pending item, claimed (SKIP LOCKED) and carried out in one
    transaction with its result; its id, or None when none is left to take."""
    claimed: int | None = None
    try:
        with transaction.atomic():
            item = (
                BulkJobItem.objects.filter(job=job, result=ItemResult.PENDING)
                .order_by("id")
                .select_for_update(skip_locked=True)
                .first()
            )
            if item is None:
                return None
            claimed = item.pk
            outcome = act(job, item.run_id, who)
            _record(item.pk, outcome)
    except DatabaseError as error:
        if claimed is None:
            raise
        # Rolled back: the run's change with it.  Said, not retried forever.
        logger.warning("bulk job %s: run of item %s not acted on: %s", job.pk, claimed, error)
        with transaction.atomic():
            _record(
                claimed,
                Outcome(False, f"the database refused it ({str(error).strip()}): nothing changed"),
            )
    return claimed


def _record(item_id: int, outcome: Outcome) -> None:
    BulkJobItem.objects.filter(pk=item_id, result=ItemResult.PENDING).update(
        result=ItemResult.DONE if outcome.done else ItemResult.REFUSED,
        detail=outcome.detail,
        decisions=outcome.decisions,
        finished_at=timezone.now(),
    )


def act(job: BulkJob, run_id: int, who: Who) -> Outcome:
    """The job's action on one run, through the single action's path."""
    run = Run.objects.filter(pk=run_id).first()
    if run is None:
        return Outcome(False, f"run {run_id} is gone")
    # Checked again for each run, as a single action checks it: a job goes
    # on after its operator is removed or loses the permission (a worker, or
    # beat's redelivery, carries it on), and then acts no more.
    if not job.user.is_active or not job.user.has_perm(OPERATE):
        return Outcome(False, f"{job.requested_by} no longer has the operator permission")
    if job.action == BulkAction.CANCEL:
        return _cancel(job, run)
    if job.action in (BulkAction.RESUME, BulkAction.ABANDON):
        request = _request(job, who, f"run-{run_id}", job.action)
        try:
            decided = decide_run(run_id, request)
        except DecisionRefused as refused:
            return Outcome(False, str(refused))
        run.refresh_from_db(fields=["status", "status_reason"])
        said = "already done by this job" if decided.repeated else run.status_reason
        return Outcome(True, said, [decided.decision.pk])
    return _decide_items(job, run, who)


def _cancel(job: BulkJob, run: Run) -> Outcome:
    if why := cancel_refusal(run):
        return Outcome(False, why)
    reason = f"{job.reason} (bulk job {job.pk})"
    asked = unless_locked(lambda: run.request_cancel(by=job.requested_by, reason=reason), LOCK_WAIT)
    if asked is None:
        return Outcome(
            False, f"run {run.pk} is locked by another session: the cancel was not asked"
        )
    run.refresh_from_db()
    if not asked:
        return Outcome(False, cancel_refusal(run) or "it had already ended or was being cancelled")
    if run.status == RunStatus.RUNNING:
        return Outcome(True, "cancel asked: its owner stops it before its next boundary")
    return Outcome(True, f"ended: {run.status_reason}")


def _decide_items(job: BulkJob, run: Run, who: Who) -> Outcome:
    items = list(_open_items(run, job.kind))
    if not items:
        return Outcome(False, f"no open {plain(OutcomeKind, job.kind)} item")
    done, lines, decisions = 0, [], []
    for item in items:
        request = _request(job, who, f"item-{item.pk}", job.choice)
        try:
            decided = decide(item.pk, request)
        except DecisionRefused as refused:
            lines.append(f"item {item.pk}: refused: {refused}")
            continue
        done += 1
        decisions.append(decided.decision.pk)
        settled = decided.decision.state_after == OutcomeState.SETTLED
        lines.append(
            f"item {item.pk}: {decided.decision.get_choice_display()}: "
            + ("settled" if settled else "the evidence still cannot tell; it stays open")
            + ("; the run is back in the queue" if decided.run_resumed else "")
        )
    return Outcome(done == len(items), "\n".join(lines), decisions)


def _request(job: BulkJob, who: Who, about: str, choice: str) -> Request:
    """A decision of the job's: its token names the job and what it is
    about, so carrying it out again records nothing twice."""
    return Request(
        choice=choice,
        who=who,
        token=f"{TOKEN_PREFIX}{job.pk}:{about}",
        reason=job.reason,
        reference=f"bulk job {job.pk}",
    )

"""Fault drills: the essay's reverse checks, four questions asked on this
installation.

Each scenario creates one failure on purpose, on real runs in the
configured database (marked `is_drill`), and asks what must remain true:

1. committed_content_readable: what was committed before the failure can
   still be read (the final answer, every receipt, each verifying);
2. independent_work_continued: the work that does not depend on the
   failure went on (the run delivered its report);
3. original_action_executed_once: no action ran again by accident, counted
   outside the database (the tool journal: one line per real execution);
4. boundaries_kept: unknown writes stayed unknown until evidence settled
   them, a cancel or a lost lease stopped dispatch, nothing ran without its
   boundary.

Every answer comes from the data: "no exception was raised" answers none
of them.  A question that does not apply is None, with the reason in the
detail.  A scenario that cannot be staged here is `not_run`, with the
reason.

A drill touches nothing of production's: every lock it takes on a table
production writes (a trigger's DDL, another session's LOCK TABLE) is asked
for under a lock timeout of LOCK_TIMEOUT, so production's writes never queue
behind it for longer; a drill that cannot have its lock in that time gives
way, and its scenario is `not_run`, saying why.  What a drill killed
mid-scenario leaves behind (its triggers and their functions) is removed
when the next drill starts, and the report says so.

The runs use the bundled sample corpus, the offline model and a delivery
receiver of the drill's own (an outbox folder), whatever the installation
uses; what the drill locks or slows is scoped to its own runs where
PostgreSQL allows it (the table-lock scenarios lock evidence tables for a
few seconds: other runs' capture leaves gaps meanwhile, as it would).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import pwd
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from celery import current_app
from django.conf import settings
from django.db import DatabaseError, IntegrityError, connection, transaction
from django.db.models import F, Max
from django.db.models.functions import Greatest, Now
from django.test.utils import override_settings
from django.utils import timezone

import evidence.capture
from evidence.capture import Capture
from evidence.models import CaptureStats
from runs import decisions, submission
from runs.executor import Ending, claim_and_drive
from runs.harness import (
    WAIT_SECONDS,
    GroupProcess,
    Journal,
    database_url,
    evidence_tables,
    wait_for,
)
from runs.leases import Lease
from runs.models import (
    Action,
    ActionState,
    AnswerRevision,
    DecisionChoice,
    Drill,
    DrillResult,
    DrillState,
    DrillVerdict,
    EffectClass,
    OutcomeItem,
    OutcomeState,
    Run,
    RunStatus,
    action_identity,
    digest,
)
from runs.sql import lock_refused, waits_bounded
from runs.sweep import sweep
from runs.timeline import EventKind, timeline

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["northwind-clean-energy.md", "crestline-short-treasury.md", "meridian-world-equity.md"]
QUESTIONS = (
    "committed_content_readable",
    "independent_work_continued",
    "original_action_executed_once",
    "boundaries_kept",
)
# The longest a drill waits for a lock on a table production uses (and so
# the longest production's writes can queue behind that wait).
LOCK_TIMEOUT = "2s"
# What the drill's triggers and their functions are named (LIKE): what the
# next drill removes if a drill was killed before it removed its own.
LEFTOVERS = "rundesk\\_drill\\_%"


class NotRun(Exception):
    """The scenario cannot be staged on this installation (why)."""


@dataclass
class Finding:
    """The answers to the four questions, and what supports them."""

    answers: dict[str, bool | None] = field(default_factory=lambda: dict.fromkeys(QUESTIONS))
    detail: list[str] = field(default_factory=list)

    def answer(self, question: str, value: bool | None, why: str) -> None:
        self.answers[question] = value
        said = "n/a" if value is None else "yes" if value else "NO"
        self.detail.append(f"{question}: {said}: {why}")

    @property
    def passed(self) -> bool:
        return all(value is not False for value in self.answers.values())


class Lab:
    """One scenario's surroundings: its runs, its tool journal, its
    receiver, and the processes it started."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.journal = folder / "tool-journal.jsonl"
        self.outbox = folder / "outbox"
        self.runs: list[Run] = []
        self.processes: list[GroupProcess] = []

    @contextmanager
    def settings(self) -> Iterator[None]:
        with override_settings(
            RUNDESK_TOOL_JOURNAL=str(self.journal),
            RUNDESK_OUTBOX_DIR=self.outbox,
            RUNDESK_DELIVERY_URL="",
            RUNDESK_CORPUS_DIR=ROOT / "runs" / "agents" / "sample_corpus",
            RUNDESK_MODEL_PROVIDER="offline",
            RUNDESK_DRILL_LAB=True,
        ):
            yield

    def submit(self, faults: list[dict[str, Any]] | None = None) -> Run:
        run = submission.submit(
            question="Drill: compare these funds", documents=DOCS, faults=faults, drill=True
        )
        self.runs.append(run)
        return run

    def drive(self, run: Run) -> Ending:
        ending = claim_and_drive(run.pk)
        timeline.flush()
        run.refresh_from_db()
        return ending

    def executions(self) -> Counter[str]:
        return Journal(self.journal).counts()

    def env(self) -> dict[str, str]:
        """For a process of this installation working for the drill."""
        return {
            **os.environ,
            "DATABASE_URL": database_url(),
            "RUNDESK_TOOL_JOURNAL": str(self.journal),
            "RUNDESK_OUTBOX_DIR": str(self.outbox),
            "RUNDESK_CORPUS_DIR": str(ROOT / "runs" / "agents" / "sample_corpus"),
            "RUNDESK_MODEL_PROVIDER": "offline",
            "RUNDESK_DELIVERY_URL": "",
            "RUNDESK_VAR_DIR": str(settings.VAR_DIR),
            "RUNDESK_DRILL_LAB": "1",
            "PYTHONUNBUFFERED": "1",
        }

    def start(self, *args: str) -> GroupProcess:
        log = self.folder / f"process-{len(self.processes)}.log"
        process = GroupProcess([sys.executable, *args], self.env(), log)
        self.processes.append(process)
        return process

    def stop_processes(self) -> None:
        for process in self.processes:
            process.kill()


@contextmanager
def another_session(*statements: str) -> Iterator[psycopg.Connection[Any]]:
    """Another session runs `statements` in a transaction it keeps open
    (and its locks) until the block ends.  A lock it cannot have within
    LOCK_TIMEOUT: NotRun."""
    params = connection.get_connection_params()
    params["application_name"] = "rundesk:drill"
    with psycopg.connect(**params) as side:
        side.execute("SELECT set_config('lock_timeout', %s, true)", [LOCK_TIMEOUT])
        for statement in statements:
            try:
                side.execute(statement)
            except psycopg.errors.LockNotAvailable:
                raise NotRun(_gave_way(statement)) from None
        try:
            yield side
        finally:
            side.rollback()


def expire_lease(run: Run) -> None:
    """Fast-forwards a dead owner's lease to its expiry (what waiting the
    lease's time to live would do)."""
    Run.objects.filter(pk=run.pk).update(lease_expires_at=timezone.now() - dt.timedelta(seconds=1))


# -- what the drill does to tables production uses --------------------------------------


def _gave_way(what: str) -> str:
    return (
        f"{what}: another session held a lock it needs for longer than {LOCK_TIMEOUT}; "
        "the drill gave way rather than hold production's writes up"
    )


def _bounded(statement: str, what: str) -> None:
    """Runs `statement` (DDL on a table production writes; `what` says it
    in words) in a transaction whose lock waits end after LOCK_TIMEOUT:
    while it waits, production's writes to that table queue behind it, so
    not for longer.  NotRun when the lock was not granted."""
    try:
        with waits_bounded(LOCK_TIMEOUT), connection.cursor() as cursor:
            cursor.execute(statement)
    except DatabaseError as error:
        if lock_refused(error):
            raise NotRun(_gave_way(what)) from None
        raise


@contextmanager
def _trigger(run: Run, purpose: str, table: str, body: str) -> Iterator[None]:
    """A BEFORE INSERT trigger on `table` for `run`'s rows only, and its
    function (`body`: PL/pgSQL), created and dropped under LOCK_TIMEOUT.
    Named `rundesk_drill_<purpose>_<run>`: if the drill is killed before the
    drop, the next drill finds and removes them (remove_leftovers)."""
    name = f"rundesk_drill_{purpose}_{run.pk}"
    _bounded(
        f"""CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN {body} END $$;
            CREATE TRIGGER {name} BEFORE INSERT ON {table} FOR EACH ROW
            WHEN (NEW.run_id = {run.pk}) EXECUTE FUNCTION {name}()""",
        f"creating trigger {name} on {table}",
    )
    try:
        yield
    finally:
        _until_dropped(
            f"DROP TRIGGER IF EXISTS {name} ON {table}; DROP FUNCTION IF EXISTS {name}()",
            f"trigger {name} on {table} and its function",
        )


def _until_dropped(statement: str, what: str, attempts: int = 5) -> None:
    """A drop, asked for again while production's writes keep its table
    busy (each wait bounded: they go first); one still refused is left to
    the next drill's start, and this scenario says so."""
    for attempt in range(attempts):
        try:
            _bounded(statement, f"dropping {what}")
            return
        except NotRun:
            if attempt == attempts - 1:
                raise RuntimeError(
                    f"{what}: not removed, its table stayed locked; "
                    "the next drill removes it when it starts"
                ) from None
            time.sleep(0.5)


def remove_leftovers() -> list[str]:
    """Removes the triggers and functions a drill killed mid-scenario left
    behind (named LEFTOVERS), each under LOCK_TIMEOUT; says what it removed,
    and what it could not (the next drill tries again).  Called when a drill
    starts, while it is the one running (Drill: one at a time)."""
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT 'DROP TRIGGER IF EXISTS ' || quote_ident(t.tgname) || ' ON '
                      || t.tgrelid::regclass::text,
                      'trigger ' || t.tgname || ' on ' || t.tgrelid::regclass::text
               FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
               WHERE NOT t.tgisinternal AND t.tgname LIKE %(like)s
                 AND c.relnamespace = current_schema()::regnamespace
               UNION ALL
               SELECT 'DROP FUNCTION IF EXISTS ' || p.oid::regprocedure::text,
                      'function ' || p.oid::regprocedure::text
               FROM pg_proc p
               WHERE p.proname LIKE %(like)s AND p.pronamespace = current_schema()::regnamespace
               ORDER BY 1 DESC""",  # DROP TRIGGER before DROP FUNCTION
            {"like": LEFTOVERS},
        )
        found = cursor.fetchall()
    said = []
    for drop, what in found:
        try:
            _bounded(drop, f"removing {what}")
            said.append(f"removed {what}, left by a drill that was stopped")
        except NotRun:
            said.append(f"{what}: left by a drill that was stopped, not removed (locked)")
    return said


# -- the questions, from the data -----------------------------------------------------


def content_readable(finding: Finding, run: Run, *, expect_final: bool = True) -> None:
    """Q1: every receipt verifies; the final answer reads back whole."""
    actions = list(Action.objects.filter(run=run).select_related("receipt"))
    broken = [a.step_key for a in actions if hasattr(a, "receipt") and not a.receipt.verifies(a)]
    final = AnswerRevision.objects.filter(run=run, is_final=True).first()
    readable = final is not None and final.content_digest == digest(final.content)
    receipts = sum(hasattr(a, "receipt") for a in actions)
    if broken:
        finding.answer(QUESTIONS[0], False, f"receipts that do not verify: {broken}")
    elif expect_final and not readable:
        finding.answer(QUESTIONS[0], False, "no final answer that reads back")
    else:
        said = "the final answer reads back whole, " if readable else ""
        finding.answer(QUESTIONS[0], True, f"{said}{receipts} receipts verify")


def work_continued(finding: Finding, run: Run) -> None:
    """Q2: the run delivered its report, every document summarised."""
    summaries = Action.objects.filter(
        run=run, step_key__startswith="summarize:", state=ActionState.COMPLETED
    ).count()
    delivered = Action.objects.filter(
        run=run, step_key="deliver", state=ActionState.COMPLETED
    ).exists()
    done = run.status == RunStatus.COMPLETED and delivered and summaries == len(DOCS)
    finding.answer(
        QUESTIONS[1],
        done,
        f"run {run.pk} {run.status}, {summaries} of {len(DOCS)} documents summarised, "
        f"report {'delivered' if delivered else 'not delivered'}",
    )


def executed_once(finding: Finding, lab: Lab, runs: list[Run]) -> None:
    """Q3: each action ran at most as often as its boundary was armed (a
    read without receipt is sent again under its identity); an effect and
    every action with a receipt from the first attempt ran once."""
    counts = lab.executions()
    problems, total = [], 0
    for action in Action.objects.filter(run__in=runs):
        ran = counts[action_identity(action.run_id, action.step_key)]
        total += ran
        once = action.attempts == 1 or action.effect_class == EffectClass.EFFECT
        if ran > (1 if once else action.attempts):
            problems.append(f"{action.step_key} ran {ran} times ({action.attempts} attempts)")
    finding.answer(
        QUESTIONS[2],
        not problems,
        "; ".join(problems) or f"{total} real executions, none repeated by accident",
    )


def boundaries(finding: Finding, lab: Lab, runs: list[Run], *also: tuple[bool, str]) -> None:
    """Q4: nothing ran without its boundary, every receipt is its own
    epoch's; and what the scenario adds (`also`: (kept, what))."""
    identities = {
        action_identity(a.run_id, a.step_key) for a in Action.objects.filter(run__in=runs)
    }
    unbounded = sorted(set(lab.executions()) - identities)
    problems = [f"ran without a boundary: {unbounded}"] if unbounded else []
    stale = Action.objects.filter(run__in=runs, receipt__isnull=False).exclude(
        receipt__epoch=F("epoch")
    )
    problems += [f"{a.step_key}: receipt of another epoch" for a in stale]
    problems += [what for kept, what in also if not kept]
    kept = [what for ok, what in also if ok]
    finding.answer(
        QUESTIONS[3],
        not problems,
        "; ".join(problems) or "; ".join(["every execution had its boundary", *kept]),
    )


def full_run_answers(lab: Lab, run: Run, *also: tuple[bool, str]) -> Finding:
    finding = Finding()
    content_readable(finding, run)
    work_continued(finding, run)
    executed_once(finding, lab, [run])
    boundaries(finding, lab, [run], *also)
    return finding


def gaps_of(run: Run) -> int:
    stats = CaptureStats.objects.filter(run=run).first()
    return stats.lost if stats else 0


# -- the scenarios ----------------------------------------------------------------------


def capture_row_lock(lab: Lab) -> Finding:
    """Capture blocked by a row lock: another session holds the run's
    capture counters FOR UPDATE for the whole run."""
    run = lab.submit()
    CaptureStats.objects.create(run=run)
    with another_session(f"SELECT 1 FROM evidence_capturestats WHERE run_id = {run.pk} FOR UPDATE"):
        lab.drive(run)
        evidence.capture.capture.flush()
    evidence.capture.capture.flush()
    lost = gaps_of(run)
    return full_run_answers(lab, run, (lost > 0, f"capture left {lost} gaps, never waited"))


def _tables_locked(lab: Lab, tables: list[str], mode: str) -> Finding:
    run = lab.submit()
    with another_session(f"LOCK TABLE {', '.join(tables)} IN {mode} MODE"):
        lab.drive(run)
        evidence.capture.capture.flush()
    evidence.capture.capture.flush()
    lost = gaps_of(run)
    return full_run_answers(
        lab, run, (lost > 0, f"{', '.join(tables)} locked ({mode}): {lost} gaps, never waited")
    )


def capture_table_lock(lab: Lab) -> Finding:
    """Capture blocked by a table lock on the model records."""
    return _tables_locked(lab, ["evidence_modelcall"], "ACCESS EXCLUSIVE")


def evidence_tables_locked(lab: Lab) -> Finding:
    """Every evidence table locked (ACCESS EXCLUSIVE) for the whole run."""
    return _tables_locked(lab, evidence_tables(), "ACCESS EXCLUSIVE")


@contextmanager
def _capture_writer(writer: Capture) -> Iterator[Capture]:
    """The capture writer runs use, for the block (then the installed one again)."""
    installed, evidence.capture.capture = evidence.capture.capture, writer
    try:
        yield writer
    finally:
        evidence.capture.capture = installed
        writer.stop()


def capture_queue_full(lab: Lab) -> Finding:
    """The capture queue is full: a writer with room for one record, stuck
    behind a locked model-record table."""
    run = lab.submit()
    with (
        _capture_writer(Capture(capacity=1)) as writer,
        another_session("LOCK TABLE evidence_source IN ACCESS EXCLUSIVE MODE"),
    ):
        lab.drive(run)
        writer.flush()
    lost = gaps_of(run)
    return full_run_answers(
        lab, run, (lost > 0, f"a full queue: {lost} gaps, the run never waited")
    )


def database_stalled_for_capture(lab: Lab) -> Finding:
    """The database stalls capture: each of the run's source rows takes 3 s
    to insert (a trigger, on this run's rows only)."""
    run = lab.submit()
    with _trigger(run, "stall", "evidence_source", "PERFORM pg_sleep(3); RETURN NEW;"):
        try:
            started = time.monotonic()
            lab.drive(run)
            took = time.monotonic() - started
        finally:
            evidence.capture.capture.flush(timeout=30)
    return full_run_answers(
        lab, run, (took < 9, f"the run took {took:.1f} s while capture stalled 9 s")
    )


def checkpoint_fails_before_write(lab: Lab) -> Finding:
    """The checkpoint after action 1 fails before writing."""
    run = lab.submit([{"point": "checkpoint_serialize_error", "action": 1}])
    lab.drive(run)
    failed = run.checkpoints.filter(outcome="failed_before_write").count()
    return full_run_answers(
        lab,
        run,
        (failed == 1, "the failed checkpoint is recorded; the phase stayed research"),
        (run.phase_reason == "", "no record-keeping failure moved the run to finalizing"),
    )


def _commit_lost(lab: Lab, write: str, action: int) -> Finding:
    run = lab.submit([{"point": "drop_connection_at_commit", "write": write, "action": action}])
    lab.drive(run)
    kinds = set(run.events.values_list("kind", flat=True))
    unanswered = EventKind.COMMIT_UNANSWERED in kinds
    settled = (
        EventKind.OUTCOME_SETTLED in kinds
        and not OutcomeItem.objects.filter(run=run, state=OutcomeState.OPEN).exists()
    )
    return full_run_answers(
        lab,
        run,
        (unanswered, f"the {write} COMMIT went unanswered and was recorded as unknown"),
        (settled, "its xid settled it; nothing was assumed or written twice"),
    )


def checkpoint_commit_lost(lab: Lab) -> Finding:
    """The answer to a checkpoint's COMMIT is lost (it committed)."""
    return _commit_lost(lab, "checkpoint", 1)


def receipt_commit_lost(lab: Lab) -> Finding:
    """The answer to a receipt's COMMIT is lost (it committed)."""
    return _commit_lost(lab, "receipt", 2)


def boundary_commit_lost(lab: Lab) -> Finding:
    """The answer to a boundary's COMMIT is lost (it committed): the
    boundary of action 2, carrying the receipt of the read before it."""
    return _commit_lost(lab, "boundary", 2)


def publication_commit_lost(lab: Lab) -> Finding:
    """The answer to the draft's publication COMMIT is lost (it committed)."""
    return _commit_lost(lab, "publication", 2)


def delivery_answer_lost(lab: Lab) -> Finding:
    """The report is delivered but the answer is lost: the run waits in the
    inbox; the drill's receiver (its outbox) is asked, and a system
    decision settles the item with what it holds."""
    run = lab.submit([{"point": "delivery_timeout"}])
    first = lab.drive(run)
    item = OutcomeItem.objects.filter(run=run, state=OutcomeState.OPEN).first()
    waited = first == Ending.NEEDS_OPERATOR and item is not None
    received = sorted(lab.outbox.glob("*")) if lab.outbox.exists() else []
    if item is not None:
        decisions.decide(
            item.pk,
            decisions.Request(
                choice=DecisionChoice.CONFIRMED_HAPPENED,
                who=decisions.Who(system="drill"),
                token=f"drill-{run.pk}-{item.pk}",
                reason=f"the drill's receiver holds the report: {received[0].name}"
                if received
                else "",
                reference=received[0].name if received else "",
            ),
        )
    lab.drive(run)
    return full_run_answers(
        lab,
        run,
        (waited, "the lost answer became an open item; the run waited, nothing resent"),
        (len(received) == 1, f"the receiver holds {len(received)} report(s)"),
    )


def lease_stolen(lab: Lab) -> Finding:
    """Another owner takes the lease before action 3; once its lease
    lapses, a new owner resumes the run from its receipts."""
    run = lab.submit([{"point": "lease_stolen", "action": 3}])
    first = lab.drive(run)
    expire_lease(run)
    lab.drive(run)
    epochs = set(run.actions.values_list("epoch", flat=True))
    return full_run_answers(
        lab,
        run,
        (first == Ending.LEASE_LOST, "the old owner stopped at its next fenced write"),
        (len(epochs) >= 2, f"the work was split over epochs {sorted(epochs)}"),
    )


def cancel_mid_run(lab: Lab) -> Finding:
    """A cancel arrives before action 3."""
    run = lab.submit([{"point": "cancel", "action": 3}])
    ending = lab.drive(run)
    finding = Finding()
    content_readable(finding, run, expect_final=False)
    finding.answer(QUESTIONS[1], None, "a cancel ends the run: no work is to continue")
    executed_once(finding, lab, [run])
    later = run.actions.exclude(step_key__in=["read:0", "summarize:0"]).count()
    boundaries(
        finding,
        lab,
        [run],
        (ending == Ending.CANCELLED, f"the run ended {ending}"),
        (later == 0, f"{later} actions dispatched after the cancel"),
    )
    return finding


def cancel_of_dead_owner(lab: Lab) -> Finding:
    """A run whose owner died is cancelled; the sweep ends it."""
    run = lab.submit()
    dead = Lease.claim(run.pk, "drill:dead-owner")
    assert dead is not None
    run.request_cancel(by="the drill")
    expire_lease(run)
    swept = sweep()
    run.refresh_from_db()
    finding = Finding()
    content_readable(finding, run, expect_final=False)
    finding.answer(QUESTIONS[1], None, "a cancel ends the run: no work is to continue")
    executed_once(finding, lab, [run])
    boundaries(
        finding,
        lab,
        [run],
        (run.pk in swept.cancelled and run.status == RunStatus.CANCELLED, "the sweep ended it"),
        (not run.actions.exists(), "nothing was dispatched for it"),
    )
    return finding


def _slow_run(lab: Lab) -> Run:
    return lab.submit([{"point": "tool_delay", "ms": 300}])


def _receipts(run: Run) -> int:
    return Action.objects.filter(run=run, receipt__isnull=False).count()


def executor_killed(lab: Lab) -> Finding:
    """An executor process is SIGKILLed mid-run; another owner resumes it."""
    run = _slow_run(lab)
    process = lab.start("manage.py", "executor", "--run", str(run.pk))
    wait_for(lambda: _receipts(run) >= 3, "the executor's third receipt")
    process.kill()
    expire_lease(run)
    lab.drive(run)
    return full_run_answers(lab, run, (run.lease_epoch >= 2, "a new epoch resumed the run"))


def _worker(lab: Lab) -> GroupProcess:
    return lab.start(
        "-m", "celery", "-A", "dashboard", "worker", "--pool", "solo",
        "--without-heartbeat", "--without-mingle", "--without-gossip",
    )  # fmt: skip


def celery_worker_killed(lab: Lab) -> Finding:
    """A Celery worker is SIGKILLed mid-run with no executor running; the
    beat's sweep (its task, run by a worker) hands the run to another."""
    run = _slow_run(lab)
    worker = _worker(lab)
    current_app.send_task(
        "runs.tasks.execute_run", args=[run.pk], queue=settings.RUNDESK_DRILL_QUEUE
    )
    wait_for(lambda: _receipts(run) >= 3, "the worker's third receipt")
    worker.kill()
    _worker(lab)
    expire_lease(run)
    current_app.send_task("runs.tasks.sweep", queue=settings.RUNDESK_DRILL_QUEUE)
    wait_for(lambda: Run.objects.get(pk=run.pk).status == RunStatus.COMPLETED, "completion")
    timeline.flush()
    run.refresh_from_db()
    return full_run_answers(lab, run, (run.lease_epoch >= 2, "another worker resumed the run"))


def _trigger_on_receipts(run: Run, body: str) -> contextlib.AbstractContextManager[None]:
    """A trigger on runs_receipt for this run's rows only (`body`: PL/pgSQL
    that may change NEW or return NULL to drop the row)."""
    return _trigger(run, "receipt", "runs_receipt", body)


def _no_local_handling(lab: Lab, run: Run, ending: Ending, bad: str, said: str) -> Finding:
    """The run found the receipt of `bad` untrustworthy: it must wait for
    an operator, with nothing dispatched or published after that action."""
    finding = Finding()
    # The bad receipt is the fault itself: what must be readable is the
    # run's own account of why it stopped.
    finding.answer(
        QUESTIONS[0],
        said in run.status_reason,
        f"the run says why it stopped: {run.status_reason}",
    )
    finding.answer(QUESTIONS[1], None, "the run must wait for an operator: nothing is to continue")
    action = run.actions.get(step_key=bad)
    after = run.actions.filter(pk__gt=action.pk)
    published = AnswerRevision.objects.filter(run=run, committed_at__gt=action.dispatched_at)
    executed_once(finding, lab, [run])
    boundaries(
        finding,
        lab,
        [run],
        (ending == Ending.NEEDS_OPERATOR, f"the run ended {ending}: it waits for an operator"),
        (not after.exists(), f"nothing was dispatched after {bad}"),
        (not published.exists(), f"nothing was published after {bad}"),
    )
    return finding


def invented_receipt(lab: Lab) -> Finding:
    """The receipt of read:0 does not verify (its digest is invented) and
    the checkpoint after it fails: no local handling."""
    run = lab.submit([{"point": "checkpoint_serialize_error", "action": 1}])
    body = "IF NEW.step_key = 'read:0' THEN NEW.result_digest := repeat('0', 64); END IF;"
    body += " RETURN NEW;"
    with _trigger_on_receipts(run, body):
        ending = lab.drive(run)
    return _no_local_handling(lab, run, ending, "read:0", "does not verify")


def missing_receipt(lab: Lab) -> Finding:
    """read:1 completed but its receipt never reached the database: the
    next owner finds an action completed without its receipt."""
    run = lab.submit()
    body = "IF NEW.step_key = 'read:1' THEN RETURN NULL; END IF; RETURN NEW;"
    with _trigger_on_receipts(run, body):
        lab.drive(run)
    expire_lease(run)
    ending = lab.drive(run)
    return _no_local_handling(lab, run, ending, "read:1", "receipt is missing")


def restart_embedded_postgres(data: Path) -> None:
    """`pg_ctl restart` of the embedded server, as the user it runs as
    (pgserver runs it as its own user when started by root)."""
    from pgserver._commands import pg_ctl  # the embedded server's own tools

    owner = pwd.getpwuid(data.stat().st_uid).pw_name if os.geteuid() == 0 else None
    pg_ctl(["-w", "-m", "fast", "restart"], pgdata=data, user=owner, timeout=60)


def postgres_restarted(lab: Lab) -> Finding:
    """PostgreSQL restarts mid-run; the run resumes from its receipts."""
    data = Path(settings.VAR_DIR) / "postgres"
    if why := restart_refused(data):
        raise NotRun(why)
    run = _slow_run(lab)
    process = lab.start("manage.py", "executor", "--run", str(run.pk))
    wait_for(lambda: _receipts(run) >= 3, "the executor's third receipt")
    before = _server_started()
    connection.close()
    restart_embedded_postgres(data)
    restarted = _server_started() != before
    # The executor either rides the restart out (a lost statement raises,
    # the lease decides) or stops; then another owner finishes the run.
    process.wait(timeout=WAIT_SECONDS)
    run.refresh_from_db()
    if run.status != RunStatus.COMPLETED:
        expire_lease(run)
        lab.drive(run)
    return full_run_answers(
        lab, run, (restarted, "PostgreSQL restarted while the run was at its third receipt")
    )


def restart_refused(data: Path) -> str | None:
    """Why the drill may not restart the database it uses, or None: it
    restarts only the embedded server it runs from `data`, and only if that
    is the one in use.  Asked of the server itself, not of DATABASE_URL:
    `make demo` hands the embedded server's address to its processes in
    DATABASE_URL, and another server's address may be set there too."""
    refused = "the drill does not control this PostgreSQL"
    if not (data / "postmaster.pid").exists():
        return f"{refused}: no embedded PostgreSQL runs from {data}; the database is another's"
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('data_directory')")
            served = Path(cursor.fetchone()[0])
    except DatabaseError as error:
        return f"{refused}: it would not say where it is served from ({error})"
    if served.resolve() != data.resolve():
        return f"{refused}: it is served from {served}, not by the embedded one in {data}"
    return None


def _server_started() -> Any:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_postmaster_start_time()")
        return cursor.fetchone()[0]


# -- running them -------------------------------------------------------------------------

SCENARIOS: dict[str, Callable[[Lab], Finding]] = {
    "capture_row_lock": capture_row_lock,
    "capture_table_lock": capture_table_lock,
    "evidence_tables_locked": evidence_tables_locked,
    "capture_queue_full": capture_queue_full,
    "database_stalled_for_capture": database_stalled_for_capture,
    "checkpoint_fails_before_write": checkpoint_fails_before_write,
    "checkpoint_commit_lost": checkpoint_commit_lost,
    "receipt_commit_lost": receipt_commit_lost,
    "boundary_commit_lost": boundary_commit_lost,
    "publication_commit_lost": publication_commit_lost,
    "delivery_answer_lost": delivery_answer_lost,
    "lease_stolen": lease_stolen,
    "cancel_mid_run": cancel_mid_run,
    "cancel_of_dead_owner": cancel_of_dead_owner,
    "executor_killed": executor_killed,
    "celery_worker_killed": celery_worker_killed,
    "invented_receipt": invented_receipt,
    "missing_receipt": missing_receipt,
    "postgres_restarted": postgres_restarted,
}


def describe(name: str) -> str:
    """A scenario's one-line description (its docstring's first sentence)."""
    return " ".join((SCENARIOS[name].__doc__ or "").split()).split(": ")[0]


def run_scenario(drill: Drill, name: str) -> DrillResult:
    """Stages one scenario, answers its questions, and keeps the answers.
    A scenario that raises fails, with the error as its detail."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"rundesk-drill-{name}-") as folder:
        lab = Lab(Path(folder))
        try:
            with lab.settings():
                finding = SCENARIOS[name](lab)
            verdict = DrillVerdict.PASSED if finding.passed else DrillVerdict.FAILED
            answers, detail = finding.answers, "\n".join(finding.detail)
        except NotRun as reason:
            verdict, answers, detail = DrillVerdict.NOT_RUN, dict.fromkeys(QUESTIONS), str(reason)
        except Exception as error:
            verdict, answers = DrillVerdict.FAILED, dict.fromkeys(QUESTIONS)
            detail = f"the scenario could not finish: {error!r}"
            connection.close_if_unusable_or_obsolete()
        finally:
            lab.stop_processes()
    return DrillResult.objects.create(
        drill=drill,
        scenario=name,
        verdict=verdict,
        seconds=round(time.monotonic() - started, 2),
        checks=answers,  # the column keeps its name (schema)
        detail=detail,
        run_ids=[run.pk for run in lab.runs],
    )


# A running drill that has shown no result for this long is taken as lost
# (its worker died, its task never came): it no longer holds back the next.
# A scenario takes seconds; the slowest waits about 10 s.
LOST_AFTER = dt.timedelta(minutes=10)


class DrillRunning(Exception):
    """Another drill is running: one at a time."""

    def __init__(self, drill: Drill) -> None:
        super().__init__(
            f"drill {drill.pk} is running (started by {drill.started_by} at "
            f"{timezone.localtime(drill.started_at):%Y-%m-%d %H:%M:%S})"
        )
        self.drill = drill


def start_drill(scenarios: list[str], started_by: str) -> Drill:
    """A new running drill, unless another one runs (DrillRunning; the
    database keeps it to one, however many ask at once).  A running drill
    silent for LOST_AFTER is ended as lost first."""
    silent = (
        Drill.objects.filter(state=DrillState.RUNNING)
        .annotate(last=Greatest("started_at", Max("results__created_at")))
        .filter(last__lt=Now() - LOST_AFTER)
        .values_list("pk", flat=True)
    )
    Drill.objects.filter(pk__in=list(silent), state=DrillState.RUNNING).update(
        state=DrillState.DONE,
        finished_at=Now(),
        error=f"lost: no result for {LOST_AFTER.total_seconds() / 60:g} minutes "
        "(its worker died, or its task never came)",
    )
    try:
        with transaction.atomic():
            return Drill.objects.create(scenarios=scenarios, started_by=started_by)
    except IntegrityError:
        running = Drill.objects.filter(state=DrillState.RUNNING).first()
        if running is None:  # it ended meanwhile
            return start_drill(scenarios, started_by)
        raise DrillRunning(running) from None


@dataclass(frozen=True)
class Drilled:
    """What a drill did: its scenarios' results, and what earlier drills had
    left behind that it removed first (remove_leftovers)."""

    results: list[DrillResult]
    leftovers: list[str]


def run_drill(drill: Drill) -> Drilled:
    """Runs the drill's scenarios in order, each result kept as it comes,
    while the drill is still running: one ended meanwhile (taken as lost,
    or already run by a task delivered twice) runs no further scenario, so
    it cannot run beside the drill started after it.  First, while it is
    the one running, it removes what a drill killed mid-scenario left."""
    running = Drill.objects.filter(pk=drill.pk, state=DrillState.RUNNING)
    results: list[DrillResult] = []
    leftovers: list[str] = []
    try:
        if running.exists():
            leftovers = remove_leftovers()
        for name in drill.scenarios:
            if not running.exists():
                return Drilled(results, leftovers)
            results.append(run_scenario(drill, name))
    except BaseException as error:
        running.update(state=DrillState.DONE, finished_at=timezone.now(), error=repr(error))
        raise
    running.update(state=DrillState.DONE, finished_at=timezone.now())
    return Drilled(results, leftovers)


def report(drilled: Drilled) -> dict[str, Any]:
    """The drill's JSON: each scenario with its verdict (and why, when it was
    not run), how many passed, failed, did not run, and what was left by an
    earlier drill and removed."""
    verdicts = Counter(result.verdict for result in drilled.results)
    return {
        "scenarios": [
            {
                "name": result.scenario,
                "verdict": result.verdict,
                **({"why": result.detail} if result.verdict == DrillVerdict.NOT_RUN else {}),
                "seconds": result.seconds,
                "checks": {question: result.checks.get(question) for question in QUESTIONS},
                "detail": result.detail,
            }
            for result in drilled.results
        ],
        "passed": verdicts[DrillVerdict.PASSED],
        "failed": verdicts[DrillVerdict.FAILED],
        "not_run": verdicts[DrillVerdict.NOT_RUN],
        "leftovers_removed": drilled.leftovers,
    }

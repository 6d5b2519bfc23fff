"""Fault drills: the essay's reverse checks, four questions asked on this
installation, of every agent installed here that declares a drill input.

Each scenario creates one failure on purpose, on real runs of one agent in
the configured database (marked `is_drill`), and asks what must remain true:

1. committed_content_readable: what was committed before the failure can
   still be read (the final answer, every receipt, each verifying);
2. independent_work_continued: the work that does not depend on the
   failure went on (the run did all that a clean run of its agent does);
3. original_action_executed_once: no action ran again by accident, counted
   outside the database (the tool journal: one line per real execution);
4. boundaries_kept: unknown writes stayed unknown until evidence settled
   them, a cancel or a lost lease stopped dispatch, nothing ran without its
   boundary.

Every answer comes from the data: "no exception was raised" answers none
of them.  A question that does not apply is None, with the reason in the
detail.  A scenario that cannot be staged here, or does not apply to an
agent (a lost effect's answer, for an agent with no effect), is `not_run`,
with the reason.

The drills know no agent.  Before its scenarios, a drill learns each
agent's sequence from a clean run in the lab (`learn`): its actions in
order, with their effect classes, which boundary writes carry the receipts
of reads before them, after which a checkpoint is saved, when it publishes,
what capture keeps of it.  Each scenario then places its fault by role
("the first effect", "an action after which a checkpoint is saved"), and
says which action that was.

A drill touches nothing of production's: every lock it takes on a table
production writes (a trigger's DDL, another session's LOCK TABLE) is asked
for under a lock timeout of LOCK_TIMEOUT, so production's writes never queue
behind it for longer; a drill that cannot have its lock in that time gives
way, and its scenario is `not_run`, saying why.  What a drill killed
mid-scenario leaves behind (its triggers and their functions) is removed
when the next drill starts, and the report says so.

The runs are on each agent's drill input, the bundled sample corpus, the
offline model and a delivery receiver of the drill's own (an outbox
folder), whatever the installation uses; what the drill locks or slows is
scoped to its own runs where PostgreSQL allows it (the table-lock scenarios
lock evidence tables for a few seconds: other runs' capture leaves gaps
meanwhile, as it would).
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
from django.db.models import F, Max, Sum
from django.db.models.functions import Greatest, Now
from django.test.utils import override_settings
from django.utils import timezone

import evidence.capture
from evidence.capture import Capture
from evidence.models import CaptureGap, CaptureStats, ModelCall, Source
from runs import decisions, registry, submission
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
    Checkpoint,
    CheckpointOutcome,
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
    """The scenario cannot be staged on this installation, or does not
    apply to the agent (why)."""


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


# -- the agents, and what a clean run of each does ---------------------------------------


def drillable() -> list[str]:
    """The installed agents that declare a drill input: those a drill runs
    against unless told."""
    return [name for name, agent in registry.installed().items() if agent.drill_input is not None]


def undrilled() -> list[str]:
    """The installed agents that declare no drill input (one whose effects
    wait for a person's approval, say): a drill skips them unless told."""
    drilled = set(drillable())
    return [name for name in registry.installed() if name not in drilled]


def chosen_agents(names: list[str] | None) -> list[str]:
    """The agents a drill is to run against: `names` (in order, once
    each), or every drillable one.  ValueError says why one cannot be."""
    if not names:
        found = drillable()
        if not found:
            raise ValueError("no installed agent declares a drill input (Agent.drill_input)")
        return found
    for name in names:
        try:
            agent = registry.agent_class(name)
        except registry.NotInstalled as error:
            raise ValueError(
                f"{error} (installed: {', '.join(sorted(registry.installed()))})"
            ) from None
        if agent.drill_input is None:
            raise ValueError(
                f"agent {name!r} declares no drill input (Agent.drill_input): "
                "the drills have nothing to run it on"
            )
    return list(dict.fromkeys(names))


@dataclass(frozen=True)
class Stride:
    """One action of a clean run, in the order the run dispatched them:
    `number` is what a fault plan's "action K" counts (runs/faults.py)."""

    number: int
    key: str
    effect: EffectClass
    # Which boundary write dispatched it (reads side by side share one: a
    # fault "before action K" meets the write whose last action is K).
    write: int
    last_of_write: bool
    # Its boundary write carried the receipts of reads before it.
    carries: bool
    # Its own receipt went with a later action's boundary write.
    carried: bool
    # A checkpoint is saved after it (by an agent that saves them).
    checkpoint: bool
    # Its execution left a line in the tool journal.
    journaled: bool
    completed: bool

    def said(self, role: str) -> str:
        return f"action {self.number} ({self.key}, {role})"


@dataclass(frozen=True)
class Sequence:
    """What a clean run of an agent does, learned in the lab (`learn`):
    where each scenario places its fault, by role; NotRun, saying why,
    when the agent has no such action."""

    agent: str
    strides: tuple[Stride, ...]
    # The actions taken when each revision was published, in order.
    publications: tuple[int, ...]
    # What capture kept of it: "source" (documents read), "model_call".
    captured: frozenset[str]
    saves_checkpoints: bool
    runs: tuple[int, ...]

    def first(self, role: str, holds: Callable[[Stride], bool]) -> Stride:
        found = next((stride for stride in self.strides if holds(stride)), None)
        if found is None:
            raise NotRun(f"a clean run of {self.agent} has no {role}")
        return found

    def first_effect(self) -> Stride:
        return self.first("effect", lambda s: s.effect == EffectClass.EFFECT)

    def checkpointed(self) -> Stride:
        if not self.saves_checkpoints:
            raise NotRun(f"{self.agent} saves no checkpoints (Agent.saves_checkpoints)")
        return self.first("action after which a checkpoint is saved", lambda s: s.checkpoint)

    def later_read(self) -> Stride:
        return self.first(
            "read after its first action", lambda s: s.effect == EffectClass.READ and s.number > 1
        )

    def carrier(self) -> Stride:
        return self.first("boundary write that carries the receipts of reads", lambda s: s.carries)

    def carried(self) -> Stride:
        return self.first("read whose receipt goes with a later boundary", lambda s: s.carried)

    def first_publication(self) -> int:
        """The actions taken when the run first publishes after its first
        action (a fault plan's action K of a publication)."""
        found = next((taken for taken in self.publications if taken >= 1), None)
        if found is None:
            raise NotRun(f"a clean run of {self.agent} publishes nothing after its first action")
        return found

    def mid_run(self) -> Stride:
        """Where a run is stopped mid-way: the first boundary write after
        its first publication, or else its last; never its first."""
        points = [s for s in self.strides if s.last_of_write and s.write > 0]
        if not points:
            raise NotRun(f"a clean run of {self.agent} dispatches all its actions at once")
        published = self.publications[0] if self.publications else None
        after = [s for s in points if published is not None and self.first_of(s) > published]
        return after[0] if after else points[-1]

    def first_of(self, stride: Stride) -> int:
        """The number of the first action of `stride`'s boundary write."""
        return min(s.number for s in self.strides if s.write == stride.write)

    def before(self, stride: Stride) -> list[str]:
        """The actions dispatched before `stride`'s boundary write."""
        return [s.key for s in self.strides if s.write < stride.write]

    def mid_read(self) -> Stride:
        """A read in flight mid-run, before any effect: a process killed
        then leaves reads to send again, and no effect in doubt."""
        effect = next((s.number for s in self.strides if s.effect == EffectClass.EFFECT), None)
        reads = [s for s in self.strides if effect is None or s.number < effect]
        if not reads:
            raise NotRun(f"a clean run of {self.agent} reads nothing before its first effect")
        return reads[len(reads) // 2]

    @property
    def journals(self) -> bool:
        return any(stride.journaled for stride in self.strides)

    def needs_capture(self, kinds: set[str], what: str) -> None:
        if not self.captured & kinds:
            raise NotRun(f"capture keeps no {what} of {self.agent}'s runs: there is none to block")


def learn(agent: str) -> Sequence:
    """`agent`'s sequence, from clean runs in a lab of their own: one as
    scenarios run it; one more saving every checkpoint the agent asks for
    (an agent that saves them), to learn after which actions it does.
    NotRun when a clean run does not complete here: no scenario can be
    judged against it."""
    declared = registry.agent_class(agent)
    with tempfile.TemporaryDirectory(prefix=f"rundesk-drill-{agent}-clean-") as folder:
        lab = Lab(Path(folder), agent)
        with lab.settings():
            run = lab.clean()
            checkpointed: set[str] = set()
            if declared.saves_checkpoints():
                with override_settings(RUNDESK_CHECKPOINT_EVERY=1):
                    again = lab.clean()
                checkpointed = set(
                    Checkpoint.objects.filter(
                        run=again, outcome=CheckpointOutcome.COMMITTED
                    ).values_list("after_action__step_key", flat=True)
                )
            evidence.capture.capture.flush()
        journal = lab.executions()
    actions = list(Action.objects.filter(run=run).select_related("receipt").order_by("pk"))
    # A boundary write is one statement: its actions and the receipts it
    # carries share its transaction's now().
    receipts = {a.pk: a.receipt.created_at for a in actions if hasattr(a, "receipt")}
    writes: dict[dt.datetime, int] = {}
    for action in actions:
        writes.setdefault(action.created_at, len(writes))
    strides = tuple(
        Stride(
            number=number,
            key=action.step_key,
            effect=EffectClass(action.effect_class),
            write=writes[action.created_at],
            last_of_write=number == len(actions) or actions[number].created_at != action.created_at,
            carries=any(at == action.created_at for at in receipts.values()),
            carried=receipts.get(action.pk) in writes,
            checkpoint=action.step_key in checkpointed,
            journaled=journal[action_identity(run.pk, action.step_key)] > 0,
            completed=action.pk in receipts,
        )
        for number, action in enumerate(actions, start=1)
    )
    publications = tuple(
        sum(action.created_at < committed for action in actions)
        for committed in AnswerRevision.objects.filter(run=run)
        .order_by("committed_at")
        .values_list("committed_at", flat=True)
    )
    captured = {"source"} if Source.objects.filter(run=run).exists() else set()
    captured |= {"model_call"} if ModelCall.objects.filter(run=run).exists() else set()
    return Sequence(
        agent=agent,
        strides=strides,
        publications=publications,
        captured=frozenset(captured),
        saves_checkpoints=declared.saves_checkpoints(),
        runs=tuple(each.pk for each in lab.runs),
    )


class Lab:
    """One scenario's surroundings: the agent it runs and that agent's
    sequence, its runs, its tool journal, its receiver, and the processes
    it started."""

    def __init__(
        self,
        folder: Path,
        agent: str = "research",
        sequence: Sequence | Exception | None = None,
    ) -> None:
        self.folder = folder
        self.agent = agent
        self._sequence = sequence
        self.journal = folder / "tool-journal.jsonl"
        self.outbox = folder / "outbox"
        self.runs: list[Run] = []
        self.processes: list[GroupProcess] = []
        # Where the scenario placed its fault, in words (its detail's first lines).
        self.staged: list[str] = []

    @property
    def sequence(self) -> Sequence:
        """The agent's sequence (learned now, unless given); what stopped
        the drill learning it is raised."""
        if self._sequence is None:
            self._sequence = learn(self.agent)
        if isinstance(self._sequence, Exception):
            raise self._sequence
        return self._sequence

    def journaled(self) -> bool:
        """Whether the agent's tools journal their executions (as far as
        its sequence, if learned, says)."""
        return not isinstance(self._sequence, Sequence) or self._sequence.journals

    def stage(self, what: str) -> None:
        self.staged.append(what)

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
        drill_input = registry.agent_class(self.agent).drill_input
        if drill_input is None:
            raise NotRun(f"agent {self.agent} declares no drill input")
        run = submission.submit(self.agent, dict(drill_input), faults=faults, drill=True)
        self.runs.append(run)
        return run

    def drive(self, run: Run) -> Ending:
        ending = claim_and_drive(run.pk)
        timeline.flush()
        run.refresh_from_db()
        return ending

    def clean(self) -> Run:
        """A run with no fault, driven to its end: NotRun if it does not
        complete."""
        run = self.submit()
        self.drive(run)
        if run.status != RunStatus.COMPLETED:
            raise NotRun(
                f"a clean run of {self.agent} in the drill's lab (run {run.pk}) ended "
                f"{run.status}: {run.status_reason or 'no reason given'}; nothing can be "
                "judged against it here"
            )
        return run

    def executions(self) -> Counter[str]:
        return Journal(self.journal).counts()

    def env(self) -> dict[str, str]:
        """For a process of this installation working for the drill: the
        same agents installed as here (settings may have added some)."""
        return {
            **os.environ,
            "DATABASE_URL": database_url(),
            "RUNDESK_AGENTS": ",".join(
                f"{name}={path}" for name, path in settings.RUNDESK_AGENTS.items()
            ),
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


def work_continued(finding: Finding, lab: Lab, run: Run) -> None:
    """Q2: the run did all that a clean run of its agent does: it
    completed, its final revision is published, every action the clean run
    completed has its receipt (each effect among them: one, its own)."""
    done = set(
        Action.objects.filter(
            run=run, state=ActionState.COMPLETED, receipt__isnull=False
        ).values_list("step_key", flat=True)
    )
    clean = [stride for stride in lab.sequence.strides if stride.completed]
    missing = [stride.key for stride in clean if stride.key not in done]
    effects = [stride.key for stride in clean if stride.effect == EffectClass.EFFECT]
    final = AnswerRevision.objects.filter(run=run, is_final=True).exists()
    said = (
        f"run {run.pk} {run.status}, final revision {'published' if final else 'not published'}, "
        f"{len(clean) - len(missing)} of the {len(clean)} actions a clean run completes completed"
    )
    if effects:
        sent = [key for key in effects if key in done]
        said += f", {len(sent)} of its {len(effects)} effects ({', '.join(effects)}) with a receipt"
    if missing:
        said += f"; not completed: {', '.join(missing)}"
    finding.answer(QUESTIONS[1], run.status == RunStatus.COMPLETED and final and not missing, said)


def executed_once(finding: Finding, lab: Lab, runs: list[Run]) -> None:
    """Q3: each action ran at most as often as its boundary was armed (a
    read without receipt is sent again under its identity); an effect and
    every action with a receipt from the first attempt ran once.  Of an
    agent whose tools journal nothing, it cannot be told (None)."""
    if not lab.journaled():
        finding.answer(
            QUESTIONS[2],
            None,
            f"{lab.agent}'s tools write no tool journal line (RUNDESK_TOOL_JOURNAL): "
            "executions cannot be counted outside the database",
        )
        return
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
    work_continued(finding, lab, run)
    executed_once(finding, lab, [run])
    boundaries(finding, lab, [run], *also)
    return finding


def gaps_of(run: Run) -> int:
    """Records capture could not save when it first tried: its gaps, those
    a try again saved later too (evidence/retries.py)."""
    return CaptureGap.objects.filter(run=run).aggregate(n=Sum("count"))["n"] or 0


# -- the scenarios ----------------------------------------------------------------------


def capture_row_lock(lab: Lab) -> Finding:
    """Capture blocked by a row lock: another session holds the run's
    capture counters FOR UPDATE for the whole run."""
    lab.sequence.needs_capture({"model_call"}, "copy of a model call")
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
    lab.sequence.needs_capture({"model_call"}, "model record")
    return _tables_locked(lab, ["evidence_modelcall"], "ACCESS EXCLUSIVE")


def evidence_tables_locked(lab: Lab) -> Finding:
    """Every evidence table locked (ACCESS EXCLUSIVE) for the whole run."""
    lab.sequence.needs_capture({"model_call", "source"}, "record")
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
    behind a locked source table (which model records link to)."""
    lab.sequence.needs_capture({"model_call", "source"}, "record")
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
    lab.sequence.needs_capture({"source"}, "document read")
    run = lab.submit()
    with _trigger(run, "stall", "evidence_source", "PERFORM pg_sleep(3); RETURN NEW;"):
        try:
            started = time.monotonic()
            lab.drive(run)
            took = time.monotonic() - started
        finally:
            evidence.capture.capture.flush(timeout=30)
    stalled = 3 * Source.objects.filter(run=run).count()
    return full_run_answers(
        lab,
        run,
        (took < stalled, f"the run took {took:.1f} s while capture stalled {stalled} s"),
    )


def checkpoint_fails_before_write(lab: Lab) -> Finding:
    """The first checkpoint a run saves fails before writing."""
    after = lab.sequence.checkpointed()
    lab.stage(f"the checkpoint after {after.said('the first action a checkpoint is saved after')}")
    run = lab.submit([{"point": "checkpoint_serialize_error", "action": after.number}])
    lab.drive(run)
    failed = run.checkpoints.filter(outcome="failed_before_write").count()
    return full_run_answers(
        lab,
        run,
        (failed == 1, "the failed checkpoint is recorded; the phase stayed research"),
        (run.phase_reason == "", "no record-keeping failure moved the run to finalizing"),
    )


def _commit_lost(lab: Lab, write: str, action: int, where: str) -> Finding:
    lab.stage(f"the first {write} written at or after {where}")
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
    after = lab.sequence.checkpointed()
    return _commit_lost(
        lab, "checkpoint", after.number, after.said("the first a checkpoint is saved after")
    )


def receipt_commit_lost(lab: Lab) -> Finding:
    """The answer to a receipt's COMMIT is lost (it committed): the
    receipt of the first read after the run's first action."""
    read = lab.sequence.later_read()
    return _commit_lost(lab, "receipt", read.number, read.said("the first read after action 1"))


def boundary_commit_lost(lab: Lab) -> Finding:
    """The answer to a boundary's COMMIT is lost (it committed): the first
    boundary that carries the receipts of the reads before it."""
    carrier = lab.sequence.carrier()
    return _commit_lost(
        lab,
        "boundary",
        carrier.number,
        carrier.said("the first whose boundary write carries reads' receipts"),
    )


def publication_commit_lost(lab: Lab) -> Finding:
    """The answer to the first publication's COMMIT is lost (it committed)."""
    taken = lab.sequence.first_publication()
    return _commit_lost(lab, "publication", taken, f"action {taken} (when the run first publishes)")


def delivery_answer_lost(lab: Lab) -> Finding:
    """The first effect happens but its answer is lost: the run waits in the
    inbox; the drill's record of what its receiver got (the tool journal,
    and its outbox) is asked, and a system decision settles the item with
    what it holds."""
    effect = lab.sequence.first_effect()
    if not effect.journaled:
        raise NotRun(
            f"{effect.key} of {lab.agent} writes no tool journal line: "
            "the drill cannot ask its receiver whether it happened"
        )
    lab.stage(f"the answer of {effect.said('the first effect')} lost")
    run = lab.submit([{"point": "delivery_timeout"}])  # the first effect's
    first = lab.drive(run)
    item = OutcomeItem.objects.filter(run=run, state=OutcomeState.OPEN).first()
    waited = first == Ending.NEEDS_OPERATOR and item is not None
    identity = action_identity(run.pk, effect.key)
    ran = lab.executions()[identity]
    received = sorted(lab.outbox.glob("*")) if lab.outbox.exists() else []
    held = (
        f"the drill's receiver holds it: {received[0].name}"
        if received
        else f"the tool journal holds {ran} execution(s) of {identity}"
    )
    if item is not None:
        decisions.decide(
            item.pk,
            decisions.Request(
                choice=DecisionChoice.CONFIRMED_HAPPENED,
                who=decisions.Who(system="drill"),
                token=f"drill-{run.pk}-{item.pk}",
                reason=held if ran or received else "",
                reference=received[0].name if received else identity,
            ),
        )
    lab.drive(run)
    return full_run_answers(
        lab,
        run,
        (waited, "the lost answer became an open item; the run waited, nothing resent"),
        (ran == 1, f"the tool journal holds {ran} execution(s) of {effect.key}"),
        *(
            [(len(received) == 1, f"the drill's receiver holds {len(received)} delivery(ies)")]
            if received
            else []
        ),
    )


def lease_stolen(lab: Lab) -> Finding:
    """Another owner takes the lease mid-run; once its lease lapses, a new
    owner resumes the run from its receipts."""
    point = lab.sequence.mid_run()
    lab.stage(f"the lease taken before {point.said('mid-run')}")
    run = lab.submit([{"point": "lease_stolen", "action": point.number}])
    first = lab.drive(run)
    expire_lease(run)
    lab.drive(run)
    epochs = set(run.actions.values_list("epoch", flat=True))
    # Reads whose receipts went with the refused write: the new owner sent
    # them again under their identities (their epoch is its own now).
    again = run.actions.filter(attempts__gt=1).count()
    return full_run_answers(
        lab,
        run,
        (first == Ending.LEASE_LOST, "the old owner stopped at its next fenced write"),
        (
            len(epochs) >= 2 or again > 0,
            f"the work was split over epochs {sorted(epochs)}"
            + (f"; the new owner read {again} again, under the same identities" if again else ""),
        ),
    )


def cancel_mid_run(lab: Lab) -> Finding:
    """A cancel arrives mid-run."""
    point = lab.sequence.mid_run()
    lab.stage(f"the cancel before {point.said('mid-run')}")
    run = lab.submit([{"point": "cancel", "action": point.number}])
    ending = lab.drive(run)
    finding = Finding()
    content_readable(finding, run, expect_final=False)
    finding.answer(QUESTIONS[1], None, "a cancel ends the run: no work is to continue")
    executed_once(finding, lab, [run])
    later = run.actions.exclude(step_key__in=lab.sequence.before(point)).count()
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


def _slow_run(lab: Lab) -> tuple[Run, Callable[[], bool]]:
    """A run whose every action takes 300 ms, and when to kill what runs
    it: once a read mid-run, before any effect, is dispatched (its
    boundary is there), so that what the kill leaves is reads to send
    again, not an effect in doubt."""
    read = lab.sequence.mid_read()
    lab.stage(f"killed while {read.said('a read mid-run')} is in flight")
    run = lab.submit([{"point": "tool_delay", "ms": 300}])
    return run, run.actions.filter(step_key=read.key).exists


def executor_killed(lab: Lab) -> Finding:
    """An executor process is SIGKILLed mid-run; another owner resumes it."""
    run, mid_run = _slow_run(lab)
    process = lab.start("manage.py", "executor", "--run", str(run.pk))
    wait_for(mid_run, "the executor mid-run")
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
    run, mid_run = _slow_run(lab)
    worker = _worker(lab)
    current_app.send_task(
        "runs.tasks.execute_run", args=[run.pk], queue=settings.RUNDESK_DRILL_QUEUE
    )
    wait_for(mid_run, "the worker mid-run")
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
    # Dispatched by a later boundary write than its own (reads side by side
    # share one).
    after = run.actions.filter(created_at__gt=action.created_at)
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


def _literal(text: str) -> str:
    """`text` as an SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def invented_receipt(lab: Lab) -> Finding:
    """The receipt of an action after which a checkpoint is saved does not
    verify (its digest is invented) and that checkpoint fails: no local
    handling."""
    after = lab.sequence.checkpointed()
    lab.stage(
        f"the receipt of {after.said('the first action a checkpoint is saved after')} invented"
    )
    run = lab.submit([{"point": "checkpoint_serialize_error", "action": after.number}])
    body = f"IF NEW.step_key = {_literal(after.key)} THEN"
    body += " NEW.result_digest := repeat('0', 64); END IF; RETURN NEW;"
    with _trigger_on_receipts(run, body):
        ending = lab.drive(run)
    return _no_local_handling(lab, run, ending, after.key, "does not verify")


def missing_receipt(lab: Lab) -> Finding:
    """A read completed but its receipt never reached the database: the
    next owner finds an action completed without its receipt."""
    read = lab.sequence.carried()
    lab.stage(
        f"the receipt of {read.said('the first read whose receipt goes with a later write')} lost"
    )
    run = lab.submit()
    body = f"IF NEW.step_key = {_literal(read.key)} THEN RETURN NULL; END IF; RETURN NEW;"
    with _trigger_on_receipts(run, body):
        lab.drive(run)
    expire_lease(run)
    ending = lab.drive(run)
    return _no_local_handling(lab, run, ending, read.key, "receipt is missing")


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
    run, mid_run = _slow_run(lab)
    process = lab.start("manage.py", "executor", "--run", str(run.pk))
    wait_for(mid_run, "the executor mid-run")
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
    return full_run_answers(lab, run, (restarted, "PostgreSQL restarted while the run was mid-run"))


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


def run_scenario(
    drill: Drill, name: str, agent: str | None = None, sequence: Sequence | Exception | None = None
) -> DrillResult:
    """Stages one scenario against `agent` (the drill's first, unless
    told), whose `sequence` is learned first unless given, answers its
    questions, and keeps the answers.  A scenario that raises fails, with
    the error as its detail."""
    agent = agent or (drill.agents or drillable())[0]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"rundesk-drill-{name}-") as folder:
        lab = Lab(Path(folder), agent, sequence)
        try:
            with lab.settings():
                finding = SCENARIOS[name](lab)
            verdict = DrillVerdict.PASSED if finding.passed else DrillVerdict.FAILED
            answers, detail = finding.answers, "\n".join([*lab.staged, *finding.detail])
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
        agent=agent,
        verdict=verdict,
        seconds=round(time.monotonic() - started, 2),
        checks=answers,  # the column keeps its name (schema)
        detail=detail,
        run_ids=[run.pk for run in lab.runs],
    )


def learned(agent: str) -> Sequence | Exception:
    """`agent`'s sequence, or what stopped the drill learning it: each of
    the agent's scenarios then ends with it (NotRun: not run, saying why;
    another error: failed)."""
    try:
        return learn(agent)
    except Exception as error:
        connection.close_if_unusable_or_obsolete()
        return error


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


def start_drill(scenarios: list[str], started_by: str, agents: list[str] | None = None) -> Drill:
    """A new running drill of `scenarios` against `agents` (every one that
    declares a drill input, unless told; ValueError says why one cannot
    be), unless another drill runs (DrillRunning; the database keeps it to
    one, however many ask at once).  A running drill silent for LOST_AFTER
    is ended as lost first."""
    agents = chosen_agents(agents)
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
            return Drill.objects.create(scenarios=scenarios, agents=agents, started_by=started_by)
    except IntegrityError:
        running = Drill.objects.filter(state=DrillState.RUNNING).first()
        if running is None:  # it ended meanwhile
            return start_drill(scenarios, started_by, agents)
        raise DrillRunning(running) from None


@dataclass(frozen=True)
class Drilled:
    """What a drill did: its scenarios' results, and what earlier drills had
    left behind that it removed first (remove_leftovers)."""

    results: list[DrillResult]
    leftovers: list[str]


def run_drill(drill: Drill) -> Drilled:
    """Runs the drill's scenarios in order against each of its agents in
    turn (its sequence learned first, once), each result kept as it comes,
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
        for agent in drill.agents or drillable():
            if not running.exists():
                return Drilled(results, leftovers)
            sequence = learned(agent)
            for name in drill.scenarios:
                if not running.exists():
                    return Drilled(results, leftovers)
                results.append(run_scenario(drill, name, agent, sequence))
    except BaseException as error:
        running.update(state=DrillState.DONE, finished_at=timezone.now(), error=repr(error))
        raise
    running.update(state=DrillState.DONE, finished_at=timezone.now())
    return Drilled(results, leftovers)


def report(drilled: Drilled) -> dict[str, Any]:
    """The drill's JSON: each scenario with the agent it ran against, its
    verdict (and why, when it was not run), how many passed, failed, did
    not run, and what was left by an earlier drill and removed."""
    verdicts = Counter(result.verdict for result in drilled.results)
    return {
        "agents": list(dict.fromkeys(result.agent for result in drilled.results)),
        "scenarios": [
            {
                "name": result.scenario,
                "agent": result.agent,
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

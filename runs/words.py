"""Words shown to operators, below all who show them (the pages, the
`outcomes` command, a bundle's report.html), so that all say the same.

The plain words for the runtime's internal names (`failed_before_write` is
"failed before write", `needs_operator` "waits for an operator"), and an
outcome item's or a decision's evidence (JSON) as labelled fields.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from django.db.models import Max, TextChoices
from django.db.models.fields.json import KeyTextTransform
from django.utils import timezone

from evidence.models import GapReason
from runs import registry
from runs.agent import Tool
from runs.models import (
    Action,
    ActionState,
    CheckpointOutcome,
    EffectClass,
    OutcomeKind,
    OutcomeState,
    Phase,
    Run,
    RunStatus,
    reads_left_out,
)
from runs.timeline import EventKind

logger = logging.getLogger(__name__)

PLAIN: dict[type[TextChoices], dict[str, str]] = {
    RunStatus: {
        RunStatus.QUEUED: "queued",
        RunStatus.RUNNING: "running",
        RunStatus.NEEDS_OPERATOR: "waits for an operator",
        RunStatus.COMPLETED: "completed",
        RunStatus.FAILED: "failed",
        RunStatus.CANCELLED: "cancelled",
    },
    Phase: {
        Phase.RESEARCH: "research",
        Phase.FINALIZING: "finalizing: answers only, no new reads",
        Phase.DONE: "done",
    },
    ActionState: {
        ActionState.DISPATCHED: "dispatched, no receipt yet",
        ActionState.COMPLETED: "completed",
        ActionState.FAILED: "failed: known not to have happened",
        ActionState.UNKNOWN: "outcome unknown",
    },
    EffectClass: {
        EffectClass.READ: "read (repeatable)",
        EffectClass.EFFECT: "outside effect (irreversible)",
    },
    CheckpointOutcome: {
        CheckpointOutcome.COMMITTED: "committed",
        CheckpointOutcome.FAILED_BEFORE_WRITE: "failed before write",
        CheckpointOutcome.UNKNOWN: "unknown: COMMIT sent, no answer",
        CheckpointOutcome.SETTLED_COMMITTED: "committed (settled by evidence)",
        CheckpointOutcome.SETTLED_NOT_WRITTEN: "not written (settled by evidence)",
    },
    OutcomeKind: {
        OutcomeKind.CHECKPOINT: "checkpoint",
        OutcomeKind.RECEIPT: "receipt",
        OutcomeKind.PUBLICATION: "answer publication",
        OutcomeKind.EFFECT: "outside effect",
    },
    OutcomeState: {
        OutcomeState.OPEN: "open",
        OutcomeState.SETTLED: "settled",
    },
    EventKind: {
        EventKind.SUBMITTED: "submitted",
        EventKind.LEASE_ACQUIRED: "lease taken",
        EventKind.LEASE_RELEASED: "lease given back",
        EventKind.LEASE_LOST: "lease lost",
        EventKind.RESUMED: "resumed from its receipts",
        EventKind.ACTION_DISPATCHED: "action dispatched",
        EventKind.ACTION_REDISPATCHED: "dispatched again",
        EventKind.ACTION_REUSED: "receipt reused, not dispatched again",
        EventKind.ACTION_COMPLETED: "action completed",
        EventKind.ACTION_FAILED: "action failed",
        EventKind.ACTION_UNKNOWN: "action outcome unknown",
        EventKind.WRITE_FENCED: "write refused: lease no longer held",
        EventKind.REVISION_PUBLISHED: "answer revision published",
        EventKind.PHASE_CHANGED: "phase changed",
        EventKind.NEEDS_OPERATOR: "waits for an operator",
        EventKind.RUN_COMPLETED: "run completed",
        EventKind.RUN_FAILED: "run failed",
        EventKind.RUN_CANCELLED: "run cancelled",
        EventKind.CHECKPOINT_SAVED: "checkpoint saved",
        EventKind.CHECKPOINT_FAILED: "checkpoint failed before write",
        EventKind.CHECKPOINT_USED: "continued from a checkpoint",
        EventKind.CHECKPOINT_IGNORED: "checkpoint not used",
        EventKind.COMMIT_UNANSWERED: "COMMIT got no answer",
        EventKind.OUTCOME_SETTLED: "outcome settled",
        EventKind.OUTCOME_OPEN: "left for an operator",
        EventKind.FAULT_INJECTED: "fault injected",
        EventKind.SOURCE_CHANGED: "document changed since read",
        EventKind.REVISION_KEPT: "revision kept as published",
        EventKind.CANCEL_REQUESTED: "cancel requested",
        EventKind.RUN_REQUEUED: "back in the queue",
        EventKind.DECISION: "decision taken",
        EventKind.EVENTS_LOST: "events lost",
    },
    GapReason: {
        GapReason.QUEUE_FULL: "capture queue full",
        GapReason.LOCK_NOT_AVAILABLE: "lock not available",
        GapReason.TOO_LARGE: "too large to copy",
        GapReason.DB_ERROR: "database error",
        GapReason.SHUTDOWN: "process stopping",
    },
}


def plain(choices: type[TextChoices], value: str) -> str:
    """The operator's words for `value` of `choices`.  A value this table
    does not know yet (a new state) is still shown, without underscores."""
    return PLAIN.get(choices, {}).get(value) or str(value).replace("_", " ")


def status_words(run: Run) -> str:
    """A run's status, and for a cancelled run who cancelled it."""
    if run.status == RunStatus.CANCELLED:
        who = run.cancel_requested_by
        return f"cancelled by {who}" if who else "cancelled (who asked was not recorded)"
    return plain(RunStatus, run.status)


def human_duration(seconds: float) -> str:
    """A length of time as a tired person reads it: "350 ms", "4.2 s",
    "44 s", "1 min 44 s", "2 min", "1 h 5 min", "3 d 2 h".  The one way
    every page says how long (a lease expired, a queue wait, a lock wait)."""
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{round(seconds * 1000)} ms"
    if seconds < 10:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    minutes, rest = divmod(whole, 60)
    # Below ten minutes the seconds still tell something (a 104 s lock wait).
    if minutes < 10:
        return f"{minutes} min {rest} s" if rest else f"{minutes} min"
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


def since(moment: dt.datetime, now: dt.datetime) -> str:
    return human_duration((now - moment).total_seconds())


# How a run's wait for an approval (runs/approvals.py) begins its status
# reason, and so the needs_operator event its timeline reads.
APPROVAL_WAIT = "waiting for approval"


def wait_words(seconds: float, ended_by: str, waiting: str = "waiting for an operator") -> str:
    """A run's wait for an operator (or `waiting` for what else: an
    approval), as its timeline labels it: how long, and what ended it
    ("the decision of olga (…)")."""
    return f"{waiting}: {human_duration(seconds)}, ended by {ended_by or 'its end'}"


def waiting_words(since: str, waiting: str = "waiting for an operator") -> str:
    """A run's wait for an operator (or an approval) that goes on, as its
    timeline labels it."""
    return f"{waiting} since {since}, still waiting"


def unowned_words(seconds: float, after: str, until: str) -> str:
    """A span where nobody ran a run (no lease held), as its timeline
    labels it: "nobody ran it for 40 s: lease lost, until epoch 3 took it"."""
    return f"nobody ran it for {human_duration(seconds)}: {after}, {until}"


def cut_words(seconds: float) -> str:
    """Where a timeline's axis leaves time out: how much."""
    return f"… {human_duration(seconds)} …"


# A queued run nobody has taken for this long is said to be waiting for an
# executor (a claim takes a free executor well under a second).
QUEUED_LONG = dt.timedelta(seconds=10)


@dataclass(frozen=True)
class StatusNow:
    """What a run is doing now, in words, and whether that is a warning
    (its owner stopped renewing its lease; nobody has taken it for long)."""

    words: str
    warning: bool = False


def status_now(run: Run, now: dt.datetime) -> StatusNow:
    """A run's status as it stands at `now`: a running run whose lease
    expired says so (its status still says running until the sweep or
    another executor takes it), a run queued for long how long it has
    waited."""
    if run.is_imported:
        return StatusNow(status_words(run))
    expires = run.lease_expires_at
    if run.status == RunStatus.RUNNING and expires is not None and expires < now:
        return StatusNow(
            f"lease expired {since(expires, now)} ago: the owner stopped renewing", warning=True
        )
    # A run queued a moment ago is plainly queued; after QUEUED_LONG, how long.
    if run.status == RunStatus.QUEUED and run.queued_at and now - run.queued_at >= QUEUED_LONG:
        return StatusNow(f"queued for {since(run.queued_at, now)}", warning=True)
    return StatusNow(status_words(run))


# The lease owners named on a queued run's page (the rest are counted).
OWNERS_NAMED = 5


def queue_words(run: Run, now: dt.datetime) -> str | None:
    """Why a queued run has not been taken, once it has waited QUEUED_LONG,
    and what is known of the executors: those renewing leases now (all
    busy: their runs in flight), or, when none does, when one last
    started a run (None: not queued for long, or imported)."""
    if run.status != RunStatus.QUEUED or run.is_imported or run.queued_at is None:
        return None
    if now - run.queued_at < QUEUED_LONG:
        return None
    waited = f"queued for {since(run.queued_at, now)}"
    held: dict[str, list[int]] = {}
    # Leases renewed now are the executors known to be alive: derived from
    # the runs' own lease columns (run_running_lease_idx), no registry.
    for owner, run_id in (
        Run.objects.local()
        .filter(status=RunStatus.RUNNING, lease_expires_at__gte=now)
        .order_by("lease_owner", "pk")
        .values_list("lease_owner", "pk")
    ):
        held.setdefault(owner, []).append(run_id)
    if held:
        named = "; ".join(
            f"{owner} (run{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))})"
            for owner, ids in list(held.items())[:OWNERS_NAMED]
        )
        more = len(held) - OWNERS_NAMED
        return (
            f"{waited}: no executor free. "
            f"{len(held)} {'executor renews' if len(held) == 1 else 'executors renew'}"
            f" a lease now, each busy with its runs in flight: {named}"
            + (f", and {more} more" if more > 0 else "")
        )
    last = Run.objects.local().filter(started_at__isnull=False).aggregate(Max("started_at"))
    started = last["started_at__max"]
    if started is None:
        return (
            f"{waited}: no executor has taken it; no executor holds a lease, and none "
            "has ever claimed a run here"
        )
    return (
        f"{waited}: no executor has taken it; no executor holds a lease now, and none has "
        f"claimed a new run in the last {since(started, now)}: is one running?"
    )


def cancel_words(run: Run, reason: str, now: dt.datetime) -> str | None:
    """Who asked a cancel, when, why, and what came of it: ended by it,
    stopping at the owner's next boundary, or overtaken (the run completed
    or failed first).  None: no cancel was asked."""
    if run.cancel_requested_at is None:
        return None
    at = timezone.localtime(run.cancel_requested_at).strftime("%H:%M:%S")
    asked = f"cancel asked at {at} by {run.cancel_requested_by or '(not recorded)'}"
    if reason:
        asked += f" ({reason})"
    if run.status == RunStatus.CANCELLED:
        ended = timezone.localtime(run.finished_at).strftime("%H:%M:%S") if run.finished_at else ""
        return f"{asked}; the run ended by it" + (f" at {ended}" if ended else "")
    if run.is_finished:
        return f"{asked}; the run {plain(RunStatus, run.status)} first"
    expires = run.lease_expires_at
    if run.status == RunStatus.RUNNING and expires is not None and expires < now:
        return (
            f"{asked}; its owner stopped renewing its lease: the next executor to take "
            "the run, or the sweep, ends it"
        )
    return f"{asked}; its owner stops before its next boundary"


def words(name: str) -> str:
    """An internal name (a tool's, a key's) as words: read_document → read document."""
    return name.replace("_", " ")


# The research agent's name: its runs, and only its, are said in its own
# words (documents read and summarised, a report composed and delivered).
RESEARCH = "research"


def did(action: Action, run: Run) -> str:
    """What an action of `run` did, as an operator names it ("reading
    northwind.md", "delivering the report to hooks.example.com" for the
    research agent's; "send email (reply)": the tool and the step, for any
    other agent's).  Its identity (rundesk:run-7:read:0) is the journal's
    name."""
    if run.agent != RESEARCH:
        return f"{words(action.kind)} ({action.step_key})"
    given = action.input if isinstance(action.input, dict) else {}
    step, _, index = action.step_key.partition(":")
    if action.kind == "read_document":
        return f"reading {given.get('path') or 'a document'}"
    if action.kind == "deliver_report":
        host = urllib.parse.urlsplit(receiver(action, declared_tool(run, action.kind))).hostname
        return f"delivering the report to {host or 'the outbox'}"
    if action.kind == "model_call" and step == "summarize" and index.isdigit():
        read = int(index)
        documents = run.documents
        source = documents[read] if read < len(documents) else f"document {read + 1}"
        return f"summarising {source} (the model)"
    if action.kind == "model_call" and action.step_key == "compose":
        return "composing the report (the model)"
    return f"{words(action.kind)} ({action.step_key})"


@dataclass(frozen=True)
class Declared:
    """The tool a run's agent, as installed here now, declares under an
    action's kind: the one that would dispatch the action again, and that
    says where it went.  None when there is none here: `missing` says why
    (the agent is not installed, or declares no such tool)."""

    tool: Tool | None
    missing: str = ""


def declared_tool(run: Run, kind: str) -> Declared:
    try:
        agent = registry.agent_class(run.agent)
    except registry.NotInstalled as error:
        return Declared(None, str(error))
    tool = agent.tool(kind)
    if tool is None:
        return Declared(None, f"agent {run.agent} {agent.version} declares no tool {kind!r}")
    return Declared(tool)


def receiver(action: Action, declared: Declared) -> str:
    """Where an effect went, as its tool says it (Tool.receiver: "smtp://mail.
    example.com, message <key@host>"), for an operator to look it up there;
    "" when the tool does not say, or is not known here.  A receiver() that
    fails is an agent's bug: the item is shown all the same, without it."""
    tool = declared.tool
    if tool is None or tool.receiver is None:
        return ""
    given = action.input if isinstance(action.input, dict) else {}
    try:
        return str(tool.receiver(given, action.idempotency_key))
    except Exception:
        logger.exception("tool %s: receiver() failed", tool.name)
        return ""


# A completed run whose answer leaves work out (left_out): its status stays
# completed, and the runs list and its page say this beside it.
WITH_GAPS = "completed with gaps"

# The documents a line of left_out names before it counts the rest.
NOT_READ_NAMED = 5


@dataclass(frozen=True)
class LeftOut:
    """One piece of work a run's answer goes without, in words, and the
    action that was to do it (None: none was dispatched)."""

    words: str
    action_id: int | None = None


def left_out(run: Run) -> list[LeftOut]:
    """What a run's answer leaves out, in the order it was met: each read
    refused ("reading report.pdf: refused: a PDF document, not text") or
    failed ("summarising crestline.md (the model): failed: ..."), named by
    what it did, then the documents research ended before ("1 of 3
    documents not read (action budget of 6 exhausted): meridian.md").
    Empty when nothing was; it asks of the run's rows what
    Run.objects.completed_with_gaps() asks of every run's."""
    lines = []
    reads = (
        reads_left_out()
        .filter(run=run)
        .annotate(refusal=KeyTextTransform("refused", "receipt__result"))
    )
    for action in reads.order_by("id"):
        if action.state == ActionState.FAILED:
            what = f"failed: {action.error}"
        else:
            # The read tool's refusal begins with the path did() names.
            path = action.input.get("path") if isinstance(action.input, dict) else None
            what = f"refused: {action.refusal.removeprefix(f'{path!r}: ')}"
        lines.append(LeftOut(f"{did(action, run)}: {what}", action.pk))
    if run.phase_reason:
        tried = set(
            run.actions.filter(effect_class=EffectClass.READ).values_list("input__path", flat=True)
        )
        unread = [path for path in run.documents if path not in tried]
        lines.append(LeftOut(_not_read(run, unread)))
    return lines


def _not_read(run: Run, unread: list[str]) -> str:
    """The documents research ended before, named up to NOT_READ_NAMED;
    none named (a run whose input lists none, another agent's run): that
    its work ended early, and why."""
    reason, documents = run.phase_reason, len(run.documents)
    if not unread:
        ended = "research" if run.agent == RESEARCH else "its work"
        return f"{ended} ended early: {reason}"
    named = ", ".join(unread[:NOT_READ_NAMED])
    if len(unread) > NOT_READ_NAMED:
        named += f" and {len(unread) - NOT_READ_NAMED} more"
    plural = "s" if documents != 1 else ""
    return f"{len(unread)} of {documents} document{plural} not read ({reason}): {named}"


# -- evidence as labelled fields ----------------------------------------------------

EVIDENCE_LABELS = {
    "identity": "Action identity",
    "idempotency_key": "Idempotency-Key sent",
    "xid": "Transaction id (xid)",
    "xid_from": "xid read from",
    "backend_pid": "Writer's backend pid",
    "backend_start": "Writer's backend started",
    "error": "What the writer saw",
    "checks": "Checks",
    "lease_epoch": "Lease epoch",
    "afterwards": "Afterwards",
    "settled_by": "Settled by",
    "decision": "Settled by decision",
    "at": "Time",
    "xid_status": "xid status",
    "row_found": "Row found",
    "backend_alive": "Writer alive",
}
# A column of a table (a check) where a key means something else, and
# the order of a check's columns.
COLUMN_LABELS = {"error": "Error"}
COLUMN_ORDER = ["at", "xid_status", "row_found", "backend_alive", "error"]
# The order known keys are shown in; other keys follow, in their own order.
EVIDENCE_ORDER = list(EVIDENCE_LABELS)
# What a missing value means, where it means something.
EVIDENCE_NONE = {
    "xid": "none announced",
    "xid_status": "no status (no xid, or too old to tell)",
    "backend_pid": "not known",
    "backend_start": "not known",
}
TIMES = {"at", "backend_start"}
MAX_DEPTH = 3


@dataclass
class Table:
    columns: list[str]
    rows: list[list[str]]


@dataclass
class Field:
    """One labelled piece of evidence: text, a table (a list of records,
    e.g. the checks) or nested fields (e.g. what settled the item)."""

    key: str
    label: str
    text: str = ""
    table: Table | None = None
    fields: list[Field] = field(default_factory=list)

    @property
    def multiline(self) -> bool:
        return "\n" in self.text


def evidence_fields(evidence: Any, depth: int = 0) -> list[Field]:
    """An outcome item's evidence (JSON) as labelled fields, known keys first.
    Every key is shown, the unknown ones labelled by their name; values are
    text the template escapes."""
    if not isinstance(evidence, dict):
        return [Field("value", "Value", text=_text("value", evidence))]
    return [_field(key, evidence[key], depth) for key in _ordered(evidence, EVIDENCE_ORDER)]


def _ordered(keys: Iterable[str], order: list[str]) -> list[str]:
    """`keys`, those of `order` first in its order, then the others as they came."""
    return sorted(keys, key=lambda k: order.index(k) if k in order else len(order))


def _label(key: str) -> str:
    return EVIDENCE_LABELS.get(key) or (words(str(key)).capitalize() or "(no name)")


def _field(key: str, value: Any, depth: int) -> Field:
    label = _label(key)
    if isinstance(value, dict) and value and depth < MAX_DEPTH:
        return Field(key, label, fields=evidence_fields(value, depth + 1))
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        columns = _ordered(dict.fromkeys(k for row in value for k in row), COLUMN_ORDER)
        rows = [[_text(c, row.get(c)) if c in row else "" for c in columns] for row in value]
        if "at" in columns:
            rows = _folded(rows, columns.index("at"))
        return Field(
            key, label, table=Table([COLUMN_LABELS.get(c) or _label(c) for c in columns], rows)
        )
    return Field(key, label, text=_text(key, value))


def _folded(rows: list[list[str]], at: int) -> list[list[str]]:
    """Rows that say the same, one after another, but for their time (the
    same check repeated while waiting) as one row: its time the span and
    how many times it was seen."""
    runs: list[tuple[list[str], str, int]] = []  # (first row, last time, count)
    for row in rows:
        same = [cell for i, cell in enumerate(row) if i != at]
        if runs and [c for i, c in enumerate(runs[-1][0]) if i != at] == same:
            first, _, count = runs[-1]
            runs[-1] = (first, row[at], count + 1)
        else:
            runs.append((row, row[at], 1))
    folded = []
    for first, last, count in runs:
        if count > 1:
            span = f"{first[at]} to {_clock(first[at], last)} ({count} times)"
            first = [span if i == at else cell for i, cell in enumerate(first)]
        folded.append(first)
    return folded


def _clock(first: str, last: str) -> str:
    """`last` without the date `first` already says."""
    day, _, clock = last.partition(" ")
    return clock if clock and first.startswith(day + " ") else last


def _text(key: str, value: Any) -> str:
    if value is None:
        return EVIDENCE_NONE.get(key, "—")
    if isinstance(value, bool):
        return "yes" if value else "no"
    if key in TIMES and isinstance(value, str):
        try:
            moment = dt.datetime.fromisoformat(value)
        except ValueError:
            return value
        if timezone.is_aware(moment):
            moment = timezone.localtime(moment)
        return moment.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(not isinstance(v, dict | list) for v in value):
        return ", ".join(_text(key, v) for v in value) or "none"
    if isinstance(value, dict | list):
        return json.dumps(value, indent=1, ensure_ascii=False, sort_keys=True)
    return str(value)

"""What the run page shows of a run, in an operator's words: shared by the
dashboard's run page (dashboard/views.py) and a bundle's report.html
(evidence/bundle_report.py), so both say the same thing."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import markdown
import nh3
from django.db.models import Q
from django.utils.safestring import SafeString, mark_safe

from dashboard import charts
from dashboard.context import evidence_fields, plain, status_words, words
from evidence.models import CaptureGap, CaptureStats, EvidenceCopy, GapReason, LockWait
from runs.models import (
    ActionState,
    Checkpoint,
    CheckpointOutcome,
    EffectClass,
    OutcomeKind,
    OutcomeState,
    Phase,
    Run,
)


def run_facts(run: Run) -> dict[str, Any]:
    """What changes while a run is active, in an operator's words."""
    run.status_label, run.phase_label = status_words(run), plain(Phase, run.phase)
    revisions = list(run.revisions.order_by("number"))
    for revision in revisions:
        revision.html = answer_html(revision.content)
    actions = list(run.actions.select_related("receipt").order_by("id"))
    for action in actions:
        action.state_label = plain(ActionState, action.state)
        action.class_label = plain(EffectClass, action.effect_class)
        action.kind_label = words(action.kind)
    items = list(run.outcome_items.select_related("action").order_by("id"))
    for item in items:
        item.kind_label = plain(OutcomeKind, item.kind)
        item.state_label = plain(OutcomeState, item.state)
        item.fields = evidence_fields(item.evidence)
    gaps = list(CaptureGap.objects.filter(run=run).order_by("id")[:50])
    for gap in gaps:
        gap.reason_label = plain(GapReason, gap.reason)
    checkpoints = checkpoint_rows(run.checkpoints.select_related("after_action").order_by("id"))
    return {
        "actions": actions,
        "checkpoints": checkpoints,
        "revisions": revisions,
        "items": items,
        "open_items": sum(item.state == OutcomeState.OPEN for item in items),
        "copies": EvidenceCopy.objects.filter(run=run).order_by("id")[:50],
        "gaps": gaps,
        "capture": CaptureStats.objects.filter(run=run).first(),
        "waits": LockWait.objects.filter(Q(waiter_run=run) | Q(blocker_run=run))
        .select_related("incident")
        .order_by("-first_seen")[:50],
        "faults": json.dumps(run.faults, indent=1) if run.faults else "",
        "timeline": json.loads(charts.timeline(run, actions, checkpoints)),
    }


@dataclass
class Step:
    """One thing that happened to a checkpoint: attempted, saved, settled."""

    at: dt.datetime | None
    what: str
    detail: str = ""


@dataclass
class CheckpointRow:
    """A checkpoint number of a run, with its final outcome and its history.

    The database keeps the saved state and the record of an attempt whose
    COMMIT got no answer (or that failed before writing) as separate rows
    under the same number; an operator sees one checkpoint."""

    number: int
    after: str
    outcome: str
    outcome_label: str
    xid: int | None
    at: dt.datetime
    history: list[Step] = field(default_factory=list)

    @property
    def summary(self) -> str:
        return "; ".join(
            f"{step.what}{': ' + step.detail if step.detail else ''}" for step in self.history
        )


def checkpoint_rows(records: Iterable[Checkpoint]) -> list[CheckpointRow]:
    """One row per checkpoint number.  Its outcome: unknown while any attempt
    is still unknown (an open item says so too); else written when a saved
    state exists (settled by evidence if an attempt needed settling); else
    the last attempt's outcome."""
    by_number: dict[int, list[Checkpoint]] = {}
    for record in records:
        by_number.setdefault(record.number, []).append(record)
    rows = []
    for number, group in sorted(by_number.items()):
        saved = next((r for r in group if r.state is not None), None)
        attempts = [r for r in group if r.state is None]
        outcomes = {r.outcome for r in attempts}
        if CheckpointOutcome.UNKNOWN in outcomes:
            outcome = CheckpointOutcome.UNKNOWN
        elif saved is not None:
            settled = CheckpointOutcome.RESOLVED_COMMITTED in outcomes
            outcome = CheckpointOutcome.RESOLVED_COMMITTED if settled else saved.outcome
        else:
            outcome = attempts[-1].outcome
        history = []
        for record in attempts:
            if record.outcome == CheckpointOutcome.FAILED_BEFORE_WRITE:
                history.append(Step(record.created_at, "failed before write", record.error))
                continue
            # Unknown first, whatever settled it since.
            history.append(Step(record.created_at, record.error or "COMMIT sent, no answer"))
            if record.resolved_at:
                history.append(Step(record.resolved_at, "settled", record.resolution))
        history.sort(key=lambda step: step.at)
        if saved is not None and attempts:  # alone, a saved state needs no history
            history.append(Step(None, "its saved state is readable"))
        rows.append(
            CheckpointRow(
                number=number,
                after=group[0].after_action.step_key,
                outcome=outcome,
                outcome_label=plain(CheckpointOutcome, outcome),
                xid=next((r.xid for r in group if r.xid is not None), None),
                at=min(r.created_at for r in group),
                history=history,
            )
        )
    return rows


def answer_html(content: str) -> SafeString:
    """Model output, rendered from markdown and sanitised: no script, no
    event handler attribute survives.  Drafts and the final answer alike."""
    html = markdown.markdown(content, extensions=["tables"])
    return mark_safe(nh3.clean(html))  # noqa: S308 (sanitised by nh3 just above)

"""What the run page shows of a run, in an operator's words: shared by the
dashboard's run page (dashboard/views.py) and a bundle's report.html
(evidence/bundle_report.py), so both say the same thing."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from django.db.models import Q

from evidence import charts
from evidence.models import CaptureGap, CaptureStats, EvidenceCopy, GapReason, LockWait
from runs.answers import answer_html
from runs.checkpoint_rows import checkpoint_rows
from runs.models import (
    ActionState,
    EffectClass,
    OutcomeKind,
    OutcomeState,
    Phase,
    Run,
)
from runs.words import evidence_fields, plain, status_words, words


def run_facts(run: Run, redact: Callable[[str], str] = str) -> dict[str, Any]:
    """What changes while a run is active, in an operator's words.  The
    timeline's hovers are cut short: `redact` is applied to their text
    before the cut (a bundle's redaction of the page after it would find
    only part of a secret across the cut)."""
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
        "timeline": charts.timeline(run, actions, checkpoints, redact),
    }

"""What the run page shows of a run, in an operator's words: shared by the
dashboard's run page (dashboard/views.py) and a bundle's report.html
(evidence/bundle_report.py), so both say the same thing."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db.models import Q

from evidence import charts
from evidence.models import CaptureGap, CaptureStats, EvidenceCopy, GapReason, LockWait
from runs import registry
from runs.answers import answer_html
from runs.checkpoint_rows import checkpoint_rows
from runs.models import (
    ActionState,
    EffectClass,
    OutcomeItem,
    OutcomeKind,
    OutcomeState,
    Phase,
    Run,
)
from runs.words import Field, declared_tool, evidence_fields, plain, status_words, words


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
        item.fields = item_fields(run, item, item.evidence)
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
        "input": input_fields(run),
    }


def item_fields(run: Run, item: OutcomeItem, evidence: Any) -> list[Field]:
    """An item's evidence as labelled fields.  The key an effect's tool was
    given is an Idempotency-Key sent only where the tool, as installed
    here, sends it as one (an SMTP tool gives it as a Message-ID)."""
    fields = evidence_fields(evidence)
    if item.kind != OutcomeKind.EFFECT or item.action_id is None:
        return fields
    tool = declared_tool(run, item.action.kind).tool
    if tool is None or not tool.accepts_idempotency_key:
        for field_ in fields:
            if field_.key == "idempotency_key":
                field_.label = "Key the tool was given"
    return fields


def agent_words(run: Run) -> str:
    """The run's agent and version, and how the one installed here differs:
    another version, or none (the run page's: a bundle's report says what
    the run recorded, the same bytes whatever is installed where it is
    opened)."""
    said = f"{run.agent} {run.agent_version}"
    if run.is_imported:
        return said
    try:
        here = registry.agent_class(run.agent)
    except registry.NotInstalled:
        return f"{said} (not installed here)"
    if here.version != run.agent_version:
        return f"{said} (version {here.version} is installed here)"
    return said


@dataclass(frozen=True)
class InputField:
    """One field of a run's input, as its page shows it: a value as text, a
    list of values as a list, anything nested as indented JSON (each is
    text the template escapes).  `hint`: the field's description in the
    agent's input schema."""

    key: str
    label: str
    text: str = ""
    items: list[str] = field(default_factory=list)
    nested: str = ""
    hint: str = ""

    @property
    def multiline(self) -> bool:
        return "\n" in self.text


def input_fields(run: Run) -> list[InputField]:
    """A run's input by the shape its agent declares: the fields in the
    order its input schema names them (a jsonb object keeps no order),
    labelled by their titles there, then any others.  An agent not
    installed here: the input as it is."""
    try:
        schema: Mapping[str, Any] = registry.agent_class(run.agent).input_schema
    except registry.NotInstalled:
        schema = {}
    given = run.input
    if not isinstance(given, dict):
        return [_input_field("input", "Input", given, "")]
    declared = schema.get("properties")
    declared = declared if isinstance(declared, dict) else {}
    order = [key for key in declared if key in given]
    order += [key for key in given if key not in declared]
    fields = []
    for key in order:
        shape = declared.get(key)
        shape = shape if isinstance(shape, dict) else {}
        label = str(shape.get("title") or words(key).capitalize() or "(no name)")
        fields.append(_input_field(key, label, given[key], str(shape.get("description") or "")))
    return fields


def _input_field(key: str, label: str, value: Any, hint: str) -> InputField:
    if isinstance(value, list) and value and not any(isinstance(v, dict | list) for v in value):
        return InputField(key, label, items=[_scalar(v) for v in value], hint=hint)
    if isinstance(value, dict | list) and value:
        nested = json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)
        return InputField(key, label, nested=nested, hint=hint)
    return InputField(key, label, text=_scalar(value), hint=hint)


def _scalar(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value in ([], {}):
        return "none"
    return str(value)

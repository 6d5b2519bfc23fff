"""Submitting a run to an installed agent: its input checked against the
shape the agent declares (and its own checks), refused with the field
named and nothing queued; the run records the agent's name and version."""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.db import transaction

from runs import registry
from runs.agent import input_refusal
from runs.faults import MAX_STEPS, FaultPlan
from runs.finding import parse_labels
from runs.models import UNSTORABLE, Run, canonical_json
from runs.timeline import EventKind, timeline


class SubmissionRefused(ValueError):
    """Bad input, with the field of the submission it is about (`agent`,
    `input`, `faults`, `action_budget`), for a client to point at."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def submit(
    agent: str = "research",
    input: dict[str, Any] | None = None,
    *,
    question: str | None = None,
    documents: list[str] | None = None,
    faults: Any = None,
    action_budget: int | None = None,
    deadline: dt.datetime | None = None,
    drill: bool = False,
    labels: dict[str, str] | None = None,
) -> Run:
    """Queues a run of `agent` on `input` (`question` and `documents`: the
    research agent's input, said short; `drill`: one a fault drill made,
    runs/drills.py; `labels`: what operators find it by, runs/finding.py).
    Bad input raises SubmissionRefused (a ValueError) with what is wrong,
    and where."""
    if question is not None or documents is not None:
        input = {"question": question or "", "documents": documents or [], **(input or {})}
    try:
        declared = registry.agent_class(agent)
    except registry.NotInstalled as error:
        raise SubmissionRefused("agent", str(error)) from None
    if input is None:
        raise SubmissionRefused("input", f"a run of {agent} needs an input")
    if refusal := input_refusal(declared.input_schema, input):
        raise SubmissionRefused("input", f"{agent}: {refusal}")
    try:
        canonical_json(input)
    except (TypeError, ValueError) as error:
        raise SubmissionRefused("input", f"{agent}: the input is not JSON: {error}") from None
    if UNSTORABLE.search(canonical_json(input)):
        raise SubmissionRefused(
            "input", f"{agent}: the input holds a character no text can: NUL or a lone surrogate"
        )
    try:
        declared.check_input(input)
    except ValueError as error:
        raise SubmissionRefused("input", str(error)) from None
    try:
        FaultPlan.parse(faults)
    except ValueError as error:
        raise SubmissionRefused("faults", str(error)) from None
    try:
        labels = parse_labels([f"{key}={value}" for key, value in (labels or {}).items()])
    except ValueError as error:
        raise SubmissionRefused("labels", str(error)) from None
    if action_budget is not None and action_budget < 1:
        raise SubmissionRefused("action_budget", "the action budget must be at least 1")
    if action_budget is not None and action_budget > MAX_STEPS:
        raise SubmissionRefused("action_budget", f"the action budget must be at most {MAX_STEPS}")
    fields: dict[str, Any] = {"faults": faults or [], "deadline": deadline, "is_drill": drill}
    if action_budget is not None:
        fields["action_budget"] = action_budget
    documents = declared.documents(input)
    run = Run.objects.create(
        agent=agent,
        agent_version=declared.version,
        input=input,
        question=declared.title(input).strip()[:10_000] or agent,
        documents=documents,
        labels=labels,
        **fields,
    )
    # An observation: it must not be able to fail the submission, so the
    # timeline writes it off the main path once the run is committed.
    said = f"{len(documents)} documents" if documents else f"{agent} {declared.version}"
    transaction.on_commit(lambda: timeline.record(run.pk, EventKind.SUBMITTED, said))
    return run

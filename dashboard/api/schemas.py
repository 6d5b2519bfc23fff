"""What the API takes and answers, declared once: ninja validates requests
against these, serialises answers through them, and the OpenAPI document
describes them (tests/test_api.py checks the answers against it)."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any

from ninja import Field, Schema
from pydantic import AfterValidator, StringConstraints

from runs.decisions import REASON_MAX, REFERENCE_MAX
from runs.models import UNSTORABLE, OperatorDecision

TOKEN_MAX = OperatorDecision._meta.get_field("request_token").max_length


def _storable(text: str) -> str:
    if UNSTORABLE.search(text):
        raise ValueError("holds a character no text can: NUL or a lone surrogate")
    return text


Text = Annotated[str, AfterValidator(_storable)]
RequestToken = Annotated[
    Text,
    Field(
        min_length=1,
        max_length=TOKEN_MAX,
        description="The client's own unique token for this request: a repeat with the "
        "same token (a retry after a lost answer) changes nothing and answers what the "
        "first one did.",
    ),
]


# -- runs ------------------------------------------------------------------------------


class Paged(Schema):
    before: str = Field("", description="The cursor of the page to read: a page's next_cursor")
    limit: int = Field(50, ge=1, le=200, description="Rows per page")


class RunFilters(Paged):
    """The runs list page's filters, read by its own code (dashboard.views.
    listed_runs): the same values, the same refusals."""

    agent: str = Field("", description="An agent's name")
    status: str = Field(
        "",
        description="A status (queued, running, needs_operator, completed, failed, "
        "cancelled), or completed_with_gaps",
    )
    unknown: str = Field("", description="1: only runs with open items")
    gaps: str = Field("", description="1: only runs with capture gaps")
    drills: str = Field("", description="1: drills' runs (alone); they are left out otherwise")
    q: str = Field(
        "", description="Words the run's question or input has (each a word's start, any case)"
    )
    label: list[str] = Field(
        [], description="key=value: only runs carrying that label (repeatable: every one)"
    )
    time: str = Field(
        "created", description="The time from and to bound: created, started, finished"
    )
    since: str = Field("", alias="from", description="An ISO date or time: at or after it (UTC)")
    until: str = Field("", alias="to", description="An ISO date or time: before it (UTC)")


class RunRow(Schema):
    id: int
    agent: str
    agent_version: str
    question: str
    status: str
    status_words: str = Field(description="The status as the pages say it now")
    phase: str
    is_drill: bool
    imported: bool
    created_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    actions_done: int
    open_items: int
    capture_gaps: int
    completed_with_gaps: bool


class RunPage(Schema):
    runs: list[RunRow]
    next_cursor: str | None = Field(description="Pass as `before` for the next page; null: last")


class ReceiptOut(Schema):
    result_digest: str
    epoch: int
    created_at: dt.datetime


class ActionOut(Schema):
    id: int
    step_key: str
    identity: str
    kind: str
    effect_class: str
    state: str
    attempts: int
    epoch: int
    dispatched_at: dt.datetime
    finished_at: dt.datetime | None
    error: str
    receipt: ReceiptOut | None


class ReceiptsSummary(Schema):
    count: int
    last_at: dt.datetime | None
    actions_without_receipt: int = Field(description="Actions dispatched with no receipt")


class AnswerOut(Schema):
    number: int
    content: str
    is_final: bool
    committed_at: dt.datetime


class ItemRow(Schema):
    """The keys of the `outcomes` command's JSON (runs.inbox.listing_row)."""

    id: int
    kind: str = Field(description="checkpoint, receipt, publication or effect")
    state: str = Field(description="open or resolved")
    run_id: int
    run_status: str
    subject: str
    what: str = Field(description="What it is about: the action's identity, or the write")
    summary: str
    opened_at: dt.datetime
    age_seconds: int
    blocks: str = Field(description="nothing, further_effects or whole_run")
    blocks_why: str
    resolution: str
    resolved_at: dt.datetime | None


class OfferOut(Schema):
    choice: str
    label: str
    does: str = Field(description="What choosing it does")


class RunOut(RunRow):
    status_reason: str
    phase_reason: str
    input: dict[str, Any]
    action_budget: int
    deadline: dt.datetime | None
    cancel_requested_by: str
    offers: list[OfferOut] = Field(description="Resume or abandon, when it waits for an operator")
    answer: AnswerOut | None = Field(description="The latest answer revision")
    actions: list[ActionOut]
    receipts: ReceiptsSummary
    items: list[ItemRow]


class SubmitIn(Schema):
    agent: str = Field("research", description="An installed agent's name")
    input: dict[str, Any] = Field(description="The run's input, in the shape its agent declares")
    action_budget: int | None = Field(None, description="At most this many actions")
    deadline: dt.datetime | None = Field(None, description="Finalize by then")
    request_token: RequestToken


class SubmittedOut(Schema):
    run: RunOut
    repeated: bool = Field(description="True: an earlier request with this token queued it")


# -- items and decisions -----------------------------------------------------------------


class ItemFilters(Paged):
    """The inbox's filters (dashboard.inbox.item_filters), and the state."""

    state: str = Field("", description="open or resolved; both when absent")
    kind: str = Field("", description="checkpoint, receipt, publication or effect")
    run: str = Field("", description="A run's id")


class ItemPage(Schema):
    items: list[ItemRow]
    next_cursor: str | None


class DecisionOut(Schema):
    """The keys of the `outcomes` command's JSON."""

    id: int
    item_id: int | None
    run_id: int
    choice: str
    decided_by: str
    reason: str
    reference: str
    state_before: str
    state_after: str
    request_token: str
    evidence_digest: str = Field(description="SHA-256 of the evidence shown when deciding")
    at: dt.datetime


class ItemOut(ItemRow):
    evidence: dict[str, Any] = Field(description="The evidence, gathered now (runs.decisions)")
    offers: list[OfferOut] = Field(description="The choices the evidence allows now")
    decisions: list[DecisionOut]


class DecideIn(Schema):
    choice: str = Field(description="One of the choices offered (the item's or the run's offers)")
    # Stripped as the decision keeps it: blank is no reason.
    reason: Annotated[
        str,
        StringConstraints(strip_whitespace=True, min_length=1, max_length=REASON_MAX),
        AfterValidator(_storable),
    ]
    reference: Annotated[Text, Field(max_length=REFERENCE_MAX)] = ""
    request_token: RequestToken


class DecidedOut(Schema):
    decision: DecisionOut
    repeated: bool = Field(description="True: the decision taken earlier with this token")
    run_resumed: bool = Field(description="True: the run went back to the queue")

"""What the API takes and answers, declared once: ninja validates requests
against these, serialises answers through them, and the OpenAPI document
describes them (tests/test_api.py checks the answers against it)."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any

from ninja import Field, Schema
from pydantic import AfterValidator, StringConstraints, model_validator

from runs.bulk import BulkAction
from runs.decisions import REASON_MAX, REFERENCE_MAX
from runs.models import UNSTORABLE, DecisionChoice, OperatorDecision, OutcomeKind

TOKEN_MAX = OperatorDecision._meta.get_field("request_token").max_length


def _storable(text: str) -> str:
    if UNSTORABLE.search(text):
        raise ValueError("holds a character no text can: NUL or a lone surrogate")
    return text


Text = Annotated[str, AfterValidator(_storable)]
# Stripped as a decision (and a bulk job) keeps it: blank is no reason.
Reason = Annotated[
    str,
    StringConstraints(strip_whitespace=True, min_length=1, max_length=REASON_MAX),
    AfterValidator(_storable),
]
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
    reason: Reason
    reference: Annotated[Text, Field(max_length=REFERENCE_MAX)] = ""
    request_token: RequestToken


class DecidedOut(Schema):
    decision: DecisionOut
    repeated: bool = Field(description="True: the decision taken earlier with this token")
    run_resumed: bool = Field(description="True: the run went back to the queue")


# -- bulk jobs ---------------------------------------------------------------------------


class BulkIn(Schema):
    """What a bulk action is asked (runs/bulk.py): the runs, by a runs-list
    filter or by ids (one of the two), and the action."""

    filter: Annotated[Text, Field(max_length=2000)] | None = Field(
        None,
        description="A runs-list filter as its query string (status=needs_operator&agent="
        "research); '' selects every run (drills' aside)",
    )
    ids: list[int] | None = Field(None, min_length=1, max_length=100_000, description="Run ids")
    action: BulkAction = Field(description="cancel, resume or abandon each run, or decide items")
    choice: DecisionChoice | None = Field(
        None, description="decide: the choice taken on every open item of `kind`"
    )
    kind: OutcomeKind | None = Field(None, description="decide: the kind of items decided")

    @model_validator(mode="after")
    def _one_selection(self) -> BulkIn:
        if (self.filter is None) == (self.ids is None):
            raise ValueError("give the runs as `filter` or as `ids`, one of the two")
        return self


class BulkConfirmIn(BulkIn):
    reason: Reason
    request_token: RequestToken


class RunPlanOut(Schema):
    id: int
    status: str
    changes: list[str] = Field(description="What the action would change (empty: nothing)")
    refusals: list[str] = Field(description="What it would refuse, and why")


class DryRunOut(Schema):
    """The keys of `runs bulk --dry-run --json` (runs.bulk.DryRun.json)."""

    action: str
    choice: str
    kind: str
    filter: str | None
    ids: list[int] | None
    total: int = Field(description="Runs selected (counted up to one past the cap)")
    cap: int = Field(description="At most this many runs per job (RUNDESK_BULK_MAX_RUNS)")
    refused: str | None = Field(description="Why the whole selection is refused (null: it is not)")
    would_change: int
    would_refuse: int
    runs: list[RunPlanOut]


class BulkCounts(Schema):
    pending: int
    done: int
    refused: int
    stopped: int


class BulkJobRow(Schema):
    id: int
    action: str
    choice: str
    kind: str
    asks: str = Field(description="The action in the pages' words")
    filter: str | None = Field(description="The runs-list filter it was chosen by; null: by ids")
    requested_by: str
    reason: str
    state: str = Field(description="queued, running, done or stopped")
    total: int
    counts: BulkCounts
    stop_requested_by: str
    stop_requested_at: dt.datetime | None
    created_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    page: str = Field(description="The job's page on the dashboard (its progress, live)")


class BulkJobPage(Schema):
    jobs: list[BulkJobRow]
    next_cursor: str | None


class BulkResultOut(Schema):
    id: int
    run_id: int
    run_status: str
    result: str = Field(description="pending, done, refused or stopped")
    detail: str = Field(description="What changed, or why it was refused or not done")
    decisions: list[int] = Field(description="The decisions it recorded (the audit's rows)")
    finished_at: dt.datetime | None


class BulkResults(Schema):
    """A page of a job's per-run results, by item id."""

    after: int = Field(0, ge=0, description="The cursor of the page to read: a page's next_after")
    limit: int = Field(200, ge=1, le=1000, description="Results per page")
    result: str = Field("", description="pending, done, refused or stopped; all when absent")


class BulkJobOut(BulkJobRow):
    results: list[BulkResultOut]
    next_after: int | None = Field(description="Pass as `after` for the next results; null: last")


class BulkStartedOut(Schema):
    job: BulkJobOut
    repeated: bool = Field(description="True: an earlier request with this token started it")
    handover: str | None = Field(
        description="Why no worker could be asked yet (it is handed out again within a "
        "minute); null: a worker has it"
    )


class BulkStoppedOut(Schema):
    job: BulkJobOut
    stopped: int = Field(description="The runs this stop left not done")
    said: str

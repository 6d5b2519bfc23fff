"""The demo seeds sample runs, each of which submission takes, and one run
for each row of the decision table: each ends as its row says, through a
real executor."""

from __future__ import annotations

import pytest

from runs.decisions import settle_open_items
from runs.executor import Executor
from runs.management.commands.demo import DECISION_TABLE_RUNS, SAMPLE_RUNS, TWO_FUNDS
from runs.models import CheckpointOutcome, OutcomeItem, OutcomeKind, RunStatus
from runs.outcomes import xact_status
from runs.submission import submit
from tests.faultruns import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_every_sample_run_of_the_demo_is_taken_at_submission():
    runs = [submit(**sample) for sample in SAMPLE_RUNS]
    assert [run.status for run in runs] == [RunStatus.QUEUED] * len(SAMPLE_RUNS)


def test_each_decision_table_run_of_the_demo_ends_as_its_row_says(settings):
    settings.RUNDESK_SETTLE_SECONDS = 2
    runs = [
        submit(question=question, documents=TWO_FUNDS, faults=faults)
        for question, faults in DECISION_TABLE_RUNS
    ]
    outcomes = dict(Executor().serve(once=True))
    assert [outcomes[run.pk] for run in runs] == [
        RunStatus.COMPLETED,  # row 1: handled locally
        RunStatus.COMPLETED,  # row 2: committed, adopted
        RunStatus.COMPLETED,  # row 2: aborted, known not written
        RunStatus.COMPLETED,  # row 2: still in flight: unknown, the run went on
        "lease_lost",  # row 3: the old owner stops
        RunStatus.CANCELLED,  # row 3: nothing new dispatched
        RunStatus.NEEDS_OPERATOR,  # the effect's answer was lost
    ]
    records = [run.checkpoints.filter(state__isnull=True).first() for run in runs[:4]]
    assert [r.outcome for r in records] == [
        CheckpointOutcome.FAILED_BEFORE_WRITE,
        CheckpointOutcome.SETTLED_COMMITTED,
        CheckpointOutcome.SETTLED_NOT_WRITTEN,
        CheckpointOutcome.UNKNOWN,
    ]
    items = {item.run_id: item for item in OutcomeItem.objects.all()}
    assert set(items) == {runs[3].pk, runs[6].pk}
    assert items[runs[6].pk].kind == OutcomeKind.EFFECT

    late = items[runs[3].pk]
    wait_for(lambda: xact_status(late.xid) == "committed")
    assert settle_open_items().settled == 1
    records[3].refresh_from_db()
    assert records[3].outcome == CheckpointOutcome.SETTLED_COMMITTED

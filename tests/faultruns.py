"""Running a run with a fault plan, and the reverse checks asked of it."""

from __future__ import annotations

from typing import Any

from django.db import connection

from runs.executor import claim_and_drive
from runs.harness import wait_for as wait_for  # the tests' waits are the harness's
from runs.models import Action, Run, action_identity
from runs.submission import submit
from runs.timeline import EventKind, timeline

DOCS = ["northwind-clean-energy.md", "crestline-short-treasury.md", "meridian-world-equity.md"]
# The run's sequence with DOCS: action K is KEYS[K - 1].
KEYS = ["read:0", "summarize:0", "read:1", "summarize:1", "read:2", "summarize:2"]
KEYS += ["compose", "deliver"]


def run_with(faults: list[dict[str, Any]], documents: list[str] = DOCS) -> tuple[Run, str]:
    """Submits a run with a fault plan and executes it in this process."""
    run = submit(question="Compare these funds", documents=documents, faults=faults)
    outcome = claim_and_drive(run.pk)
    timeline.flush()
    run.refresh_from_db()
    return run, outcome


def executions(journal: Any, run: Run, step_key: str) -> int:
    """Real executions of an action's tool, counted outside the database."""
    return journal.counts()[action_identity(run.pk, step_key)]


def dispatched(run: Run, step_key: str) -> bool:
    return Action.objects.filter(run=run, step_key=step_key).exists()


def events(run: Run, kind: EventKind) -> list[str]:
    return list(run.events.filter(kind=kind).order_by("id").values_list("message", flat=True))


def write_in_flight() -> bool:
    """A write of this database is stalled after announcing its xid (the
    fault plan's cut): another database's sleep (a suite run beside this
    one) is none of its writes."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity"
            " WHERE wait_event = 'PgSleep' AND datname = current_database())"
        )
        return cursor.fetchone()[0]

"""A run's lifecycle (runs/lifecycle.py): the database refuses every change
of status the table does not allow, takes every one it does, and the
design document lists the same table."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from runs import lifecycle
from runs.benchmarks import holding_run
from runs.leases import Lease
from runs.lifecycle import ALLOWED, TERMINAL_STATUSES, RunStatus
from runs.models import Run

pytestmark = pytest.mark.django_db

DESIGN = Path(__file__).resolve().parent.parent / "docs" / "DESIGN.md"
REFUSED = "no transition of its lifecycle"


def columns(status: RunStatus) -> dict[str, object]:
    """The other columns a run in `status` has (its check constraints)."""
    running = status == RunStatus.RUNNING
    now = timezone.now()
    return {
        "status": status.value,
        "lease_owner": "owner" if running else "",
        "lease_expires_at": now + dt.timedelta(hours=1) if running else None,
        "finished_at": now if status in TERMINAL_STATUSES else None,
        "phase": "done" if status == RunStatus.COMPLETED else "research",
    }


def run_in(status: RunStatus) -> int:
    """A row inserted with `status`: no transition (as an imported run's, or
    a benchmark's raw INSERT)."""
    return Run.objects.create(question="q", documents=["a.md"], **columns(status)).pk


def move(run_id: int, target: RunStatus) -> None:
    """A raw UPDATE to `target`, every other column as `target` wants it:
    only the lifecycle's trigger can refuse it."""
    values = columns(target)
    sets = ", ".join(f"{name} = %s" for name in values)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"UPDATE runs_run SET {sets} WHERE id = %s", [*values.values(), run_id])


@pytest.mark.parametrize(("source", "target"), lifecycle.illegal(), ids=lambda s: str(s))
def test_the_database_refuses_a_change_of_status_the_lifecycle_does_not_allow(source, target):
    run_id = run_in(source)
    with pytest.raises(IntegrityError, match=REFUSED):
        move(run_id, target)
    assert Run.objects.get(pk=run_id).status == source


@pytest.mark.parametrize(("source", "target"), sorted(ALLOWED), ids=lambda s: str(s))
def test_the_database_takes_every_change_of_status_the_lifecycle_allows(source, target):
    run_id = run_in(source)
    move(run_id, target)
    assert Run.objects.get(pk=run_id).status == target


def test_every_pair_of_statuses_is_either_allowed_or_refused():
    pairs = {(s, t) for s in RunStatus for t in RunStatus if s != t}
    assert set(lifecycle.illegal()) | ALLOWED == pairs
    assert not set(lifecycle.illegal()) & ALLOWED
    # Nothing leaves a finished run.
    assert not {source for source, _ in ALLOWED} & set(TERMINAL_STATUSES)


def test_a_finished_run_keeps_its_status_and_its_other_columns_may_change():
    run_id = run_in(RunStatus.COMPLETED)
    with connection.cursor() as cursor:
        # The same status written again is no transition (the trigger's WHEN).
        cursor.execute(
            "UPDATE runs_run SET status = status, status_reason = 'noted' WHERE id = %s", [run_id]
        )
    run = Run.objects.get(pk=run_id)
    assert (run.status, run.status_reason) == (RunStatus.COMPLETED, "noted")


def test_the_trigger_fires_only_on_a_change_of_status():
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_get_triggerdef(oid) FROM pg_trigger"
            " WHERE tgrelid = 'runs_run'::regclass AND tgname = 'run_lifecycle'"
        )
        (definition,) = cursor.fetchone()
    assert "BEFORE UPDATE OF status ON public.runs_run" in definition
    assert "(old.status)::text IS DISTINCT FROM (new.status)::text" in definition


def test_the_design_document_lists_the_lifecycle_as_the_code_has_it():
    assert lifecycle.markdown_table() in DESIGN.read_text()


def test_a_benchmarks_holding_run_ends_at_once_through_the_lifecycle():
    run = holding_run("bench: rows only")
    assert (run.status, run.status_reason) == (
        RunStatus.CANCELLED,
        "a benchmark's run: never executed",
    )
    assert run.finished_at is not None and Lease.claim_next("executor") is None

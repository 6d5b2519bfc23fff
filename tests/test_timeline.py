"""The timeline is an observation: a row it cannot write leaves an honest
gap, and never takes the other events down with it."""

from __future__ import annotations

import pytest
from django.db import connection

from runs.models import Run, RunEvent
from runs.timeline import EventKind, Timeline

pytestmark = pytest.mark.django_db(transaction=True)

REFUSE_POISON = """
CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.message = 'poison' THEN RAISE EXCEPTION 'disk says no'; END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER refuse_poison BEFORE INSERT ON runs_runevent
    FOR EACH ROW EXECUTE FUNCTION refuse_poison();
"""


@pytest.fixture
def writer():
    timeline = Timeline()
    yield timeline
    timeline.stop()


def messages(run: Run) -> list[tuple[str, str]]:
    return list(run.events.order_by("id").values_list("kind", "message"))


def test_event_the_database_refuses_leaves_a_gap_and_the_others_are_written(writer):
    run = Run.objects.create(question="q", documents=["a.md"])
    with connection.cursor() as cursor:
        cursor.execute(REFUSE_POISON)
    try:
        writer.record(run.pk, EventKind.LEASE_ACQUIRED, "before")
        writer.record(run.pk, EventKind.ACTION_DISPATCHED, "poison")
        writer.record(run.pk, EventKind.ACTION_COMPLETED, "after")
        assert writer.flush()
        writer.record(run.pk, EventKind.RUN_COMPLETED, "later")
        assert writer.flush()
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER refuse_poison ON runs_runevent")
            cursor.execute("DROP FUNCTION refuse_poison()")
    assert messages(run) == [
        (EventKind.LEASE_ACQUIRED, "before"),
        (EventKind.ACTION_COMPLETED, "after"),
        (EventKind.EVENTS_LOST, "1 timeline events were not recorded (db_error)"),
        (EventKind.RUN_COMPLETED, "later"),
    ]
    gap = run.events.get(kind=EventKind.EVENTS_LOST)
    assert gap.data == {"count": 1, "reason": "db_error"}


def test_event_of_a_missing_run_is_dropped_without_poisoning_later_batches(writer):
    run = Run.objects.create(question="q", documents=["a.md"])
    writer.record(987_654, EventKind.LEASE_ACQUIRED, "no such run")
    writer.record(run.pk, EventKind.LEASE_ACQUIRED, "same batch")
    assert writer.flush()
    writer.record(run.pk, EventKind.RUN_COMPLETED, "next batch")
    assert writer.flush()
    assert messages(run) == [
        (EventKind.LEASE_ACQUIRED, "same batch"),
        (EventKind.RUN_COMPLETED, "next batch"),
    ]
    assert not RunEvent.objects.filter(run_id=987_654).exists()

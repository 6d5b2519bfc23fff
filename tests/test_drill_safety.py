"""Drills touch nothing of production's: a drill that cannot have its lock
on a table production writes within its lock timeout gives way (not_run,
saying why), so production's writes never queue behind it for longer; and
what a drill killed mid-scenario left behind is removed when the next one
starts, and said."""

from __future__ import annotations

import json
import threading
import time
from io import StringIO

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection

from runs.drills import LOCK_TIMEOUT, run_scenario
from runs.models import Drill, DrillVerdict
from tests.faultruns import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT_SECONDS = float(LOCK_TIMEOUT.removesuffix("s"))
# Room for a loaded machine, well short of "for as long as the stranger holds it".
SLACK_SECONDS = 2.0
STRANGER_HOLDS_SECONDS = 15.0


def session(**extra: object) -> psycopg.Connection:
    return psycopg.connect(**connection.get_connection_params(), **extra)


def drill_waiting_for_a_lock() -> bool:
    with session(autocommit=True) as look:
        return look.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND query LIKE '%CREATE TRIGGER rundesk_drill_%')"
        ).fetchone()[0]


def test_a_drill_that_cannot_lock_runs_receipt_gives_way_and_holds_no_write_up() -> None:
    # A stranger's open transaction holds what an uncommitted receipt holds
    # on runs_receipt; a trigger's DDL needs a lock that conflicts with it.
    stranger = session()
    stranger.execute("LOCK TABLE runs_receipt IN ROW EXCLUSIVE MODE")
    # Without a bound, the drill would wait for as long as the stranger
    # holds it: let it go in the end so that the test fails, not hangs.
    release = threading.Timer(STRANGER_HOLDS_SECONDS, stranger.close)
    release.start()
    waited: list[float] = []

    def production_writes_a_receipt() -> None:
        # Once the drill's DDL waits, a receipt write queues behind it.
        wait_for(drill_waiting_for_a_lock, timeout=STRANGER_HOLDS_SECONDS)
        with session(autocommit=True) as production:
            production.execute("SET statement_timeout = '20s'")
            started = time.monotonic()
            production.execute("BEGIN; LOCK TABLE runs_receipt IN ROW EXCLUSIVE MODE; ROLLBACK")
            waited.append(time.monotonic() - started)

    writer = threading.Thread(target=production_writes_a_receipt)
    writer.start()
    try:
        drill = Drill.objects.create(scenarios=["invented_receipt"], started_by="test")
        started = time.monotonic()
        result = run_scenario(drill, "invented_receipt")
        took = time.monotonic() - started
        writer.join()
    finally:
        release.cancel()
        stranger.close()

    assert result.verdict == DrillVerdict.NOT_RUN, result.detail
    assert "creating trigger rundesk_drill_receipt_" in result.detail
    assert "on runs_receipt: another session held a lock" in result.detail
    assert took < TIMEOUT_SECONDS + SLACK_SECONDS + 3  # the scenario's run is submitted first
    assert waited and waited[0] < TIMEOUT_SECONDS + SLACK_SECONDS
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'rundesk_drill_%%'")
        assert cursor.fetchone()[0] == 0


def test_a_drill_that_cannot_lock_an_evidence_table_gives_way() -> None:
    stranger = session()
    stranger.execute("LOCK TABLE evidence_modelcall IN ACCESS SHARE MODE")
    release = threading.Timer(STRANGER_HOLDS_SECONDS, stranger.close)
    release.start()
    try:
        drill = Drill.objects.create(scenarios=["capture_table_lock"], started_by="test")
        started = time.monotonic()
        result = run_scenario(drill, "capture_table_lock")
        took = time.monotonic() - started
    finally:
        release.cancel()
        stranger.close()
    assert result.verdict == DrillVerdict.NOT_RUN, result.detail
    assert (
        "LOCK TABLE evidence_modelcall IN ACCESS EXCLUSIVE MODE: another session" in result.detail
    )
    assert took < TIMEOUT_SECONDS + SLACK_SECONDS + 3


LEFT = """
CREATE FUNCTION rundesk_drill_receipt_999999() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN RETURN NULL; END $$;
CREATE TRIGGER rundesk_drill_receipt_999999 BEFORE INSERT ON runs_receipt FOR EACH ROW
    WHEN (NEW.run_id = 999999) EXECUTE FUNCTION rundesk_drill_receipt_999999();
CREATE FUNCTION rundesk_drill_stall_999998() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN PERFORM pg_sleep(3); RETURN NEW; END $$;
"""


def drill_objects() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT tgname FROM pg_trigger WHERE tgname LIKE 'rundesk\\_drill\\_%%'"
            " UNION ALL SELECT proname FROM pg_proc WHERE proname LIKE 'rundesk\\_drill\\_%%'"
        )
        return [name for (name,) in cursor.fetchall()]


@pytest.mark.parametrize("as_json", [True, False])
def test_what_a_killed_drill_left_is_removed_when_the_next_starts_and_said(as_json) -> None:
    # As a drill killed between creating its trigger and dropping it leaves
    # them (and a function whose trigger was dropped).
    with connection.cursor() as cursor:
        cursor.execute(LEFT)
    assert len(drill_objects()) == 3

    out = StringIO()
    args = ["--json"] if as_json else []
    call_command("drill", "--scenario", "cancel_of_dead_owner", *args, stdout=out)

    assert drill_objects() == []
    said = json.loads(out.getvalue())["leftovers_removed"] if as_json else out.getvalue()
    for what in (
        "trigger rundesk_drill_receipt_999999 on runs_receipt",
        "function rundesk_drill_receipt_999999()",
        "function rundesk_drill_stall_999998()",
    ):
        assert f"removed {what}" in str(said)
    if not as_json:  # the installed agents a drill skips are named
        assert "not drilled (no drill input): support-approved" in said

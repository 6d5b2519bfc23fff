"""Retention: `purge_runs` and beat's daily job remove exactly the ended runs
older than the age, with every row of theirs, in short batches; never a
run with an open item, nor one queued, running or waiting; a dry run
changes nothing; with --bundle-to each bundle is written and verified
first, and a run whose bundle fails is kept.  Real runs on a real
PostgreSQL, a second real connection where a lock is held."""

from __future__ import annotations

import datetime as dt
import io
import json
import os
import subprocess
import sys
import uuid
from collections import Counter

import psycopg
import pytest
from django.contrib.auth.models import Group, Permission, User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import IntegrityError, connection, transaction
from django.db.models import F
from django.utils import timezone

from dashboard.models import ApiSubmission
from evidence import bundles
from evidence.capture import capture, record_gaps
from evidence.models import BundleExport, LockIncident, LockWait
from runs import retention
from runs.benchmarks import purge as purge_bench
from runs.bulk import BulkAction, BulkJob, BulkJobItem
from runs.decisions import Request, Who, decide
from runs.executor import claim_and_drive
from runs.leases import Lease
from runs.models import (
    Alert,
    AlertState,
    Approval,
    ApprovalState,
    DecisionChoice,
    Hold,
    HoldWait,
    OutcomeItem,
    PurgedCount,
    Run,
    RunStatus,
)
from runs.submission import submit
from runs.tasks import purge_runs
from runs.timeline import timeline
from tests.conftest import ROOT
from tests.faultruns import DOCS, run_with

pytestmark = pytest.mark.django_db(transaction=True)

AGE = dt.timedelta(days=30)


def aged(run: Run, days: int = 40) -> Run:
    """The run as if it had ended `days` ago."""
    Run.objects.filter(pk=run.pk).update(finished_at=F("finished_at") - dt.timedelta(days=days))
    run.refresh_from_db()
    return run


def settled_and_completed(settings) -> Run:
    """A run whose delivery answer was lost (an item, a webhook alert), settled
    by an operator, then resumed (a second owner: a takeover) to completion;
    with a capture gap, a lock wait naming it and a bundle export with its
    file: a row in every table a run has rows in."""
    settings.RUNDESK_ALERT_URL = "http://127.0.0.1:9/alerts"
    run, outcome = run_with([{"point": "delivery_timeout"}], documents=DOCS[:2])
    assert outcome == RunStatus.NEEDS_OPERATOR
    user = User.objects.create_user(f"olga-{uuid.uuid4().hex[:6]}")
    group, _ = Group.objects.get_or_create(name="operators")
    group.permissions.add(Permission.objects.get(codename="operate_run"))
    user.groups.add(group)
    request = Request(
        choice=DecisionChoice.CONFIRMED_HAPPENED,
        who=Who(user=User.objects.get(pk=user.pk)),
        token=uuid.uuid4().hex,
        reason="in the receiver's log",
        reference="DLV-1",
    )
    decide(OutcomeItem.objects.get(run=run).pk, request)
    # Its alert went out at the second attempt.
    sent = Alert.objects.filter(item__run=run).update(
        state=AlertState.SENT, attempts=2, sent_at=timezone.now(), next_try_at=None
    )
    assert sent == 1
    assert claim_and_drive(run.pk) == "completed"
    record_gaps(Counter({(run.pk, None, "lock_not_available", "test"): 2}))
    incident = LockIncident.objects.create(source="sampler", processes=2)
    LockWait.objects.create(
        incident=incident, waiter_pid=1, blocker_pid=2, waiter_run=run, blocker_run=run
    )
    export = BundleExport.objects.create(run=run, requested_by="olga")
    now = timezone.now()
    assert export.start(now)
    export.path.parent.mkdir(parents=True, exist_ok=True)
    export.path.write_bytes(b"a bundle")
    assert export.finish(rows=1, size=8, seal="0" * 64, now=now)
    rows_above(run, user)
    timeline.flush()
    capture.flush()
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED
    return run


def rows_above(run: Run, user: User) -> None:
    """The rows approvals, holds, bulk jobs and the API keep of a run (their
    own tests make them the long way): a decided approval, a wait on a
    released hold, a bulk job's result, an API submission."""
    now = timezone.now()
    later = now + dt.timedelta(seconds=1)
    item = OutcomeItem.objects.get(run=run)
    Approval.objects.create(
        run=run,
        item=item,
        step_key="send",
        tool="send_reply",
        proposed={"to": "a@example.com"},
        proposed_digest="0" * 64,
        approvers="approvers",
        expires_at=later,
        state=ApprovalState.REJECTED,
        decision=item.decisions.get(),
        decided_at=later,
    )
    hold = Hold.objects.create(
        tool="deliver_report",
        reason="a receiver down",
        added_by="olga",
        released_by="olga",
        released_at=later,
        release_reason="it is back",
    )
    HoldWait.objects.create(hold=hold, run=run, step_key="deliver", until=later)
    job = BulkJob.objects.create(
        request_token=uuid.uuid4().hex,
        user=user,
        requested_by="olga",
        action=BulkAction.CANCEL,
        reason="tidying",
        cap=1000,
        total=1,
    )
    BulkJobItem.objects.create(job=job, run=run)
    ApiSubmission.objects.create(
        user=user, request_token=uuid.uuid4().hex, request_digest="0" * 64, run=run
    )


def rows_of(run_id: int) -> dict[str, int]:
    """Rows that belong to the run, in every table that holds a run's rows."""
    counts = {}
    with connection.cursor() as cursor:
        for table, column in foreign_keys_to("runs_run"):
            cursor.execute(f"SELECT count(*) FROM {table} WHERE {column} = %s", [run_id])
            counts[f"{table}.{column}"] = cursor.fetchone()[0]
        for table, via, parent in [
            ("runs_alert", "item_id", "runs_outcomeitem"),
            ("evidence_modelcall_sources", "modelcall_id", "evidence_modelcall"),
            ("evidence_evidencecopy_sources", "evidencecopy_id", "evidence_evidencecopy"),
        ]:
            cursor.execute(
                f"SELECT count(*) FROM {table} WHERE {via} IN"
                f" (SELECT id FROM {parent} WHERE run_id = %s)",
                [run_id],
            )
            counts[table] = cursor.fetchone()[0]
        cursor.execute("SELECT count(*) FROM runs_run WHERE id = %s", [run_id])
        counts["runs_run"] = cursor.fetchone()[0]
    return counts


def foreign_keys_to(table: str) -> list[tuple[str, str]]:
    """(table, column) of every foreign key in the database that references `table`."""
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT c.conrelid::regclass::text, a.attname
               FROM pg_constraint c
               JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = ANY(c.conkey)
               WHERE c.contype = 'f' AND c.confrelid = %s::regclass
               ORDER BY 1, 2""",
            [table],
        )
        return cursor.fetchall()


def everything() -> dict[str, int]:
    """Rows of every table of the project's apps."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
            " AND tablename ~ '^(runs|evidence|dashboard)_' ORDER BY 1"
        )
        tables = [name for (name,) in cursor.fetchall()]
        counts = {}
        for table in tables:
            cursor.execute(f"SELECT count(*) FROM {table}")
            counts[table] = cursor.fetchone()[0]
    return counts


@pytest.fixture
def fleet(settings, journal) -> dict[str, Run]:
    """Runs of every kind retention meets, the ended ones aged past AGE
    but `recent`."""
    story = aged(settled_and_completed(settings))
    failed = aged(run_with([{"point": "tool_error", "action": 3}], documents=DOCS[:1])[0])
    recent = run_with([], documents=DOCS[:1])[0]
    held, outcome = run_with([{"point": "delivery_timeout"}], documents=DOCS[:1])
    assert outcome == RunStatus.NEEDS_OPERATOR
    waiting = Run.objects.get(pk=held.pk)
    cancelled_open, _ = run_with([{"point": "delivery_timeout"}], documents=DOCS[:1])
    assert cancelled_open.request_cancel("olga", "nobody wants it")
    cancelled_open = aged(Run.objects.get(pk=cancelled_open.pk))
    queued = submit(question="Compare these funds", documents=DOCS[:1])
    running = submit(question="Compare these funds", documents=DOCS[:1])
    assert Lease.claim(running.pk, "test-owner") is not None
    timeline.flush()
    capture.flush()
    return {
        "story": story,
        "failed": failed,
        "recent": recent,
        "waiting": waiting,
        "cancelled_open": cancelled_open,
        "queued": queued,
        "running": running,
    }


def test_every_foreign_key_to_a_run_or_its_rows_is_purged():
    handled = {name.split(".")[0] for name, _ in retention.REMOVALS}
    # An incident opened with an imported run's bundle: imported runs are
    # never purgeable (an operator opened them on purpose).
    on_purpose = {("evidence_lockincident", "imported_run_id")}
    for parent in [
        "runs_run",
        "runs_action",
        "runs_outcomeitem",
        "runs_checkpoint",
        "evidence_modelcall",
        "evidence_source",
        "evidence_evidencecopy",
    ]:
        for table, column in foreign_keys_to(parent):
            assert table in handled or (table, column) in on_purpose, (
                f"{table}.{column} references {parent}: the purge must remove it or say why not"
            )


def test_purge_removes_exactly_the_purgeable_runs_and_every_row_of_theirs(fleet, settings):
    story, failed = fleet["story"], fleet["failed"]
    before = rows_of(story.pk)
    # The story touches every table a run has rows in: the check below means something.
    assert [name for name, n in before.items() if n == 0 and "imported_run" not in name] == []
    export_file = BundleExport.objects.get(run=story).path
    kept = {name: rows_of(run.pk) for name, run in fleet.items() if name not in {"story", "failed"}}
    wait = LockWait.objects.get(waiter_run=story)

    purged = retention.purge(AGE)

    assert sorted(purged.run_ids) == sorted([story.pk, failed.pk])
    assert purged.by_status == Counter({"completed": 1, "failed": 1})
    assert purged.kept["an open item (an operator may still decide it)"] == 1
    assert not purged.skipped and not purged.refused and not purged.stopped
    for run in (story, failed):
        assert all(count == 0 for count in rows_of(run.pk).values()), rows_of(run.pk)
    for name, rows in kept.items():
        assert rows_of(fleet[name].pk) == rows, name
    # The incident is the server's: the wait stays, without its run.
    wait.refresh_from_db()
    assert wait.waiter_run_id is None and wait.blocker_run_id is None
    assert not export_file.exists()
    assert purged.rows["runs_run"] == 2
    assert purged.rows["runs_receipt"] >= before["runs_receipt.run_id"]
    # What /metrics counts of the removed rows is kept: its counters never go down.
    tallies = {(t.counter, t.label): t.value for t in PurgedCount.objects.all()}
    assert tallies == {
        ("lease_takeovers", ""): 1,
        ("alerts_sent", "webhook"): 1,
        ("alert_failures", "webhook"): 1,
    }


def test_a_purge_again_finds_nothing_and_the_kept_runs_stay_for_good(fleet):
    retention.purge(AGE)
    again = retention.purge(AGE)
    assert again.run_ids == [] and again.batches == 0
    assert Run.objects.filter(pk__in=[r.pk for r in fleet.values()]).count() == 5


def test_small_batches_remove_the_same_runs(fleet):
    purged = retention.purge(AGE, batch=1)
    assert sorted(purged.run_ids) == sorted([fleet["story"].pk, fleet["failed"].pk])
    assert purged.batches == 2


def test_status_chooses_which_ended_runs_go(fleet):
    purged = retention.purge(AGE, statuses=["failed"])
    assert purged.run_ids == [fleet["failed"].pk]
    assert Run.objects.filter(pk=fleet["story"].pk).exists()


def test_a_dry_run_changes_nothing_and_says_what_would_go(fleet):
    before = everything()
    out = io.StringIO()
    call_command("purge_runs", "--older-than", "30d", "--dry-run", "--json", stdout=out)
    report = json.loads(out.getvalue())
    assert everything() == before
    assert report["dry_run"] is True
    assert sorted(report["run_ids"]) == sorted([fleet["story"].pk, fleet["failed"].pk])
    assert report["by_status"] == {"completed": 1, "failed": 1}


def test_the_json_report_says_what_went(fleet):
    out = io.StringIO()
    call_command("purge_runs", "--older-than", "P30D", "--json", stdout=out)
    report = json.loads(out.getvalue())
    assert report["dry_run"] is False
    assert report["runs"] == 2
    assert report["rows"]["runs_run"] == 2
    assert report["rows"]["runs_action"] > 0
    assert report["refused"] == [] and report["skipped"] == [] and report["stopped"] == ""
    assert report["older_than_seconds"] == AGE.total_seconds()


def test_nothing_is_ended_long_enough_ago_for_a_longer_age(fleet):
    out = io.StringIO()
    call_command("purge_runs", "--older-than", "60d", stdout=out)
    assert out.getvalue().startswith("removed 0 runs")
    assert Run.objects.count() == len(fleet)


@pytest.mark.parametrize("age", ["30", "soon", "0d", "-3d", ""])
def test_a_bad_age_is_refused_saying_what_an_age_looks_like(age):
    with pytest.raises(CommandError, match="--older-than"):
        call_command("purge_runs", "--older-than", age)


def test_bundle_to_writes_verifiable_bundles_before_deleting(fleet, tmp_path):
    out = io.StringIO()
    call_command(
        "purge_runs", "--older-than", "30d", "--bundle-to", str(tmp_path), "--json", stdout=out
    )
    report = json.loads(out.getvalue())
    written = {entry["run_id"]: entry for entry in report["bundles"]}
    assert sorted(written) == sorted([fleet["story"].pk, fleet["failed"].pk])
    for run_id, entry in written.items():
        path = tmp_path / f"run-{run_id}.zip"
        assert entry["path"] == str(path)
        checked = bundles.verify(path)
        assert checked.ok, checked.problems
        assert checked.manifest["run_id"] == run_id and checked.manifest["seal"] == entry["seal"]
        assert not Run.objects.filter(pk=run_id).exists()


def test_bundle_to_makes_each_bundles_name_durable_before_the_rows_go(
    fleet, tmp_path, file_syncs, monkeypatch
):
    # A bundle renamed into its folder, the folder not synced, may vanish
    # in a crash after the rows it keeps were removed.
    remove = retention._remove

    def removing(ids, *args):
        file_syncs.append(("remove", str(sorted(ids))))
        return remove(ids, *args)

    monkeypatch.setattr(retention, "_remove", removing)
    call_command(
        "purge_runs", "--older-than", "30d", "--bundle-to", str(tmp_path), stdout=io.StringIO()
    )
    removals = [i for i, (what, _) in enumerate(file_syncs) if what == "remove"]
    folder_syncs = [i for i, each in enumerate(file_syncs) if each == ("fsync", str(tmp_path))]
    assert removals and len(folder_syncs) == 2
    assert max(folder_syncs) < removals[0], file_syncs


def test_a_run_whose_bundle_fails_is_kept_saying_why(fleet, tmp_path):
    story, failed = fleet["story"], fleet["failed"]
    (tmp_path / f"run-{story.pk}.zip").mkdir()  # its bundle cannot take this name
    out = io.StringIO()
    with pytest.raises(CommandError, match="1 runs kept because their bundle failed"):
        call_command(
            "purge_runs", "--older-than", "30d", "--bundle-to", str(tmp_path), "--json", stdout=out
        )
    report = json.loads(out.getvalue())
    assert [r["run_id"] for r in report["refused"]] == [story.pk]
    assert "its bundle failed" in report["refused"][0]["why"]
    assert Run.objects.filter(pk=story.pk).exists()
    assert rows_of(story.pk)["runs_receipt.run_id"] > 0
    assert report["run_ids"] == [failed.pk]
    assert bundles.verify(tmp_path / f"run-{failed.pk}.zip").ok


def test_bundle_to_must_be_a_folder(tmp_path):
    with pytest.raises(CommandError, match="no such folder"):
        call_command("purge_runs", "--older-than", "30d", "--bundle-to", str(tmp_path / "no"))


def test_a_run_another_transaction_holds_is_left_for_the_next_purge(fleet):
    story = fleet["story"]
    params = connection.get_connection_params()
    with psycopg.connect(**params) as other:
        other.execute("SELECT 1 FROM runs_run WHERE id = %s FOR KEY SHARE", [story.pk])
        purged = retention.purge(AGE)
        assert purged.skipped == [story.pk]
        assert purged.run_ids == [fleet["failed"].pk]
        other.rollback()
    assert Run.objects.filter(pk=story.pk).exists()
    assert retention.purge(AGE).run_ids == [story.pk]


def test_a_strangers_table_lock_stops_the_purge_within_its_lock_wait(fleet):
    params = connection.get_connection_params()
    with psycopg.connect(**params) as other:
        other.execute("LOCK TABLE runs_runevent IN SHARE MODE")
        purged = retention.purge(AGE)
        other.rollback()
    assert purged.stopped.startswith("a lock was not granted within 1s")
    assert purged.run_ids == []
    assert Run.objects.filter(pk=fleet["story"].pk).exists()  # the batch rolled back whole


def test_facts_cannot_be_deleted_outside_a_purge(fleet):
    story, waiting = fleet["story"], fleet["waiting"]
    for table in ["runs_receipt", "runs_answerrevision", "runs_operatordecision"]:
        with (
            pytest.raises(IntegrityError, match="immutable"),
            transaction.atomic(),
            connection.cursor() as cursor,
        ):
            cursor.execute(f"DELETE FROM {table} WHERE run_id = %s", [story.pk])
    with (
        pytest.raises(IntegrityError, match="checkpoints are records"),
        transaction.atomic(),
        connection.cursor() as cursor,
    ):
        cursor.execute("DELETE FROM runs_checkpoint WHERE run_id = %s", [story.pk])
    # Even with the purge's setting: never a run that has not ended, never an open item.
    with (
        pytest.raises(IntegrityError, match="immutable"),
        transaction.atomic(),
        connection.cursor() as cursor,
    ):
        cursor.execute("SELECT set_config('rundesk.purge', 'on', true)")
        cursor.execute("DELETE FROM runs_receipt WHERE run_id = %s", [waiting.pk])
    with (
        pytest.raises(IntegrityError, match="items are records"),
        transaction.atomic(),
        connection.cursor() as cursor,
    ):
        cursor.execute("SELECT set_config('rundesk.purge', 'on', true)")
        cursor.execute(
            "DELETE FROM runs_outcomeitem WHERE run_id = %s", [fleet["cancelled_open"].pk]
        )


def test_the_daily_job_purges_with_the_configured_age(fleet, settings, tmp_path):
    settings.RUNDESK_PURGE_AFTER = None
    assert "off" in purge_runs.apply().get()
    assert Run.objects.filter(pk=fleet["story"].pk).exists()
    settings.RUNDESK_PURGE_AFTER = AGE
    settings.RUNDESK_PURGE_BUNDLE_DIR = tmp_path
    done = purge_runs.apply().get()
    assert done["runs"] == 2 and "run_ids" not in done
    assert sorted(p.name for p in tmp_path.glob("*.zip")) == sorted(
        f"run-{r.pk}.zip" for r in (fleet["story"], fleet["failed"])
    )
    assert not Run.objects.filter(pk=fleet["story"].pk).exists()


def beat_schedule(**env: str) -> subprocess.CompletedProcess[str]:
    """Beat's schedule as settings.py makes it from `env`, in a process of its own."""
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import django; django.setup(); from django.conf import settings; "
            "entry = settings.CELERY_BEAT_SCHEDULE.get('rundesk-purge'); "
            "print(entry and (entry['task'], sorted(entry['schedule'].hour)))",
        ],
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "dashboard.settings", "DEBUG": "1", **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_beat_schedules_the_daily_purge_only_when_an_age_is_set():
    off = beat_schedule(RUNDESK_PURGE_AFTER="")
    assert off.returncode == 0 and off.stdout.strip() == "None", off.stderr
    on = beat_schedule(RUNDESK_PURGE_AFTER="90d", RUNDESK_PURGE_HOUR="4")
    assert on.returncode == 0, on.stderr
    assert on.stdout.strip() == "('runs.tasks.purge_runs', [4])"
    bad = beat_schedule(RUNDESK_PURGE_AFTER="ninety days")
    assert bad.returncode != 0 and "RUNDESK_PURGE_AFTER" in bad.stderr


def test_the_purge_benchmarks_runs_are_whole_runs_the_purge_removes():
    purge_bench.seed(3)
    purged = retention.purge(dt.timedelta(days=300))
    assert len(purged.run_ids) == 3
    assert purged.rows == Counter(
        {
            "runs_run": 3,
            "runs_action": 6,
            "runs_receipt": 6,
            "runs_checkpoint": 3,
            "runs_answerrevision": 3,
            "runs_runevent": 30,
        }
    )  # and 0 of every other kind: Counters compare missing as 0

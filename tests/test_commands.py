"""submit_run, executor and bench, as an operator types them."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import socket
from collections.abc import Iterator
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.db.models.functions import Now

from runs.benchmarks import pages, steps
from runs.models import Run, RunStatus
from runs.submission import submit
from tests.conftest import manage

pytestmark = pytest.mark.django_db(transaction=True)


def run_command(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


@contextlib.contextmanager
def unanswering_broker(kind: str) -> Iterator[str]:
    """A Redis address where nothing listens ("refuses"), or where the
    connection is taken and never answered ("never answers": a dead link,
    a half-open connection, a frozen server)."""
    sock = socket.create_server(("127.0.0.1", 0), backlog=64)
    url = f"redis://127.0.0.1:{sock.getsockname()[1]}/7"
    if kind == "refuses":
        sock.close()
    try:
        yield url
    finally:
        sock.close()


@pytest.mark.parametrize("broker", ["refuses", "never answers"])
def test_submit_run_says_its_run_is_queued_when_the_broker_does_not_answer(process_env, broker):
    """The run is committed before it is handed to Celery: a broker that
    does not take it is a warning, with the run's id (before, a traceback
    and exit 1 for a run the sweep then delivered: submitted again, it was
    delivered twice; and a broker that never answered was waited for for
    ever)."""
    with unanswering_broker(broker) as url:
        env = {**process_env, "CELERY_BROKER_URL": url, "RUNDESK_BROKER_TIMEOUT": "0.5"}
        args = ["submit_run", "--question", "Compare", "--doc", "a.md", "--celery", "--json"]
        done = manage(*args, env=env)
        out, err = done.communicate(timeout=90)
    assert done.returncode == 0, err
    run = Run.objects.get(pk=json.loads(out)["run_id"])
    assert run.status == RunStatus.QUEUED
    assert f"run {run.pk} is queued, but handing it to Celery failed" in err
    assert "Traceback" not in err


def test_beats_sweep_goes_on_when_the_broker_never_answers(process_env):
    """Beat runs the sweep itself (runs.tasks.SweepingScheduler); a sweep
    stuck handing a run to a broker that never answers stopped every sweep
    after it, without a word."""
    stale = [submit(question=f"q{i}", documents=["a.md"]) for i in range(3)]
    Run.objects.update(queued_at=Now() - dt.timedelta(minutes=5))
    cancelled = submit(question="q", documents=["a.md"])
    Run.objects.filter(pk=cancelled.pk).update(
        status=RunStatus.RUNNING,
        lease_owner="dead",
        lease_epoch=1,
        lease_expires_at=Now() - dt.timedelta(seconds=30),
        cancel_requested_at=Now(),
        cancel_requested_by="olga",
    )
    with unanswering_broker("never answers") as url:
        env = {**process_env, "CELERY_BROKER_URL": url, "RUNDESK_BROKER_TIMEOUT": "0.5"}
        code = "import json; from runs.tasks import sweep; print(json.dumps(sweep()))"
        done = manage("shell", "-c", code, env=env)
        out, err = done.communicate(timeout=90)
    assert done.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["redelivered"] == 3
    # One hand-over failed; the others were not tried: the broker is down.
    (warning,) = [line for line in err.splitlines() if "not handed to Celery" in line]
    listed = warning.split("runs [", 1)[1].split("]", 1)[0]
    assert sorted(int(pk) for pk in listed.split(", ")) == [r.pk for r in stale]
    # What the sweep decides in the database it did: the dead owner's
    # cancelled run ended, and the stale runs stay queued for the next sweep.
    assert Run.objects.get(pk=cancelled.pk).status == RunStatus.CANCELLED
    assert set(
        Run.objects.filter(pk__in=[r.pk for r in stale]).values_list("status", flat=True)
    ) == {RunStatus.QUEUED}


def test_submit_run_queues_a_run_and_prints_its_id_as_json():
    out = run_command(
        "submit_run",
        "--question",
        "Compare",
        "--doc",
        "northwind-clean-energy.md",
        "--doc",
        "meridian-world-equity.md",
        "--budget",
        "9",
        "--faults",
        '[{"point": "tool_delay", "ms": 5}]',
        "--json",
    )
    run = Run.objects.get(pk=json.loads(out)["run_id"])
    assert run.documents == ["northwind-clean-energy.md", "meridian-world-equity.md"]
    assert (run.status, run.action_budget, run.faults) == (
        RunStatus.QUEUED,
        9,
        [{"point": "tool_delay", "ms": 5}],
    )


@pytest.mark.parametrize(
    "faults, message",
    [("{not json", "not valid JSON"), ('[{"point": "meteor"}]', "'point' must be one of")],
)
def test_submit_run_refuses_a_bad_fault_plan_and_queues_nothing(faults, message):
    with pytest.raises(CommandError, match=message):
        run_command("submit_run", "--question", "q", "--doc", "a.md", "--faults", faults)
    assert not Run.objects.exists()


@pytest.mark.parametrize(
    "option, message",
    [
        (("--deadline-seconds", "1e12"), "no date is that far"),
        (("--deadline-seconds", "nan"), "no date is that far"),
        (("--budget", "3000000000"), "at most 2147483647"),
    ],
)
def test_submit_run_refuses_what_no_run_can_hold_and_queues_nothing(option, message):
    with pytest.raises(CommandError, match=message):
        run_command("submit_run", "--question", "q", "--doc", "a.md", *option)
    assert not Run.objects.exists()


def test_executor_run_executes_one_run_and_reports_it():
    run = submit(question="q", documents=["northwind-clean-energy.md"])
    other = submit(question="q", documents=["northwind-clean-energy.md"])
    out = run_command("executor", "--run", str(run.pk), "--json")
    assert json.loads(out) == {"run_id": run.pk, "outcome": "completed"}
    assert Run.objects.get(pk=other.pk).status == RunStatus.QUEUED


def test_executor_run_refuses_an_unknown_run():
    with pytest.raises(CommandError, match="no run 999"):
        run_command("executor", "--run", "999")


def test_executor_takes_more_runs_at_once_than_the_server_has_connections():
    # Runs share the process's pool: concurrency is not bounded by the
    # server's max_connections any more (issue 39).
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('max_connections')::int")
        max_connections = cursor.fetchone()[0]
    runs = [submit(question="q", documents=["northwind-clean-energy.md"]) for _ in range(2)]
    err = StringIO()
    call_command(
        "executor",
        "--once",
        "--concurrency",
        str(max_connections + 1),
        stdout=StringIO(),
        stderr=err,
    )
    assert err.getvalue() == ""
    assert {Run.objects.get(pk=run.pk).status for run in runs} == {RunStatus.COMPLETED}


def test_the_dashboard_benchmark_seeds_rows_the_schema_accepts():
    # Raw SQL, so a new NOT NULL column of runs_run would break it unseen.
    big = pages.seed(12, 3)
    assert Run.objects.filter(question__startswith="Compare the funds").count() == 12
    assert Run.objects.get(pk=big).events.count() == pages.BIG_RUN_EVENTS


def test_bench_takes_one_benchmark_at_a_time_or_all():
    with pytest.raises(CommandError, match="one benchmark at a time, or --all"):
        call_command("bench", "--peers", "--throughput")


def test_bench_refuses_a_database_whose_schema_is_not_the_codes():
    # The test database one migration behind the code: its newest
    # migration's row taken out for the test (a database made for it would
    # cost a DROP DATABASE, which waits for a checkpoint).
    with connection.cursor() as cursor:
        cursor.execute(
            "DELETE FROM django_migrations WHERE id = (SELECT max(id) FROM django_migrations)"
            " RETURNING app, name, applied"
        )
        removed = cursor.fetchone()
    try:
        with pytest.raises(CommandError, match=r"has 1 migrations not applied: run `python manage"):
            call_command("bench", "--steps", "1")
    finally:
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO django_migrations (app, name, applied) VALUES (%s, %s, %s)", removed
            )


def test_bench_reports_step_and_commit_times(settings, tmp_path, monkeypatch):
    # Each of its four counts waits 1.5 s for every backend to report (the
    # writers' connections, ended, report as they exit); 0.2 s here.  The
    # bench's own connection is flushed at once (pg_stat_force_next_flush),
    # and its commits alone meet the floors asserted below.
    monkeypatch.setattr(steps, "STATS_SETTLE", 0.2)
    settings.RUNDESK_OUTBOX_DIR = operators = tmp_path / "outbox"
    whole = json.loads(run_command("bench", "--steps", "20", "--json"))
    # The bench's runs delivered their reports, to an outbox of their own.
    assert operators == settings.RUNDESK_OUTBOX_DIR and not operators.exists()
    report = whole["noop_step"]
    assert report["steps"] == 20
    assert report["step_ms_p50"] > 0 and report["commit_ms_p50"] > 0
    ratio = report["step_ms_p50"] / report["commit_ms_p50"]
    assert report["step_over_commit"] == pytest.approx(ratio, rel=0.02)
    writes = report["writes_ms_p50"] / report["commit_ms_p50"]
    assert report["writes_over_commit"] == pytest.approx(writes, rel=0.02)
    assert 0 < report["roundtrip_ms_p50"] < report["writes_ms_p50"]
    # The real agent path: 9 documents, two steps each, the composition
    # and the delivery, counted by the server (each step commits at least
    # its boundary), then timed.
    agent = whole["agent_path"]
    assert (agent["steps"], agent["documents"]) == (20, 9)
    assert agent["commits_per_step"] >= 1 and agent["wal_syncs_per_step"] > 0
    assert agent["noise_wal_syncs_per_step"] >= 0
    assert agent["step_over_commit"] == pytest.approx(
        agent["step_ms_p50"] / agent["commit_ms_p50"], rel=0.02
    )
    # A step's fenced writes are part of it.
    assert 0 < agent["writes_ms_p50"] < agent["step_ms_p50"]
    assert agent["writes_over_commit"] == pytest.approx(
        agent["writes_ms_p50"] / agent["commit_ms_p50"], rel=0.02
    )
    agent_runs = Run.objects.filter(question="bench: compare")
    assert [r.status for r in agent_runs] == [RunStatus.COMPLETED] * 2
    assert all(r.receipts.count() == 20 for r in agent_runs)
    bench_run = Run.objects.get(question__startswith="bench: 20")
    # Each round made a step and its fenced write alone: 20 receipts each.
    assert bench_run.status == RunStatus.COMPLETED
    assert bench_run.receipts.filter(step_key__startswith="noop:").count() == 20
    assert bench_run.receipts.filter(step_key__startswith="writes:").count() == 20

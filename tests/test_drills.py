"""Fault drills (runs/drills.py): `manage.py drill --json` passes every
scenario on this database; its questions fail when the data says so; the
drills page shows them and lets an operator start one, which a real
Celery worker runs."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import Client
from django.utils import timezone

from runs import tasks
from runs.drills import (
    QUESTIONS,
    SCENARIOS,
    DrillRunning,
    Finding,
    Lab,
    boundaries,
    executed_once,
    run_drill,
    start_drill,
)
from runs.leases import Lease
from runs.models import Drill, DrillResult, DrillState, DrillVerdict, Run, RunStatus
from runs.submission import submit
from tests.conftest import ROOT, database_url, python
from tests.processes import Worker, wait_until

# The filesystem broker folder a real worker reads.
from tests.processes import broker as broker

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def research_only(settings) -> None:
    """The scenarios against the research agent alone: tests/
    test_drills_agents.py drills the others."""
    settings.RUNDESK_AGENTS = {"research": settings.RUNDESK_AGENTS["research"]}


@pytest.mark.slow
def test_every_drill_scenario_passes_on_this_database(tmp_path: Path) -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "DATABASE_URL": database_url(),
        "DEBUG": "1",
        "RUNDESK_VAR_DIR": str(tmp_path / "var"),
        "RUNDESK_LEASE_SECONDS": "2",
    }
    done = subprocess.run(
        [sys.executable, "manage.py", "drill", "--agent", "research", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(done.stdout)
    failed = [s for s in report["scenarios"] if s["verdict"] == "failed"]
    assert done.returncode == 0, json.dumps(failed, indent=2) + done.stderr[-3000:]
    names = [scenario["name"] for scenario in report["scenarios"]]
    assert names == list(SCENARIOS) and len(names) >= 18
    # The database here is not the drill's to restart: said, not run.
    assert report["not_run"] == 1 and report["failed"] == 0
    assert report["passed"] == len(SCENARIOS) - 1
    restarted = next(s for s in report["scenarios"] if s["name"] == "postgres_restarted")
    assert "does not control this PostgreSQL" in restarted["detail"]
    for scenario in report["scenarios"]:
        assert set(scenario["checks"]) == set(QUESTIONS) and scenario["seconds"] >= 0
    # Every check that applied was answered from the data; those that do not
    # apply say why.
    cancel = next(s for s in report["scenarios"] if s["name"] == "cancel_mid_run")
    assert cancel["checks"]["independent_work_continued"] is None
    assert "a cancel ends the run" in cancel["detail"]
    # The drills' runs are marked, and the results kept for the drills page.
    assert Run.objects.filter(is_drill=True).count() >= len(SCENARIOS) - 1
    assert not Run.objects.filter(is_drill=False).exists()
    assert DrillResult.objects.count() == len(SCENARIOS)
    assert Drill.objects.get().state == DrillState.DONE


def test_the_questions_fail_when_the_data_says_so(tmp_path: Path, settings: object) -> None:
    lab = Lab(tmp_path)
    with lab.settings():
        run = lab.submit()
        lab.drive(run)
    assert run.status == "completed"
    clean = Finding()
    executed_once(clean, lab, [run])
    boundaries(clean, lab, [run])
    assert clean.passed and clean.answers[QUESTIONS[2]] and clean.answers[QUESTIONS[3]]

    # The delivery ran twice, and something ran that never had a boundary.
    lines = lab.journal.read_text().splitlines()
    deliver = next(line for line in lines if '"deliver_report"' in line)
    stray = json.dumps({"tool": "read_document", "identity": f"rundesk:run-{run.pk}:read:9"})
    lab.journal.write_text("\n".join([*lines, deliver, stray]) + "\n")
    dirty = Finding()
    executed_once(dirty, lab, [run])
    boundaries(dirty, lab, [run])
    assert dirty.answers[QUESTIONS[2]] is False and "deliver ran 2 times" in dirty.detail[0]
    assert dirty.answers[QUESTIONS[3]] is False and "read:9" in dirty.detail[1]
    assert not dirty.passed


def test_the_drills_page_shows_results_and_an_operator_starts_a_drill(
    operator: Client, viewer: Client
) -> None:
    drill = Drill.objects.create(scenarios=["lease_stolen"], started_by="olga", state="done")
    DrillResult.objects.create(
        drill=drill,
        scenario="lease_stolen",
        verdict=DrillVerdict.FAILED,
        seconds=1.5,
        checks=dict.fromkeys(QUESTIONS, True) | {"boundaries_kept": False},
        detail="boundaries_kept: NO: <script>x</script>",
    )
    page = viewer.get("/drills/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "capture_row_lock" in html and "never run here" in html
    assert "&lt;script&gt;x&lt;/script&gt;" in html and "<script>x</script>" not in html
    # The answers stand under their questions, whatever order jsonb keeps.
    row = html[html.index("<code>lease_stolen</code>") :]
    cells = row[row.index('class="check"') :].split("</tr>")[0]
    assert cells.count(">yes<") == 3 and cells.index("no</strong>") > cells.rindex(">yes<")
    assert "Run all" not in html  # a viewer cannot start one
    assert viewer.post("/drills/start/").status_code == 403

    assert "Run all" in operator.get("/drills/").content.decode()
    started = operator.post("/drills/start/", {"scenario": ["lease_stolen", "cancel_mid_run"]})
    assert started.status_code == 302
    newest = Drill.objects.first()
    assert newest.scenarios == ["lease_stolen", "cancel_mid_run"]
    assert newest.started_by == "operator" and newest.state == DrillState.RUNNING
    progress = operator.get(f"/drills/{newest.pk}/progress/")
    assert progress.status_code == 200 and "0 of 2" in progress.content.decode()
    # While one runs, no second drill starts.
    operator.post("/drills/start/")
    assert Drill.objects.count() == 2
    assert operator.post("/drills/start/", {"scenario": "nope"}).status_code == 302
    Drill.objects.filter(pk=newest.pk).update(state=DrillState.DONE)
    assert operator.get(f"/drills/{newest.pk}/progress/").status_code == 286


def test_one_drill_at_a_time_however_many_ask_at_once() -> None:
    barrier = threading.Barrier(6)
    outcomes: list[object] = []

    def starting(i: int) -> None:
        try:
            barrier.wait()
            outcomes.append(start_drill(["lease_stolen"], f"operator {i}"))
        except DrillRunning as running:
            outcomes.append(running)
        finally:
            connection.close()

    threads = [threading.Thread(target=starting, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    started = [o for o in outcomes if isinstance(o, Drill)]
    assert len(started) == 1 and Drill.objects.filter(state=DrillState.RUNNING).count() == 1
    refused = [o for o in outcomes if isinstance(o, DrillRunning)]
    assert len(refused) == 5 and all(r.drill.pk == started[0].pk for r in refused)
    assert f"drill {started[0].pk} is running (started by operator" in str(refused[0])


def test_a_drill_silent_for_ten_minutes_no_longer_holds_back_the_next() -> None:
    long_ago = timezone.now() - dt.timedelta(minutes=30)
    lost = start_drill(["lease_stolen"], "olga")
    Drill.objects.filter(pk=lost.pk).update(started_at=long_ago)
    fresh = start_drill(["lease_stolen"], "omar")
    lost.refresh_from_db()
    assert lost.state == DrillState.DONE and lost.error.startswith("lost: no result for 10 minutes")
    # Running for half an hour but with a result a minute ago: alive.
    Drill.objects.filter(pk=fresh.pk).update(started_at=long_ago)
    DrillResult.objects.create(
        drill=fresh, scenario="lease_stolen", verdict=DrillVerdict.PASSED, seconds=1.0
    )
    with pytest.raises(DrillRunning):
        start_drill(["lease_stolen"], "olga")
    with pytest.raises(CommandError, match=f"not started: drill {fresh.pk} is running"):
        call_command("drill", "--scenario", "lease_stolen")
    # The lost drill's task, delivered late, runs nothing beside the new one.
    assert run_drill(lost).results == [] and not DrillResult.objects.filter(drill=lost).exists()
    lost.refresh_from_db()
    assert lost.error.startswith("lost: no result")


def test_a_drill_no_worker_can_be_asked_for_ends_at_once(operator: Client, monkeypatch) -> None:
    def refused(*args: object) -> None:
        raise OSError("[Errno 111] Connection refused")

    monkeypatch.setattr(tasks.drill, "delay", refused)
    page = operator.post("/drills/start/", {"scenario": ["lease_stolen"]}, follow=True)
    drill = Drill.objects.get()
    assert drill.state == DrillState.DONE and "could not be handed to a worker" in drill.error
    assert f"Drill {drill.pk} not started: no worker could be asked" in page.content.decode()
    # It holds back no other.
    monkeypatch.setattr(tasks.drill, "delay", lambda *args: None)
    operator.post("/drills/start/", {"scenario": ["lease_stolen"]})
    assert Drill.objects.filter(state=DrillState.RUNNING).count() == 1


@pytest.mark.slow
def test_a_drill_started_on_the_page_is_run_by_a_real_worker(
    operator: Client, process_env: dict[str, str], tmp_path: Path, broker: Path, monkeypatch
) -> None:
    sent: list[tuple] = []
    monkeypatch.setattr(tasks.drill, "delay", lambda *args: sent.append(args))
    chosen = ["cancel_mid_run", "invented_receipt"]
    assert operator.post("/drills/start/", {"scenario": chosen}).status_code == 302
    drill = Drill.objects.get()
    assert sent == [(drill.pk,)]  # after commit, as the view sends it
    with tasks.drill.app.connection_for_write() as conn:
        tasks.drill.apply_async((drill.pk,), connection=conn)
    worker = Worker(process_env, tmp_path / "worker.log", beat=False)
    try:
        done = Drill.objects.filter(pk=drill.pk, state=DrillState.DONE)
        wait_until(done.exists, 120, "the drill never ended", worker)
    finally:
        worker.stop()
    results = {r.scenario: r for r in DrillResult.objects.filter(drill=drill)}
    assert sorted(results) == sorted(chosen)
    assert all(r.verdict == DrillVerdict.PASSED for r in results.values()), results
    assert all(isinstance(r.checks["boundaries_kept"], bool) for r in results.values())
    progress = operator.get(f"/drills/{drill.pk}/progress/")
    assert progress.status_code == 286 and "2 of 2" in progress.content.decode()
    assert re.search(r"runs\.tasks\.drill\[[^\]]+\] succeeded", worker.output())


def test_drills_runs_are_hidden_from_the_runs_list_unless_asked_for(viewer: Client) -> None:
    mine = submit(question="a real question", documents=["a.md"])
    drilled = submit(question="a drill question", documents=["a.md"], drill=True)
    listed = viewer.get("/").content.decode()
    assert f"/runs/{mine.pk}/" in listed and f"/runs/{drilled.pk}/" not in listed
    drills = viewer.get("/?drills=1").content.decode()
    assert f"/runs/{drilled.pk}/" in drills and f"/runs/{mine.pk}/" not in drills


def test_a_drills_run_is_driven_by_its_lab_only_and_the_lab_by_nothing_else(settings) -> None:
    """A worker of the installation that took a drill's run delivered the
    drill's report to the installation's receiver; its lab's processes
    claim its runs, and only those, and take their tasks from a queue of
    their own."""
    drilled = submit(question="a drill", documents=["a.md"], drill=True)
    mine = submit(question="a real question", documents=["a.md"])
    assert Lease.claim(drilled.pk, "installation") is None
    claimed = Lease.claim_next("installation")
    assert claimed is not None and claimed.run_id == mine.pk
    assert claimed.finish(RunStatus.CANCELLED, "test") == RunStatus.CANCELLED

    settings.RUNDESK_DRILL_LAB = True
    other = submit(question="another real one", documents=["a.md"])
    assert Lease.claim(other.pk, "lab") is None and Lease.claim_next("lab").run_id == drilled.pk

    queue = "from django.conf import settings; print(settings.CELERY_TASK_DEFAULT_QUEUE)"
    for lab, expected in (("1", "rundesk-drills"), ("", "celery")):
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": "dashboard.settings"}
        env["RUNDESK_DRILL_LAB"] = lab
        printed = python(f"import django; django.setup(); {queue}", env)
        assert printed.returncode == 0, printed.stderr
        assert printed.stdout.strip() == expected

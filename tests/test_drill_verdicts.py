"""`drill --json` says each scenario's verdict: passed, failed or not_run,
and why one was not run (a scenario that could not be staged is no
failure)."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import call_command

from runs import tasks
from runs.drills import QUESTIONS, Drilled, report
from runs.models import Drill, DrillResult, DrillVerdict
from tests.conftest import database_url

pytestmark = pytest.mark.django_db(transaction=True)


def test_drill_json_gives_each_scenario_its_verdict_and_why_it_was_not_run(monkeypatch):
    # A PostgreSQL named by DATABASE_URL is not the drill's to restart.
    monkeypatch.setenv("DATABASE_URL", database_url())
    out = StringIO()
    call_command(
        "drill",
        "--agent",
        "research",
        "--scenario",
        "cancel_of_dead_owner",
        "--scenario",
        "postgres_restarted",
        "--json",
        stdout=out,
    )
    ran, not_run = json.loads(out.getvalue())["scenarios"]

    assert ran["name"] == "cancel_of_dead_owner" and ran["verdict"] == "passed"
    assert "why" not in ran
    assert not_run["name"] == "postgres_restarted" and not_run["verdict"] == "not_run"
    assert "does not control this PostgreSQL" in not_run["why"]
    # No yes-or-no that reads the same for "failed" and "could not be staged".
    assert "passed" not in ran and "passed" not in not_run


def test_a_failed_scenario_reads_failed_and_the_totals_agree():
    drill = Drill.objects.create(scenarios=["lease_stolen"], started_by="test", state="done")
    results = [
        DrillResult.objects.create(
            drill=drill,
            scenario=name,
            verdict=verdict,
            seconds=1.0,
            checks=dict.fromkeys(QUESTIONS),
            detail=detail,
        )
        for name, verdict, detail in [
            ("lease_stolen", DrillVerdict.FAILED, "boundaries_kept: NO: ran twice"),
            ("postgres_restarted", DrillVerdict.NOT_RUN, "no embedded PostgreSQL"),
            ("cancel_mid_run", DrillVerdict.PASSED, "fine"),
        ]
    ]

    said = report(Drilled(results, leftovers=[]))

    assert [(s["name"], s["verdict"], s.get("why")) for s in said["scenarios"]] == [
        ("lease_stolen", "failed", None),
        ("postgres_restarted", "not_run", "no embedded PostgreSQL"),
        ("cancel_mid_run", "passed", None),
    ]
    assert (said["passed"], said["failed"], said["not_run"]) == (1, 1, 1)


def test_a_drill_task_for_a_drill_this_database_does_not_hold_is_said_and_left():
    assert tasks.drill(987654321) == "no drill 987654321 here"

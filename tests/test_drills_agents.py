"""Drills for every agent (runs/drills.py): `drill --agent NAME` runs each
scenario that applies against each chosen agent, placing each fault by its
role in the sequence a clean run of that agent shows; a scenario that does
not apply to an agent is not run, and says why.  The second agent here is
tests/drill_agents.py: reads side by side and one effect, no checkpoints,
nothing captured."""

from __future__ import annotations

import json
import subprocess
import sys
from io import StringIO
from pathlib import Path
from unittest.mock import patch

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from runs import tasks
from runs.drills import QUESTIONS, SCENARIOS, chosen_agents, undrilled
from runs.models import Drill, DrillResult, DrillVerdict, Receipt
from tests.conftest import ROOT, database_url

pytestmark = pytest.mark.django_db(transaction=True)

FILING = "tests.drill_agents:FilingAgent"


@pytest.fixture
def installed(settings, tmp_path: Path, monkeypatch) -> Path:
    """The filing agent and the pages agent (no drill input) installed
    beside research, and nothing else; the folder the filing agent files its
    replies in."""
    settings.RUNDESK_AGENTS = {
        "research": settings.RUNDESK_AGENTS["research"],
        "filing": FILING,
        "pages": "tests.sample_agents:PagesAgent",
    }
    folder = tmp_path / "filed"
    monkeypatch.setenv("DRILL_FOLDER", str(folder))
    return folder


def drill(*args: str) -> dict:
    out = StringIO()
    call_command("drill", *args, "--json", stdout=out)
    return json.loads(out.getvalue())


def test_a_drill_runs_against_every_agent_with_a_drill_input_unless_told(installed) -> None:
    assert chosen_agents(None) == ["filing", "research"]  # not pages: no drill input
    assert undrilled() == ["pages"]
    assert chosen_agents(["research", "filing", "research"]) == ["research", "filing"]
    with pytest.raises(CommandError, match=r"not started: no agent 'nope' is installed here "
                       r"\(installed: filing, pages, research\)"):  # fmt: skip
        call_command("drill", "--agent", "research,nope")
    with pytest.raises(CommandError, match="agent 'pages' declares no drill input"):
        call_command("drill", "--agent", "pages")
    assert not Drill.objects.exists()


def test_the_report_names_the_agent_of_each_result(installed) -> None:
    said = drill(
        "--agent", "research,filing",
        "--scenario", "cancel_mid_run", "--scenario", "capture_table_lock",
    )  # fmt: skip

    assert said["agents"] == ["research", "filing"]
    verdicts = [(s["agent"], s["name"], s["verdict"]) for s in said["scenarios"]]
    assert verdicts == [
        ("research", "cancel_mid_run", "passed"),
        ("research", "capture_table_lock", "passed"),
        ("filing", "cancel_mid_run", "passed"),
        ("filing", "capture_table_lock", "not_run"),
    ]
    # Placed by role: research is stopped after its first publication, the
    # filing agent before its effect (it publishes last).
    research_cancel, _, filing_cancel, filing_capture = said["scenarios"]
    assert "before action 3 (read:1, mid-run)" in research_cancel["detail"]
    assert "before action 3 (file, mid-run)" in filing_cancel["detail"]
    assert "capture keeps no model record of filing's runs" in filing_capture["why"]
    results = DrillResult.objects.order_by("pk")
    assert [(r.agent, r.scenario) for r in results] == [(a, n) for a, n, _ in verdicts]
    assert Drill.objects.get().agents == ["research", "filing"]
    # The filing agent's clean run filed its reply; the cancelled run none.
    assert len(list(installed.iterdir())) == 1


# Scenarios that cannot apply to the filing agent, and what they say.
NOT_FOR_FILING = {
    "capture_row_lock": "capture keeps no copy of a model call of filing's runs",
    "capture_table_lock": "capture keeps no model record of filing's runs",
    "evidence_tables_locked": "capture keeps no record of filing's runs",
    "capture_queue_full": "capture keeps no record of filing's runs",
    "database_stalled_for_capture": "capture keeps no document read of filing's runs",
    "checkpoint_fails_before_write": "filing saves no checkpoints",
    "checkpoint_commit_lost": "filing saves no checkpoints",
    "invented_receipt": "filing saves no checkpoints",
    "postgres_restarted": "does not control this PostgreSQL",
}


@pytest.mark.slow
def test_every_scenario_for_a_second_agent_passes_or_says_why_not(tmp_path: Path) -> None:
    filed = tmp_path / "filed"
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "DATABASE_URL": database_url(),
        "DEBUG": "1",
        "RUNDESK_VAR_DIR": str(tmp_path / "var"),
        "RUNDESK_LEASE_SECONDS": "2",
        # Installed through the environment, as a user's own agent is.
        "RUNDESK_AGENTS": f"filing={FILING}",
        "DRILL_FOLDER": str(filed),
    }
    done = subprocess.run(
        [sys.executable, "manage.py", "drill", "--agent", "filing", "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    report = json.loads(done.stdout)
    failed = [s for s in report["scenarios"] if s["verdict"] == "failed"]
    assert done.returncode == 0 and not failed, json.dumps(failed, indent=2) + done.stderr[-3000:]

    assert report["agents"] == ["filing"]
    assert [s["name"] for s in report["scenarios"]] == list(SCENARIOS)
    assert {s["agent"] for s in report["scenarios"]} == {"filing"}
    not_run = {s["name"]: s["why"] for s in report["scenarios"] if s["verdict"] == "not_run"}
    assert sorted(not_run) == sorted(NOT_FOR_FILING)
    for name, why in NOT_FOR_FILING.items():
        assert why in not_run[name]
    assert report["passed"] == len(SCENARIOS) - len(NOT_FOR_FILING)
    # Every effect happened once, whatever the scenario did to its run: one
    # reply filed per run whose effect has its receipt (the tool's, naming
    # the file, or an operator's decision's, for the answer the drill lost).
    receipts = Receipt.objects.filter(step_key="file", run__agent="filing")
    # The clean run and the seven scenarios whose run goes on to the end.
    assert len(list(filed.iterdir())) == receipts.count() == 8
    named = [r.result["filed"] for r in receipts if "filed" in r.result]
    assert len(named) == receipts.count() - 1 and all((filed / n).exists() for n in named)
    assert all(r.action.attempts == 1 for r in receipts)
    results = DrillResult.objects.filter(agent="filing")
    assert results.count() == len(SCENARIOS)
    assert all(r.verdict != DrillVerdict.FAILED for r in results)


def test_the_drills_page_shows_each_agents_results_and_starts_a_drill_for_agents(
    installed, operator: Client, viewer: Client
) -> None:
    drill = Drill.objects.create(
        scenarios=["delivery_answer_lost"],
        agents=["research", "filing"],
        started_by="olga",
        state="done",
    )
    for agent, verdict, detail in [
        ("research", DrillVerdict.PASSED, "the answer of action 6 (deliver) lost"),
        ("filing", DrillVerdict.NOT_RUN, "a clean run of filing has no <effect>"),
    ]:
        DrillResult.objects.create(
            drill=drill,
            scenario="delivery_answer_lost",
            agent=agent,
            verdict=verdict,
            seconds=1.0,
            checks=dict.fromkeys(QUESTIONS, True if verdict == DrillVerdict.PASSED else None),
            detail=detail,
        )
    html = viewer.get("/drills/").content.decode()
    row = html[html.index("<code>delivery_answer_lost</code>") :]
    filing, research = row.split("</tr>")[:2]  # the agents by name
    assert "<td>research</td>" in research and "Passed" in research
    assert "<td>filing</td>" in filing and "Not Run" in filing
    assert "has no &lt;effect&gt;" in filing and filing.count(">n/a<") == 4
    # Each agent has a row for each scenario; pages declares no drill input.
    lease = html[html.index("<code>lease_stolen</code>") :].split("</tbody>")[0]
    assert lease.split("</tr>")[1].count("never run here") == 1
    assert "<td>pages</td>" not in html
    assert "Not drilled: pages (they declare no drill input" in html
    assert "Done: 2 of 2 scenarios (1 against each of research, filing)" in html
    assert (
        "Run all 19 scenarios against filing, research" in operator.get("/drills/").content.decode()
    )

    Drill.objects.all().delete()
    refused = operator.post("/drills/start/", {"agent": ["pages"]}, follow=True)
    assert (
        "Not started: agent &#x27;pages&#x27; declares no drill input" in refused.content.decode()
    )
    assert not Drill.objects.exists()
    with patch.object(tasks.drill, "delay", lambda *args: None):
        operator.post("/drills/start/", {"scenario": ["lease_stolen"], "agent": ["filing"]})
    assert Drill.objects.get().agents == ["filing"]

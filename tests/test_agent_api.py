"""The agent API as a user's agent meets it: registration, the shape of a
run's input and of a tool's, reads side by side (one boundary write and one
receipt write for all, dispatched at once, each read recorded once, after a
SIGKILL mid-batch too), and an executor's loop taking only the runs of the
agents its process has."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import jsonschema
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError, SystemCheckError
from django.db import connection
from django.utils import timezone

from evidence.capture import capture
from evidence.models import Source
from runs import registry
from runs.agent import READ, ActionFailed, Step, Tool, compiled_check
from runs.agents.research import ResearchAgent
from runs.dispatch import Dispatcher
from runs.executor import claim_and_drive
from runs.leases import Lease
from runs.models import (
    Action,
    ActionState,
    AnswerRevision,
    OutcomeItem,
    OutcomeKind,
    OutcomeState,
    Receipt,
    Run,
    RunStatus,
)
from runs.submission import submit
from runs.timeline import EventKind, timeline
from tests.conftest import ROOT, manage
from tests.faultruns import wait_for
from tests.sample_agents import DELAY

pytestmark = pytest.mark.django_db(transaction=True)

PAGES = "pages=tests.sample_agents:PagesAgent"


@pytest.fixture
def pages(settings):
    """The test's own agent installed beside the shipped ones."""
    settings.RUNDESK_AGENTS = {**settings.RUNDESK_AGENTS, "pages": "tests.sample_agents:PagesAgent"}


def test_a_second_final_revision_fails_the_run_saying_why(settings):
    # Every owner would make the same mistake again: no lease after lease of it.
    settings.RUNDESK_AGENTS = {
        **settings.RUNDESK_AGENTS,
        "two-finals": "tests.sample_agents:TwoFinalsAgent",
    }
    run = submit(agent="two-finals", input={})
    assert claim_and_drive(run.pk) == RunStatus.FAILED
    run.refresh_from_db()
    assert "a final revision of this run is published already" in run.status_reason
    assert list(run.revisions.values_list("number", "is_final")) == [(1, True)]


def test_a_run_that_fails_with_an_earlier_owners_effect_unanswered_leaves_it_unknown(
    settings, journal
):
    # The owner that sent the post died before its answer; the next one
    # fails before it steps it: the run ends, and an item says the post may
    # have happened.
    settings.RUNDESK_AGENTS = {
        **settings.RUNDESK_AGENTS,
        "broken-after-crash": "tests.sample_agents:BrokenAfterCrashAgent",
    }
    run = submit(agent="broken-after-crash", input={})
    first = Lease.claim(run.pk, "died")
    assert first is not None
    post = first.record_boundary(step_key="post", kind="post", effect_class="effect", input={})
    Run.objects.filter(pk=run.pk).update(lease_expires_at="2000-01-01T00:00:00Z")

    assert claim_and_drive(run.pk) == RunStatus.FAILED
    run.refresh_from_db()
    assert "a bug met before the post" in run.status_reason
    assert Action.objects.get(pk=post).state == ActionState.UNKNOWN
    item = OutcomeItem.objects.get(run=run, action_id=post)
    assert (item.kind, item.state) == (OutcomeKind.EFFECT, OutcomeState.OPEN)
    assert "only its receiver knows whether it happened" in item.summary
    assert journal.counts("post") == {}


def writers(table: str, ids: list[int], column: str = "id") -> set[str]:
    """The transactions that wrote these rows."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT DISTINCT xmin::text FROM {table} WHERE {column} = ANY(%s)", [ids])
        return {row[0] for row in cursor.fetchall()}


def test_reads_side_by_side_share_one_boundary_write_one_receipt_write_and_run_at_once(
    pages, journal, monkeypatch
):
    monkeypatch.setenv(DELAY, "0.5")
    run = submit("pages", {"pages": ["a", "b", "c", "d"]})
    started = time.monotonic()
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    elapsed = time.monotonic() - started
    # One after another, four reads of 0.5 s take 2 s.
    assert elapsed < 1.5, elapsed
    reads = list(Action.objects.filter(run=run).order_by("id").values_list("id", flat=True))
    assert len(reads) == 4
    assert len(writers("runs_action", reads)) == 1
    assert Receipt.objects.filter(action_id__in=reads).count() == 4
    assert len(writers("runs_receipt", reads, "action_id")) == 1
    assert sorted(journal.counts().values()) == [1, 1, 1, 1]
    final = AnswerRevision.objects.get(run=run).content
    assert final.splitlines() == ["a: page a", "b: page b", "c: page c", "d: page d"]


def test_side_by_side_a_refused_read_is_a_result_and_a_silent_one_fails_alone(pages, journal):
    run = submit("pages", {"pages": ["a", "missing"]})
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    assert AnswerRevision.objects.get(run=run).content.splitlines() == [
        "a: page a",
        "missing: no such page",
    ]
    # A read that outlives its tool's timeout (1 s) is left behind and fails.
    slow = submit("pages", {"pages": ["b"]})
    lease = Lease.claim(slow.pk, "owner")
    dispatcher = Dispatcher(lease, stop=threading.Event(), lease_lost=threading.Event())
    started = time.monotonic()
    (result,) = dispatcher.side_by_side([Step("read:b", "slow_read", {"name": "b", "seconds": 3})])
    assert time.monotonic() - started < 2.5
    assert isinstance(result, ActionFailed)
    assert "no answer within its timeout of 1 s" in result.error
    assert Action.objects.get(run=slow, step_key="read:b").state == ActionState.FAILED
    # It was left running, not stopped: it ends on its own, its answer dropped.
    wait_for(lambda: journal.counts()[f"rundesk:run-{slow.pk}:read:b"] == 1, "the read left behind")
    assert not Receipt.objects.filter(run=slow).exists()


def test_a_tool_input_its_schema_refuses_is_refused_before_any_boundary(journal):
    run = submit(question="q", documents=["northwind-clean-energy.md"])
    lease = Lease.claim(run.pk, "owner")
    dispatcher = Dispatcher(lease, stop=threading.Event(), lease_lost=threading.Event())
    result = dispatcher.step("read:0", "read_document", {"file": "northwind-clean-energy.md"})
    assert result == {"refused": "read_document refused input: 'path' is a required property"}
    assert not Action.objects.filter(run=run).exists()
    timeline.flush()
    assert run.events.filter(kind=EventKind.ACTION_REFUSED).count() == 1
    with pytest.raises(ValueError, match="declares no tool 'send_fax'"):
        dispatcher.step("fax", "send_fax", {})


def test_a_receipt_and_its_copy_keep_what_the_tool_answered_whatever_the_agent_does(journal):
    # A read's receipt goes with the run's next write: an agent that
    # changes the result it was given meanwhile changes nothing of it.
    run = submit(question="q", documents=["northwind-clean-energy.md"])
    lease = Lease.claim(run.pk, "owner")
    dispatcher = Dispatcher(lease, stop=threading.Event(), lease_lost=threading.Event())
    result = dispatcher.step("read:0", "read_document", {"path": "northwind-clean-energy.md"})
    answered = json.loads(json.dumps(result))
    result["text"] = "changed by the agent"
    result["sha256"] = "0" * 64
    dispatcher.write_receipt()
    assert Receipt.objects.get(action__run=run).result == answered
    # Nor what capture keeps of it.
    capture.flush()
    assert Source.objects.get(run=run).digest == answered["sha256"]


SCHEMAS_AND_VALUES = [
    (
        {
            "type": "object",
            "required": ["n", "tags"],
            "additionalProperties": False,
            "properties": {
                "n": {"type": "integer", "minimum": 1, "exclusiveMaximum": 10},
                "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True},
                "to": {"type": "string", "format": "email", "pattern": "^[a-z]+@", "default": "x"},
            },
        },
        [
            {"n": 1, "tags": []},
            {"n": True, "tags": []},  # a bool is no integer
            {"n": 1.0, "tags": ["a"]},
            {"n": 10, "tags": []},
            {"n": 2, "tags": ["a", "a"]},
            {"n": 2, "tags": ["c"]},
            {"n": 2, "tags": [], "to": "not an address"},  # formats are not checked
            {"n": 2, "tags": [], "to": "Bob@x"},
            {"n": 2, "tags": [], "extra": 1},
            {"tags": []},
            [],
            None,
        ],
    ),
    # 2020-12's own keywords: jsonschema alone (a compiled draft-7 check
    # would let these through).
    (
        {
            "type": "array",
            "prefixItems": [{"type": "string"}],
            "minContains": 2,
            "contains": {"const": 1},
        },
        [["a", 1, 1], [1, 1, 1], ["a", 1]],
    ),
    (
        {"$defs": {"n": {"type": "integer"}}, "properties": {"n": {"$ref": "#/$defs/n"}}},
        [{"n": 1}, {"n": "1"}],
    ),
]


@pytest.mark.parametrize(("schema", "values"), SCHEMAS_AND_VALUES)
def test_a_tools_compiled_check_refuses_what_jsonschema_refuses(schema, values):
    """A tool checks each input with code compiled from its schema, and
    asks jsonschema only of an input that check refuses (to say why): the
    two must never disagree on an input jsonschema refuses."""
    tool = Tool("t", READ, lambda input, call: {}, input_schema=schema)
    validator = jsonschema.Draft202012Validator(schema)
    for value in values:
        assert (tool.refusal(value) == "") == validator.is_valid(value), value
    check = compiled_check(schema)
    assert (check is None) == (schema is not SCHEMAS_AND_VALUES[0][0])
    original = {"n": 2, "tags": []}
    assert tool.refusal(original) == "" or check is None
    assert original == {"n": 2, "tags": []}  # no default filled in


def test_a_sigkill_mid_batch_sends_each_read_again_under_its_identity_once(
    pages, journal, process_env
):
    run = submit("pages", {"pages": ["a", "b", "c"]})
    env = {**process_env, "RUNDESK_AGENTS": PAGES, DELAY: "30"}
    executor = manage("executor", "--run", str(run.pk), env=env)
    try:
        wait_for(lambda: Action.objects.filter(run=run).count() == 3, "the batch's boundaries")
    finally:
        executor.send_signal(signal.SIGKILL)
        executor.communicate(timeout=30)
    assert not Receipt.objects.filter(run=run).exists()
    wait_for(
        lambda: (
            Run.objects.filter(pk=run.pk, status=RunStatus.RUNNING)
            .filter(lease_expires_at__lt=timezone.now())
            .exists()
        ),
        "the killed owner's lease to expire",
    )
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    actions = Action.objects.filter(run=run)
    assert sorted(actions.values_list("attempts", flat=True)) == [2, 2, 2]
    assert Receipt.objects.filter(run=run).count() == 3
    # The killed owner's reads never answered: each ran to its end once.
    assert sorted(journal.counts().values()) == [1, 1, 1]


def test_bad_registrations_are_named_at_start_up(settings):
    settings.RUNDESK_AGENTS = {
        "research": "runs.agents.research:ResearchAgent",
        "gone": "tests.nowhere:GoneAgent",
        "plain": "tests.sample_agents:slow_read",
        "renamed": "tests.sample_agents:PagesAgent",
        "pathless": "tests.sample_agents",
    }
    problems = registry.problems()
    assert any(
        "agent 'gone': importing tests.nowhere failed: ModuleNotFoundError" in p for p in problems
    )
    assert any("agent 'plain'" in p and "not a subclass of runs.agent.Agent" in p for p in problems)
    assert any("agent 'renamed'" in p and "declares name = 'pages'" in p for p in problems)
    assert any("agent 'pathless'" in p and "package.module:Class" in p for p in problems)
    with pytest.raises(SystemCheckError, match=r"rundesk\.E002"):
        call_command("check")


def test_an_agent_of_another_package_is_installed_through_the_environment(tmp_path):
    package = tmp_path / "elsewhere"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "echo.py").write_text(
        "from runs.agent import Agent\n\n"
        "class EchoAgent(Agent):\n"
        "    name = 'echo'\n"
        "    def run(self):\n"
        "        self.ctx.publish('echo', revision=1, final=True)\n"
    )
    env = {**os.environ, "DEBUG": "1", "PYTHONPATH": str(tmp_path)}

    def check(agents: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(ROOT / "manage.py"), "check"],
            env={**env, "RUNDESK_AGENTS": agents},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    assert check("echo=elsewhere.echo:EchoAgent").returncode == 0
    broken = check("echo=elsewhere.echo:EchoAgent,typo=elsewhere.ecoh:EchoAgent")
    assert broken.returncode != 0
    assert "agent 'typo': importing elsewhere.ecoh failed" in broken.stderr
    assert check("research=").returncode == 0  # uninstalls it


def test_a_runs_input_is_checked_at_submission_with_the_field_named(pages):
    with pytest.raises(ValueError, match=r"pages: input\.pages: \[\] should be non-empty"):
        submit("pages", {"pages": []})
    with pytest.raises(ValueError, match=r"input\.pages\[1\]: 7 is not of type 'string'"):
        submit("pages", {"pages": ["a", 7]})
    with pytest.raises(ValueError, match="no agent 'nope' is installed here"):
        submit("nope", {})
    assert not Run.objects.exists()
    run = submit("pages", {"pages": ["a"]})
    assert (run.agent, run.agent_version, run.input) == ("pages", "1", {"pages": ["a"]})


def test_submit_run_takes_an_agent_and_its_input(pages, tmp_path, capsys):
    call_command("submit_run", "--agent", "pages", "--input", '{"pages": ["a"]}', "--json")
    first = json.loads(capsys.readouterr().out)["run_id"]
    given = tmp_path / "input.json"
    given.write_text('{"pages": ["b", "c"]}')
    call_command("submit_run", "--agent", "pages", "--input", f"@{given}", "--json")
    second = json.loads(capsys.readouterr().out)["run_id"]
    assert Run.objects.get(pk=first).input == {"pages": ["a"]}
    assert Run.objects.get(pk=second).input == {"pages": ["b", "c"]}
    for arguments, said in [
        (["--input", "{not json"], "--input is not valid JSON"),
        (["--input", "[1]"], "must be a JSON object"),
        (["--input", "{}"], "'pages' is a required property"),
        (["--input", f"@{tmp_path / 'none.json'}"], "cannot read it"),
        (["--question", "q", "--doc", "a.md"], "research agent's: use --input"),
        ([], "give --input"),
    ]:
        with pytest.raises(CommandError, match=said):
            call_command("submit_run", "--agent", "pages", *arguments)
    assert Run.objects.count() == 2


def test_an_executors_loop_takes_only_runs_of_the_agents_its_process_has(pages, settings):
    other = submit("pages", {"pages": ["a"]})
    settings.RUNDESK_AGENTS = {"research": "runs.agents.research:ResearchAgent"}
    assert Lease.claim_next("owner") is None
    research = submit(question="q", documents=["northwind-clean-energy.md"])
    lease = Lease.claim_next("owner")
    assert lease is not None and lease.run_id == research.pk
    assert Run.objects.get(pk=other.pk).status == RunStatus.QUEUED
    assert ResearchAgent.tool("read_document") is not None

"""docs/AGENTS.md followed as a new user would: its agent, copied from the
page into a package outside this repository, installed through the
environment, run by real processes, killed mid-run (no completed read runs
again; the effect whose answer never came waits for an operator), and its
lost effect resolved with the `outcomes` CLI."""

from __future__ import annotations

import json
import re
import signal
import subprocess

import pytest
from django.utils import timezone

from runs.models import Action, ActionState, OutcomeItem, Run, RunStatus
from runs.timeline import EventKind
from tests.conftest import ROOT, manage
from tests.faultruns import events, wait_for
from tests.receivers import LocalServer, status

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

GUIDE = ROOT / "docs" / "AGENTS.md"


def files_of_the_guide() -> dict[str, str]:
    """The guide's code blocks that name their file (`# file: PATH`)."""
    blocks = re.findall(r"```python\n# file: (\S+)\n(.*?)```", GUIDE.read_text(), re.S)
    return {path: code for path, code in blocks}


def run_command(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "manage.py"), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_guides_agent_runs_survives_a_sigkill_and_its_lost_effect_is_resolved(
    tmp_path, process_env, operator_user
):
    files = files_of_the_guide()
    assert list(files) == ["myagents/digest.py"]
    home = tmp_path / "myagents"
    (home / "myagents").mkdir(parents=True)
    (home / "myagents" / "__init__.py").write_text("")
    (home / "myagents" / "digest.py").write_text(files["myagents/digest.py"])
    notes = home / "notes"
    notes.mkdir()
    (notes / "monday.txt").write_text("Ship the API on Monday.\nDetails follow.\n")
    (notes / "bugs.txt").write_text("Fix the login bug first.\n")

    with LocalServer(status(200)) as webhook:
        env = {
            **process_env,
            "PYTHONPATH": str(home),
            "RUNDESK_AGENTS": "digest=myagents.digest:DigestAgent",
            "DIGEST_NOTES": str(notes),
            "DIGEST_URL": webhook.url + "/digest",
        }
        checked = run_command("check", env=env)
        assert checked.returncode == 0, checked.stderr
        refused = run_command(
            "submit_run", "--agent", "digest", "--input", '{"title": "Week 49"}', env=env
        )
        assert "'notes' is a required property" in refused.stderr
        assert not Run.objects.exists()

        submitted = run_command(
            "submit_run",
            "--agent",
            "digest",
            "--input",
            '{"title": "Crash", "notes": ["monday.txt", "bugs.txt"]}',
            # The post waits 5 s between its boundary and its call: time
            # enough to SIGKILL its executor before it sends.  The delay
            # holds for the post sent again after the decision too.
            "--faults",
            '[{"point": "tool_delay", "ms": 5000, "action": 3}]',
            "--json",
            env=env,
        )
        assert submitted.returncode == 0, submitted.stderr
        run = Run.objects.get(pk=json.loads(submitted.stdout)["run_id"])

        first = manage("executor", env=env)
        try:
            wait_for(
                lambda: Action.objects.filter(run=run, step_key="post").exists(),
                "the post's boundary",
                timeout=60,
            )
        finally:
            first.send_signal(signal.SIGKILL)
            first.communicate(timeout=30)
        assert webhook.requests == []

        second = manage("executor", env=env)
        try:
            wait_for(
                lambda: Run.objects.get(pk=run.pk).status == RunStatus.NEEDS_OPERATOR,
                "the run to wait for an operator",
                timeout=60,
            )
            reads = Action.objects.filter(run=run, kind="read_note")
            assert sorted(reads.values_list("attempts", flat=True)) == [1, 1]
            # The timeline's writer saves its events after the run's own
            # writes (off the main path): they come, not necessarily first.
            wait_for(lambda: len(events(run, EventKind.ACTION_REUSED)) == 2, "the two reads reused")
            post = Action.objects.get(run=run, step_key="post")
            assert post.state == ActionState.UNKNOWN
            item = OutcomeItem.objects.get(run=run, action=post)

            def offered() -> set[str]:
                shown = run_command("outcomes", "show", str(item.pk), "--json", env=env)
                assert shown.returncode == 0, shown.stderr
                return {offer["choice"] for offer in json.loads(shown.stdout)["offers"]}

            # While the killed owner's call may still be in flight (its
            # dispatch, plus the tool's 10 s, plus the lease), only "it
            # happened"; then sending again too, as the tool accepts the key.
            assert offered() == {"confirmed_happened"}
            wait_for(lambda: "resend_same_identity" in offered(), "sending again", timeout=60)
            decided = run_command(
                "outcomes",
                "decide",
                str(item.pk),
                "--choice",
                "confirmed_not_happened",
                "--reason",
                "the webhook has no digest under this key",
                "--as",
                operator_user.username,
                env=env,
            )
            assert decided.returncode == 0, decided.stderr
            wait_for(
                lambda: Run.objects.get(pk=run.pk).status == RunStatus.COMPLETED,
                "the run to complete",
                timeout=60,
            )
        finally:
            second.send_signal(signal.SIGTERM)
            second.communicate(timeout=30)

    (request,) = webhook.requests
    headers, body = request
    assert headers["Idempotency-Key"] == post.idempotency_key
    text = json.loads(body)["text"]
    assert "- monday.txt: Ship the API on Monday." in text
    assert "- bugs.txt: Fix the login bug first." in text
    run.refresh_from_db()
    assert run.agent == "digest" and run.finished_at <= timezone.now()

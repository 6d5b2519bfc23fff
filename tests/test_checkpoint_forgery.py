"""A checkpoint is recovery, never a source of content: a resumed run uses
one only where the receipts bear out every value it holds.

Each test interrupts a run (the lease is stolen before an action), then
changes the newest saved checkpoint directly in the database, the way a
bad migration, a restore or a hand edit could, and resumes the run.  The
checkpoint must be ignored, the published answer must hold nothing that
only the checkpoint said, and no completed action may run again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection, transaction

from runs.executor import claim_and_drive
from runs.models import AnswerRevision, Checkpoint, Receipt, Run, RunStatus
from runs.submission import submit
from runs.timeline import EventKind, timeline
from tests.faultruns import DOCS, KEYS, events, executions, run_with

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("short_settle")]

FORGED = "FORGED-BY-HAND"


def interrupted(
    faults: list[dict[str, Any]], documents: list[str] = DOCS
) -> tuple[Run, Checkpoint]:
    """A run stopped by the fault plan, and its newest saved checkpoint."""
    run, outcome = run_with(faults, documents)
    assert outcome == "lease_lost"
    newest = run.checkpoints.filter(state__isnull=False).order_by("-number").first()
    assert newest is not None
    return run, newest


def canonical_digest(state: Any) -> str:
    text = json.dumps(state, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def forge(checkpoint: Checkpoint, state: Any, state_digest: str | None = None) -> None:
    """Rewrites a checkpoint row behind the runtime's back.  The trigger of
    migration 0004 refuses that, so it is disabled for this one transaction
    (DDL is transactional: nobody else ever sees it disabled).  By default
    the forger is careful and writes a digest that matches the forged state."""
    if state_digest is None:
        state_digest = canonical_digest(state)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("ALTER TABLE runs_checkpoint DISABLE TRIGGER USER")
        cursor.execute(
            "UPDATE runs_checkpoint SET state = %s::jsonb, state_digest = %s WHERE id = %s",
            [json.dumps(state), state_digest, checkpoint.pk],
        )
        cursor.execute("ALTER TABLE runs_checkpoint ENABLE TRIGGER USER")


def resume(run: Run) -> str:
    """Another executor takes the run over once the thief's lease expires."""
    Run.objects.filter(pk=run.pk).update(lease_expires_at="2000-01-01T00:00:00Z")
    outcome = claim_and_drive(run.pk)
    timeline.flush()
    run.refresh_from_db()
    return outcome


def final_answer(run: Run) -> str:
    return AnswerRevision.objects.get(run=run, is_final=True).content


def completed_before(journal: Any, run: Run) -> dict[str, int]:
    """The actions with a receipt, and how often their tools really ran (a
    refused read ran none: the tool said no before doing anything)."""
    keys = Receipt.objects.filter(run=run).values_list("step_key", flat=True)
    return {step_key: executions(journal, run, step_key) for step_key in keys}


def assert_nothing_completed_ran_again(journal: Any, run: Run, before: dict[str, int]) -> None:
    assert before == {step_key: executions(journal, run, step_key) for step_key in before}
    assert events(run, EventKind.ACTION_REDISPATCHED) == []


def forged_summary(state: dict[str, Any]) -> dict[str, Any]:
    # The fact sheet's ticker names the fund in the comparison: the forged
    # one would reach the report.  The receipt digests stay as they were.
    path, text = state["summaries"][1]
    state["summaries"][1] = [path, text.replace("- Ticker: ", f"- Ticker: {FORGED} ", 1)]
    return state


def forged_note(state: dict[str, Any]) -> dict[str, Any]:
    state["notes"].append(f"{DOCS[2]}: {FORGED}, buy before Friday")
    return state


def forged_position(state: dict[str, Any]) -> dict[str, Any]:
    # Past the third document: it would be neither summarised nor noted.
    state["position"] = 3
    return state


def forged_path(state: dict[str, Any]) -> dict[str, Any]:
    # The right text, said to be another document's.
    state["summaries"][1][0] = f"{FORGED}.md"
    return state


def forged_steps(state: dict[str, Any]) -> dict[str, Any]:
    # Fewer steps counted: more budget than the run has.
    state["steps"] = 0
    return state


def forged_taken(state: dict[str, Any]) -> dict[str, Any]:
    # read:2 never completed before the interruption.
    state["taken"].append("read:2")
    return state


@pytest.mark.parametrize(
    ("forgery", "reason"),
    [
        (forged_summary, "disagrees with the receipts on its summaries"),
        (forged_note, "disagrees with the receipts on its notes"),
        (forged_position, "disagrees with the receipts on its position"),
        (forged_path, "disagrees with the receipts on its summaries"),
        (forged_steps, "counts 0 steps but was saved as step 4"),
        (forged_taken, "disagrees with the receipts on its taken"),
    ],
)
def test_a_forged_checkpoint_with_a_matching_digest_is_ignored_and_rebuilt_from_receipts(
    journal: Any, forgery: Callable[[dict[str, Any]], dict[str, Any]], reason: str
) -> None:
    run, newest = interrupted([{"point": "lease_stolen", "action": 5}])
    assert newest.number == 4 and newest.after_action.step_key == "summarize:1"
    before = completed_before(journal, run)
    assert before == dict.fromkeys(KEYS[:4], 1)
    forge(newest, forgery(newest.state))

    assert resume(run) == RunStatus.COMPLETED
    ignored = events(run, EventKind.CHECKPOINT_IGNORED)
    assert ignored == [f"checkpoint 4 {reason}: rebuilt from the receipts instead"]
    assert events(run, EventKind.CHECKPOINT_USED) == []
    final = final_answer(run)
    assert FORGED not in final
    assert "Not included" not in final
    # Every fund is compared, under its own ticker.
    assert "Funds compared: NWCE, CSTB, MWEI." in final
    # Rebuilt from the receipts: each completed action was reused, none ran again.
    assert len(events(run, EventKind.ACTION_REUSED)) == 4
    assert_nothing_completed_ran_again(journal, run, before)
    for step_key in KEYS:
        assert executions(journal, run, step_key) == 1, step_key


def test_a_checkpoint_whose_digest_does_not_match_its_state_is_ignored(journal: Any) -> None:
    run, newest = interrupted([{"point": "lease_stolen", "action": 5}])
    before = completed_before(journal, run)
    forge(newest, newest.state, state_digest="0" * 64)

    assert resume(run) == RunStatus.COMPLETED
    ignored = events(run, EventKind.CHECKPOINT_IGNORED)
    assert ignored == [
        "checkpoint 4 has a state that does not match its digest: rebuilt from the receipts instead"
    ]
    assert events(run, EventKind.CHECKPOINT_USED) == []
    assert "Funds compared: NWCE, CSTB, MWEI." in final_answer(run)
    assert_nothing_completed_ran_again(journal, run, before)


def test_a_forged_summary_with_a_stale_digest_is_ignored(journal: Any) -> None:
    # The careless forger: the text changed, the row's digest did not.
    run, newest = interrupted([{"point": "lease_stolen", "action": 5}])
    before = completed_before(journal, run)
    forge(newest, forged_summary(dict(newest.state)), state_digest=newest.state_digest)

    assert resume(run) == RunStatus.COMPLETED
    assert events(run, EventKind.CHECKPOINT_IGNORED) == [
        "checkpoint 4 disagrees with the receipts on its summaries: rebuilt from the receipts "
        "instead"
    ]
    assert FORGED not in final_answer(run)
    assert_nothing_completed_ran_again(journal, run, before)


def test_a_forged_checkpoint_row_with_a_higher_number_is_ignored(journal: Any) -> None:
    # No trigger to get past: a new row, after the newest, with a forged summary.
    run, newest = interrupted([{"point": "lease_stolen", "action": 5}])
    before = completed_before(journal, run)
    state = forged_summary(dict(newest.state))
    Checkpoint.objects.create(
        run=run,
        after_action=newest.after_action,
        number=newest.number + 1,
        epoch=newest.epoch,
        outcome=newest.outcome,
        state=state,
        state_digest=canonical_digest(state),
    )

    assert resume(run) == RunStatus.COMPLETED
    assert events(run, EventKind.CHECKPOINT_IGNORED) == [
        "checkpoint 5 disagrees with the receipts on its summaries: rebuilt from the receipts "
        "instead"
    ]
    assert FORGED not in final_answer(run)
    assert_nothing_completed_ran_again(journal, run, before)


# -- an untouched checkpoint is still used -------------------------------------------


def test_an_untouched_checkpoint_is_used(journal: Any) -> None:
    run, newest = interrupted([{"point": "lease_stolen", "action": 5}])
    assert newest.state_digest == canonical_digest(newest.state)
    before = completed_before(journal, run)

    assert resume(run) == RunStatus.COMPLETED
    assert events(run, EventKind.CHECKPOINT_IGNORED) == []
    assert "continuing from checkpoint 4" in events(run, EventKind.CHECKPOINT_USED)[0]
    # Nothing before the checkpoint was stepped again, not even to reuse it.
    assert events(run, EventKind.ACTION_REUSED) == []
    assert "Funds compared: NWCE, CSTB, MWEI." in final_answer(run)
    assert_nothing_completed_ran_again(journal, run, before)
    for step_key in KEYS:
        assert executions(journal, run, step_key) == 1, step_key


def test_an_untouched_checkpoint_with_a_refusal_and_a_failure_noted_is_used(journal: Any) -> None:
    # read:1 is refused (no such document), read:2 fails (action 4), the
    # checkpoint after read:3 (action 5) notes both; the lease goes at action 6.
    documents = [DOCS[0], "no-such-fund.md", DOCS[1], DOCS[2]]
    run, newest = interrupted(
        [{"point": "tool_error", "action": 4}, {"point": "lease_stolen", "action": 6}],
        documents,
    )
    assert newest.number == 5 and newest.after_action.step_key == "read:3"
    assert len(newest.state["notes"]) == 2
    before = completed_before(journal, run)

    assert resume(run) == RunStatus.COMPLETED
    assert events(run, EventKind.CHECKPOINT_IGNORED) == []
    assert "continuing from checkpoint 5" in events(run, EventKind.CHECKPOINT_USED)[0]
    final = final_answer(run)
    for note in newest.state["notes"]:
        assert f"- {note}\n" in final
    assert "crestline-short-treasury.md: not included (read:2 failed" in final
    assert_nothing_completed_ran_again(journal, run, before)
    # The failed read was not dispatched again: the checkpoint had noted it.
    assert executions(journal, run, "read:2") == 0


def test_an_untouched_checkpoint_after_the_budget_ran_out_is_used(journal: Any) -> None:
    # Budget 5: one document, then finalizing; the lease goes before delivery.
    run = submit(
        question="Compare these funds",
        documents=DOCS,
        action_budget=5,
        faults=[{"point": "lease_stolen", "action": 4}],
    )
    assert claim_and_drive(run.pk) == "lease_lost"
    newest = run.checkpoints.filter(state__isnull=False).order_by("-number").first()
    assert newest.after_action.step_key == "compose"
    before = completed_before(journal, run)

    assert resume(run) == RunStatus.COMPLETED
    assert events(run, EventKind.CHECKPOINT_IGNORED) == []
    assert "continuing from checkpoint 3" in events(run, EventKind.CHECKPOINT_USED)[0]
    assert "not read (action budget of 5 exhausted)" in final_answer(run)
    assert_nothing_completed_ran_again(journal, run, before)

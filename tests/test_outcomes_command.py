"""`manage.py outcomes`, as an on-call operator or a script types it: the
same rules and audit as the pages, through runs.decisions."""

from __future__ import annotations

import json
import uuid
from io import StringIO

import pytest
from django.contrib.auth.models import Group, Permission, User
from django.core.management import CommandError, call_command

from runs.decisions import Request, Who, decide
from runs.executor import claim_and_drive
from runs.models import (
    DecisionChoice,
    OperatorDecision,
    OutcomeItem,
    OutcomeKind,
    OutcomeState,
    Run,
    RunStatus,
)
from tests.faultruns import run_with
from tests.receivers import LocalServer, status
from tests.test_inbox import item_on

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("short_settle")]

ITEM_KEYS = {
    "id",
    "kind",
    "state",
    "run_id",
    "run_status",
    "subject",
    "what",
    "summary",
    "opened_at",
    "age_seconds",
    "blocks",
    "blocks_why",
    "resolution",
    "resolved_at",
}
DECISION_KEYS = {
    "id",
    "item_id",
    "run_id",
    "choice",
    "decided_by",
    "reason",
    "reference",
    "state_before",
    "state_after",
    "request_token",
    "evidence_digest",
    "at",
}


def outcomes(*args: str) -> str:
    out = StringIO()
    call_command("outcomes", *args, stdout=out)
    return out.getvalue()


def outcomes_json(*args: str) -> dict:
    return json.loads(outcomes(*args, "--json"))


@pytest.fixture
def operator() -> User:
    group, _ = Group.objects.get_or_create(name="operators")
    group.permissions.add(Permission.objects.get(codename="operate_run"))
    user = User.objects.create_user("olga")
    user.groups.add(group)
    return user


@pytest.fixture
def lost_delivery(settings, journal):
    with LocalServer(status(200)) as receiver:
        settings.RUNDESK_DELIVERY_URL = receiver.url
        run, outcome = run_with([{"point": "delivery_timeout"}])
        assert outcome == RunStatus.NEEDS_OPERATOR and len(receiver.requests) == 1
        yield run, OutcomeItem.objects.get(run=run, kind=OutcomeKind.EFFECT), receiver


def test_list_shows_items_oldest_first_and_open_only_with_open(lost_delivery):
    run, item, _ = lost_delivery
    settled = item_on(RunStatus.CANCELLED)
    OutcomeItem.objects.filter(pk=settled.pk).update(
        state=OutcomeState.SETTLED, resolved_at=settled.created_at, resolution="by evidence"
    )
    everything = outcomes_json("list")["items"]
    assert [row["id"] for row in everything] == [item.pk, settled.pk]
    (row,) = outcomes_json("list", "--open")["items"]
    assert set(row) == ITEM_KEYS
    assert (row["id"], row["kind"], row["state"], row["run_id"]) == (
        item.pk,
        "effect",
        "open",
        run.pk,
    )
    assert (row["what"], row["blocks"]) == (f"rundesk:run-{run.pk}:deliver", "whole_run")
    assert row["age_seconds"] >= 0 and row["resolved_at"] is None
    text = outcomes("list", "--open")
    assert f"#{item.pk}" in text and "blocks: whole run" in text and f"#{settled.pk}" not in text
    assert outcomes_json("list", "--open", "--kind", "receipt") == {"items": []}
    assert outcomes("list", "--open", "--run", str(settled.run_id)).strip() == (
        "no outcome items open"
    )


def test_list_names_the_runs_that_wait_with_no_item_as_the_inbox_does(journal):
    cut = {"point": "drop_connection_at_commit", "write": "receipt", "action": 4}
    run, outcome = run_with(
        [{**cut, "outcome": "aborted"}] * 2, documents=["crestline-short-treasury.md"]
    )
    assert outcome == RunStatus.NEEDS_OPERATOR and not run.outcome_items.exists()
    listed = outcomes_json("list", "--open")
    assert listed["items"] == []
    (waiting,) = listed["waiting_runs"]
    assert waiting["id"] == run.pk and waiting["age_seconds"] >= 0
    assert "got no answer 2 times, and was not written" in waiting["status_reason"]
    assert [offer["choice"] for offer in waiting["offers"]] == ["resume", "abandon"]
    text = outcomes("list")
    assert "no outcome items" in text and f"run {run.pk} " in text
    assert "choices: resume, abandon" in text
    assert outcomes_json("list", "--run", str(run.pk + 1))["waiting_runs"] == []
    assert "waiting_runs" not in outcomes_json("list", "--kind", "effect")


def test_show_gives_the_evidence_gathered_now_and_the_choices(lost_delivery):
    run, item, _ = lost_delivery
    shown = outcomes_json("show", str(item.pk))
    assert set(shown) == {
        "item",
        "known",
        "evidence",
        "offers",
        "run_offers",
        "decisions",
        "alerts",
    }
    identity = f"rundesk:run-{run.pk}:deliver"
    key = run.actions.get(step_key="deliver").idempotency_key
    assert shown["evidence"]["delivery"]["idempotency_key"] == key
    assert shown["evidence"]["boundary"]["identity"] == identity
    assert [offer["choice"] for offer in shown["offers"]] == [
        "confirmed_happened",
        "resend_same_identity",
        "confirmed_not_happened",
    ]
    assert all(offer["does"] for offer in shown["offers"])
    assert [offer["choice"] for offer in shown["run_offers"]] == ["abandon"]
    text = outcomes("show", str(item.pk))
    assert "Idempotency-Key sent: " + key in text
    assert "Not known: whether the receiver has it" in text
    assert "confirmed_happened: The receiver has it: nothing is sent again." in text
    assert "resend_same_identity: Sends it again, once" in text
    assert "{'" not in text  # labelled fields, not a dict


def test_show_refuses_an_unknown_item():
    with pytest.raises(CommandError, match="no outcome item 987654"):
        outcomes("show", "987654")


def test_decide_records_who_and_why_and_the_run_completes_with_one_delivery(
    lost_delivery, operator
):
    run, item, receiver = lost_delivery
    result = outcomes_json(
        "decide",
        str(item.pk),
        "--choice",
        "confirmed_happened",
        "--reason",
        "in the receiver's log",
        "--reference",
        "D-7",
        "--as",
        "olga",
    )
    assert set(result) == {"decision", "repeated", "run_resumed", "item"}
    assert set(result["decision"]) == DECISION_KEYS
    assert result["decision"]["decided_by"] == "olga" and result["decision"]["reference"] == "D-7"
    assert result["run_resumed"] and not result["repeated"]
    assert result["item"]["state"] == "resolved"
    decision = OperatorDecision.objects.get(item=item)
    assert decision.user == operator and decision.reason == "in the receiver's log"
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    assert len(receiver.requests) == 1


def test_decide_with_the_same_token_twice_is_one_decision(lost_delivery, operator):
    _, item, _ = lost_delivery
    args = ["decide", str(item.pk), "--choice", "confirmed_happened", "--reason", "seen"]
    args += ["--as", "olga", "--token", "retry-after-lost-answer"]
    first = outcomes_json(*args)
    again = outcomes_json(*args)
    assert again["repeated"] and not again["run_resumed"]
    assert again["decision"] == first["decision"]
    assert OperatorDecision.objects.filter(item=item).count() == 1
    assert "already recorded (same token)" in outcomes(*args)


@pytest.mark.parametrize(
    "who, message",
    [
        ("vera", "vera may not decide: it needs the operator permission"),
        ("nobody", "no user 'nobody'"),
    ],
)
def test_decide_refuses_people_who_may_not_decide(lost_delivery, operator, who, message):
    _, item, _ = lost_delivery
    User.objects.create_user("vera")
    with pytest.raises(CommandError, match=message):
        outcomes(
            "decide", str(item.pk), "--choice", "confirmed_happened", "--reason", "x", "--as", who
        )
    assert not OperatorDecision.objects.exists()


@pytest.mark.parametrize(
    "option, value, message",
    [
        # What a shell passes for bytes that are no UTF-8 ($'a\xffb').
        ("--reason", "seen \udcff", "the reason holds a character no text can"),
        ("--reference", "D-\udcff", "the reference holds a character no text can"),
        ("--token", "t-\udcff", "the token holds a character no text can"),
        ("--as", "ol\udcffga", "no user 'ol"),
    ],
)
def test_decide_refuses_text_no_row_can_hold_with_a_clear_error(
    lost_delivery, operator, option, value, message
):
    _, item, _ = lost_delivery
    args = {"--reason": "seen", "--as": "olga", option: value}
    with pytest.raises(CommandError, match=message):
        outcomes(
            "decide",
            str(item.pk),
            "--choice",
            "confirmed_happened",
            *[part for pair in args.items() for part in pair],
        )
    assert not OperatorDecision.objects.exists()


def test_decide_needs_a_person_and_a_reason(lost_delivery, operator):
    _, item, _ = lost_delivery
    with pytest.raises(CommandError, match="--as"):
        outcomes("decide", str(item.pk), "--choice", "confirmed_happened", "--reason", "x")
    with pytest.raises(CommandError, match="say why"):
        outcomes(
            "decide",
            str(item.pk),
            "--choice",
            "confirmed_happened",
            "--reason",
            " ",
            "--as",
            "olga",
        )
    long = ["--reason", "seen", "--reference", "R" * 301, "--as", "olga"]
    with pytest.raises(CommandError, match="the reference is longer than 300 characters"):
        outcomes("decide", str(item.pk), "--choice", "confirmed_happened", *long)
    pasted = ["--reason", "a pasted log\r\n" * 400, "--as", "olga"]
    with pytest.raises(CommandError, match="the reason is longer than 4000 characters"):
        outcomes("decide", str(item.pk), "--choice", "confirmed_happened", *pasted)
    assert not OperatorDecision.objects.exists()


def test_decide_refuses_a_choice_the_evidence_does_not_allow(lost_delivery, operator):
    _, item, _ = lost_delivery
    out = StringIO()
    with pytest.raises(CommandError, match="written is not offered"):
        call_command(
            "outcomes",
            "decide",
            str(item.pk),
            "--choice",
            "written",
            "--reason",
            "guess",
            "--as",
            "olga",
            "--json",
            stdout=out,
        )
    refused = json.loads(out.getvalue())
    assert refused["refused"].startswith("written is not offered") and refused["winner"] is None
    assert OutcomeItem.objects.get(pk=item.pk).state == OutcomeState.OPEN


def test_decide_on_an_item_settled_meanwhile_names_the_winner(lost_delivery, operator):
    _, item, _ = lost_delivery
    winner = decide(
        item.pk,
        Request(
            choice=DecisionChoice.CONFIRMED_NOT_HAPPENED,
            who=Who(user=operator),
            token=uuid.uuid4().hex,
            reason="the receiver has no record",
        ),
    ).decision
    out = StringIO()
    with pytest.raises(CommandError, match="already settled by olga"):
        call_command(
            "outcomes",
            "decide",
            str(item.pk),
            "--choice",
            "confirmed_happened",
            "--reason",
            "seen it",
            "--as",
            "olga",
            "--json",
            stdout=out,
        )
    assert json.loads(out.getvalue())["winner"]["id"] == winner.pk
    assert OperatorDecision.objects.filter(item=item).count() == 1


def test_decide_run_abandons_a_waiting_run(lost_delivery, operator):
    run, _, receiver = lost_delivery
    with pytest.raises(CommandError, match="resume is not offered"):
        outcomes("decide-run", str(run.pk), "--choice", "resume", "--reason", "go", "--as", "olga")
    result = outcomes_json(
        "decide-run", str(run.pk), "--choice", "abandon", "--reason", "withdrawn", "--as", "olga"
    )
    assert result["run"] == {
        "id": run.pk,
        "status": "cancelled",
        "status_reason": "abandoned by olga: withdrawn",
    }
    assert result["decision"]["item_id"] is None and result["decision"]["choice"] == "abandon"
    assert Run.objects.get(pk=run.pk).status == RunStatus.CANCELLED
    assert claim_and_drive(run.pk) == "not_claimable" and len(receiver.requests) == 1


def test_decide_run_refuses_an_unknown_run(operator):
    with pytest.raises(CommandError, match="no run 987654"):
        outcomes("decide-run", "987654", "--choice", "abandon", "--reason", "x", "--as", "olga")


def test_the_help_documents_the_json_it_prints():
    from runs.management.commands.outcomes import Command

    text = Command().create_parser("manage.py", "outcomes").format_help()
    assert '\n  ITEM      {"id", "kind"' in text  # laid out as written
    assert "nothing|further_effects|whole_run" in text
    for document in ("list ", "show ", "decide ", "decide-run "):
        assert f"\n  {document}" in text

"""`export_bundle --no-evidence`: no copy of what the model was given or
answered leaves, wherever a row holds it; each is replaced by its SHA-256
and size, which still match the digests its row keeps.  Real runs on a
real PostgreSQL."""

from __future__ import annotations

import json
import zipfile

import pytest
from django.core.management import call_command

from evidence import bundles
from evidence.models import EvidenceCopy, ModelCall
from evidence.opening import open_bundle
from runs.models import Action, ActionState, Checkpoint, Receipt, Run, digest
from tests import test_bundles

pytestmark = pytest.mark.django_db(transaction=True)

decided_run = test_bundles.decided_run  # a fixture: a run an operator settled

PLANTED = "Zanzibar-quokka-7731 confidential clause"


def _action(run: Run, step_key: str, kind: str, input: dict, result: dict) -> Action:
    action = Action.objects.create(
        run=run,
        step_key=step_key,
        kind=kind,
        effect_class="read",
        input=input,
        input_digest=digest(input),
        state=ActionState.COMPLETED,
        epoch=run.lease_epoch,
    )
    Receipt.objects.create(
        action=action,
        run=run,
        step_key=step_key,
        result=result,
        result_digest=digest(result),
        epoch=run.lease_epoch,
    )
    return action


def plant(run: Run) -> None:
    """A document read, and two model calls (the built-in tool, and a
    user's tool with a model record) whose prompts and answers, copies and
    the agent state after them all hold PLANTED."""
    document = f"# Terms\n\n{PLANTED} in the document.\n"
    _action(
        run,
        "read:planted",
        "read_document",
        {"path": "planted.md"},
        {"path": "planted.md", "text": document, "sha256": "0" * 64, "bytes": len(document)},
    )
    for step_key, tool in [("summarize:planted", "model_call"), ("ask:planted", "ask_model")]:
        messages = [
            {"role": "system", "content": "Summarise."},
            {"role": "user", "content": f'<document name="planted.md">\n{document}</document>'},
        ]
        answer = {"provider": "offline", "text": f"The model says: {PLANTED}."}
        call = _action(run, step_key, tool, {"messages": messages}, answer)
        record = ModelCall.objects.create(
            run=run,
            action=call,
            provider="offline",
            input_digest=call.input_digest,
            output_digest=digest(answer),
        )
        EvidenceCopy.objects.create(
            run=run,
            model_call=record,
            input=json.dumps(messages),
            output=answer["text"],
            input_bytes=100,
            output_bytes=40,
        )
        state = {"summaries": [["planted.md", answer["text"]]], "position": 9}
        Checkpoint.objects.create(
            run=run,
            after_action=call,
            number=900 + len(step_key),
            epoch=run.lease_epoch,
            outcome="committed",
            state=state,
            state_digest=digest(state),
        )


def members(path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as bundle:
        return {name: bundle.read(name) for name in bundle.namelist()}


def rows(files: dict[str, bytes], name: str) -> list[dict]:
    return [json.loads(line) for line in files[name].decode().splitlines()]


def test_no_evidence_leaves_no_copy_of_model_input_or_output_in_any_file(decided_run, tmp_path):
    plant(decided_run)
    path = tmp_path / "shared.zip"
    call_command("export_bundle", str(decided_run.pk), "--no-evidence", "-o", str(path))
    files = members(path)
    for name, data in files.items():
        assert PLANTED.encode() not in data, name
        assert PLANTED.encode("unicode_escape") not in data, name
    assert "evidence_copies.jsonl" not in files
    assert bundles.verify(path).ok
    manifest = json.loads(files["manifest.json"])
    assert manifest["evidence_included"] is False
    left_out = manifest["left_out"]
    assert left_out["actions.jsonl"]["model input"] >= 2
    assert left_out["receipts.jsonl"]["model output"] >= 2
    assert left_out["receipts.jsonl"]["document text given to the model"] >= 1
    assert left_out["checkpoints.jsonl"]["agent state"] >= 2
    readme = files["README.txt"].decode()
    assert "Exported without evidence" in readme and "prompt" in readme


def test_what_is_left_out_still_verifies_against_the_digests_its_rows_keep(decided_run, tmp_path):
    plant(decided_run)
    path = tmp_path / "shared.zip"
    bundles.export(decided_run.pk, path, include_evidence=False)
    files = members(path)
    actions = rows(files, "actions.jsonl")
    model_calls = {a["id"] for a in actions if a["kind"] in ("model_call", "ask_model")}
    reads = {a["id"] for a in actions if a["kind"] == "read_document"}
    assert model_calls and reads
    for action in actions:
        if action["id"] in model_calls:
            stand_in = action["input"]
            assert stand_in["left_out"] == "model input"
            assert stand_in["sha256"] == action["input_digest"] and stand_in["bytes"] > 0
        else:  # every other input stays as it was: a read's path, a delivery's report
            assert "left_out" not in action["input"]
    for receipt in rows(files, "receipts.jsonl"):
        if receipt["action_id"] in model_calls | reads:
            assert receipt["result"]["sha256"] == receipt["result_digest"]
        else:
            assert "left_out" not in receipt["result"]
    for checkpoint in rows(files, "checkpoints.jsonl"):
        if checkpoint["state"] is not None:
            assert checkpoint["state"]["sha256"] == checkpoint["state_digest"]
    # The answers are the run's result: kept.
    revisions = rows(files, "revisions.jsonl")
    assert [r["content"] for r in revisions] == list(
        decided_run.revisions.order_by("number").values_list("content", flat=True)
    )


def test_a_bundle_without_evidence_opens_as_an_imported_run(decided_run, tmp_path):
    plant(decided_run)
    path = tmp_path / "shared.zip"
    bundles.export(decided_run.pk, path, include_evidence=False)
    opened = open_bundle(path)
    assert opened.first_time
    assert opened.run.actions.count() == decided_run.actions.count()


def test_with_evidence_the_model_inputs_and_outputs_are_kept(decided_run, tmp_path):
    plant(decided_run)
    path = tmp_path / "whole.zip"
    bundles.export(decided_run.pk, path)
    files = members(path)
    assert (
        PLANTED.encode() in files["actions.jsonl"] and PLANTED.encode() in files["receipts.jsonl"]
    )
    assert "left_out" not in json.loads(files["manifest.json"])

"""Opening an investigation bundle: the run comes back whole, under new ids,
read-only; a bundle that does not verify writes nothing; the same bundle
opens once; and nothing here ever executes, cancels, settles or decides an
imported run, whatever status it had where it ran.  Real runs, a real
PostgreSQL."""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
import subprocess
import sys
import threading
import uuid
import zipfile
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import Group, Permission, User
from django.core.management import call_command
from django.db import IntegrityError, connection, transaction
from django.db.models import F
from django.test import Client
from django.utils import timezone

from evidence import bundles
from evidence.capture import capture
from evidence.models import CaptureGap, EvidenceCopy, LockIncident, LockWait, ModelCall, Source
from evidence.opening import OpenRefused, open_bundle
from runs.decisions import (
    DecisionRefused,
    Request,
    Who,
    decide,
    decide_run,
    gather,
    offers,
    resume_if_settled_meanwhile,
    run_offers,
    settle_open_items,
)
from runs.executor import Executor, claim_and_drive
from runs.inbox import blocks
from runs.leases import Lease
from runs.models import (
    Action,
    ActionState,
    AnswerRevision,
    Checkpoint,
    DecisionChoice,
    OperatorDecision,
    OutcomeItem,
    OutcomeKind,
    OutcomeState,
    Receipt,
    Run,
    RunEvent,
    RunStatus,
)
from runs.outcomes import xact_status
from runs.submission import submit
from runs.sweep import sweep
from runs.timeline import timeline
from tests.conftest import ROOT
from tests.faultruns import DOCS, run_with, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("short_settle")]

# Every table a bundle fills.
TABLES = [
    Run,
    Action,
    Receipt,
    Checkpoint,
    OutcomeItem,
    OperatorDecision,
    AnswerRevision,
    RunEvent,
    Source,
    ModelCall,
    EvidenceCopy,
    CaptureGap,
    LockIncident,
    LockWait,
]


@pytest.fixture
def operator() -> User:
    user = User.objects.create_user("olga", password="x")
    group, _ = Group.objects.get_or_create(name="operators")
    group.permissions.add(Permission.objects.get(codename="operate_run"))
    user.groups.add(group)
    return User.objects.get(pk=user.pk)  # permissions are cached per instance


def operator_client(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def viewer(client: Client) -> Client:
    client.force_login(User.objects.create_user("viewer", password="x-long-password"))
    return client


def asked(choice: str, user: User, **fields: str) -> Request:
    return Request(choice=choice, who=Who(user=user), token=uuid.uuid4().hex, **fields)


def lost_delivery() -> tuple[Run, OutcomeItem]:
    """A run whose delivery answer was lost: it waits for an operator."""
    run, outcome = run_with([{"point": "delivery_timeout"}], documents=DOCS[:2])
    assert outcome == RunStatus.NEEDS_OPERATOR
    return run, OutcomeItem.objects.get(run=run, kind=OutcomeKind.EFFECT)


@pytest.fixture
def decided_run(journal, operator) -> Run:
    """Lost delivery, confirmed by an operator, then run to completion."""
    run, item = lost_delivery()
    decide(
        item.pk,
        asked(DecisionChoice.CONFIRMED_HAPPENED, operator, reason="in their log", reference="D-7"),
    )
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    timeline.flush()
    capture.flush()  # its model records, which some tests change
    return Run.objects.get(pk=run.pk)


def bundle_of(run: Run, tmp_path: Path) -> Path:
    timeline.flush()
    capture.flush()
    path = tmp_path / f"run-{run.pk}-{uuid.uuid4().hex[:6]}.zip"
    bundles.export(run.pk, path)
    assert bundles.verify(path).ok
    return path


def opened(path: Path) -> dict[str, Any]:
    out = io.StringIO()
    call_command("open_bundle", str(path), "--json", stdout=out)
    return json.loads(out.getvalue())


def imported(path: Path) -> Run:
    return Run.objects.get(pk=opened(path)["run_id"])


def counts() -> dict[str, int]:
    return {model.__name__: model.objects.count() for model in TABLES}


# -- the same story, under new ids --------------------------------------------------

# Columns that name a row of another kind in the bundle: kind they name.
REFS = {
    "action_id": "actions.jsonl",
    "after_action_id": "actions.jsonl",
    "read_action_id": "actions.jsonl",
    "checkpoint_id": "checkpoints.jsonl",
    "item_id": "outcome_items.jsonl",
    "model_call_id": "model_calls.jsonl",
    "incident_id": "lock_incidents.jsonl",
}
LISTS = {"source_ids": "sources.jsonl", "model_call_actions": "actions.jsonl"}


def same_story(original: Run, copy: Run) -> dict[str, int]:
    """Asserts that `copy` holds every row of `original`, equal but for ids,
    each reference mapped to the copy's own rows; the rows per kind."""
    ids: dict[str, dict[int, int]] = {}
    rows = {}
    for kind in bundles.KINDS:
        before = list(kind.rows(original).values())
        after = list(kind.rows(copy).values())
        assert len(before) == len(after), kind.name
        mapped = ids.setdefault(kind.name, {})
        for old, new in zip(before, after, strict=True):
            if "id" in old:
                assert new["id"] != old["id"]
                mapped[old["id"]] = new["id"]
            for key, value in old.items():
                got, why = new[key], (kind.name, key, value)
                if key == "id":
                    continue
                # An incident of the bundle belongs to the imported run.
                if key in ("run_id", "imported_run_id"):
                    assert got == copy.pk, why
                elif key in ("waiter_run_id", "blocker_run_id"):
                    assert got == (copy.pk if value == original.pk else None), why
                elif key in REFS:
                    assert got == (None if value is None else ids[REFS[key]][value]), why
                elif key in LISTS:
                    assert got == [ids[LISTS[key]][each] for each in value], why
                elif key in ("subject", "request_token", "idempotency_key"):
                    assert got == f"imported-run-{copy.pk}:{value}", why
                elif key == "user_id":
                    assert got is None, why
                else:
                    assert got == value, why
        rows[kind.name] = len(before)
    return rows


def test_a_bundle_opens_as_the_same_run_under_new_ids(decided_run, viewer, tmp_path):
    other = submit(question="another run", documents=DOCS[:1])
    incident = LockIncident.objects.create(source="sampler", processes=2, summary="a wait")
    LockWait.objects.create(
        incident=incident, waiter_pid=11, waiter_run=decided_run, blocker_pid=12, blocker_run=other
    )
    path = bundle_of(decided_run, tmp_path)
    manifest = bundles.verify(path).manifest
    said = opened(path)
    assert said["imported"] is True and said["run_id"] != decided_run.pk
    origin = said["origin"]
    assert origin["run_id"] == decided_run.pk and origin["seal"] == manifest["seal"]
    assert origin["installation"] == manifest["installation"]
    assert origin["exported_at"] == manifest["exported_at"]
    assert origin["format"] == bundles.FORMAT

    copy = Run.objects.get(pk=said["run_id"])
    assert copy.is_imported and not copy.is_active and copy.lease_owner == ""
    assert copy.origin_manifest["files"] == manifest["files"]
    for column in ("question", "documents", "status", "status_reason", "phase", "lease_epoch"):
        assert getattr(copy, column) == getattr(decided_run, column), column
    for column in ("created_at", "started_at", "finished_at"):
        assert getattr(copy, column) == getattr(decided_run, column), column
    rows = same_story(decided_run, copy)
    for name in ["actions", "receipts", "checkpoints", "outcome_items", "decisions", "revisions"]:
        assert rows[f"{name}.jsonl"] > 0, name
    for name in ["sources", "model_calls", "lock_incidents", "lock_waits"]:
        assert rows[f"{name}.jsonl"] > 0, name
    wait = LockWait.objects.get(waiter_run=copy)
    assert wait.blocker_run is None and wait.incident_id != incident.pk  # the other run is theirs
    assert rows["events.jsonl"] > 10

    # The decision came with its run: who, why, the evidence shown and its hash.
    (decision,) = OperatorDecision.objects.filter(run=copy)
    assert (decision.decided_by, decision.reason, decision.reference) == (
        "olga",
        "in their log",
        "D-7",
    )
    assert decision.user is None and len(decision.evidence_digest) == 64
    assert decision.item.run_id == copy.pk and decision.action.run_id == copy.pk
    deliver = Action.objects.get(run=copy, step_key="deliver")
    assert Receipt.objects.get(action=deliver).result["confirmed_by"] == "olga"

    page = viewer.get(f"/runs/{copy.pk}/")
    assert page.status_code == 200
    html = page.content.decode()
    for action in Action.objects.filter(run=copy):
        assert f"<code>{action.step_key}</code>" in html
    assert "olga" in html and "in their log" in html
    assert 'id="run-imported"' in html and copy.origin_seal in html  # said plainly
    item = OutcomeItem.objects.get(run=copy)
    assert viewer.get(f"/inbox/{item.pk}/").status_code == 200
    assert viewer.get("/").status_code == 200


def test_an_effect_sent_twice_by_decision_opens_with_both_dispatches(journal, operator, tmp_path):
    """The database counts the decisions that authorise a second dispatch:
    the imported effect gets its attempts once its decision is in."""
    run, item = lost_delivery()
    decide(item.pk, asked(DecisionChoice.RESEND_SAME_IDENTITY, operator, reason="resend"))
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    copy = imported(bundle_of(run, tmp_path))
    deliver = Action.objects.get(run=copy, step_key="deliver")
    assert (deliver.attempts, deliver.state) == (2, ActionState.COMPLETED)
    same_story(run, copy)


def test_a_bundle_without_evidence_opens_without_it(decided_run, tmp_path):
    path = tmp_path / "no-evidence.zip"
    bundles.export(decided_run.pk, path, include_evidence=False)
    said = opened(path)
    assert said["origin"]["evidence_included"] is False
    copy = Run.objects.get(pk=said["run_id"])
    assert not EvidenceCopy.objects.filter(run=copy).exists()
    assert ModelCall.objects.filter(run=copy).count() == decided_run.model_calls.count() > 0


def test_a_model_record_without_its_source_links_opens_without_them(decided_run, tmp_path):
    """A model record stands without its links when they could not be
    saved; its bundle named the missing link as a NULL source, and no
    database could open it."""
    call = decided_run.model_calls.order_by("id").first()
    call.sources.clear()
    copy = Run.objects.get(pk=opened(bundle_of(decided_run, tmp_path))["run_id"])
    calls = ModelCall.objects.filter(run=copy).order_by("id")
    assert calls.count() == decided_run.model_calls.count() and not calls[0].sources.exists()


def test_opening_a_bundle_twice_gives_the_first_run(decided_run, tmp_path):
    path = bundle_of(decided_run, tmp_path)
    first = opened(path)
    before = counts()
    again = opened(path)
    assert (again["run_id"], again["imported"]) == (first["run_id"], False)
    assert again["origin"] == first["origin"]
    assert counts() == before
    # Another export of the same run is another bundle: another imported run.
    other = opened(bundle_of(decided_run, tmp_path))
    assert other["imported"] and other["run_id"] != first["run_id"]
    assert Run.objects.imported().count() == 2


def test_two_opening_the_same_bundle_at_once_make_one_run(decided_run, tmp_path):
    path = bundle_of(decided_run, tmp_path)
    start = threading.Barrier(2)
    results: list[tuple[int, bool]] = []

    def open_it() -> None:
        try:
            start.wait()
            result = open_bundle(path)
            results.append((result.run.pk, result.first_time))
        finally:
            connection.close()

    threads = [threading.Thread(target=open_it) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == 2 and results[0][0] == results[1][0]
    assert sorted(flag for _, flag in results) == [False, True]
    assert Run.objects.imported().count() == 1


# Opens a bundle and prints the process's own peak RSS (VmHWM, in kB): a
# child's ru_maxrss can include what it shared with its parent, the test.
PEAK_OF_OPENING = """
import os, sys, django
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")
django.setup()
from django.core.management import call_command
call_command("open_bundle", sys.argv[1])
print(next(line for line in open("/proc/self/status") if line.startswith("VmHWM")).split()[1])
"""


@pytest.mark.slow
def test_opening_memory_stays_flat_however_many_events(tmp_path, process_env):
    """Peak RSS of opening an 8,000-event bundle (6 KB events, 48 MB) is
    within 16 MB of a 1,000-event one's, each in its own process: rows go
    in batches of at most 4 MB (about 4 MB more than 1,000 rows), and no
    statement text is kept once sent (psycopg's preparation count keeping
    each batch's INSERT takes about 45 MB more)."""
    peaks = {}
    for events in (1_000, 8_000):
        run = submit(question=f"{events} events", documents=DOCS[:1])
        with connection.cursor() as cursor:
            cursor.execute(
                """INSERT INTO runs_runevent (run_id, kind, message, data, created_at)
                   SELECT %s, 'fault_injected', 'filler event ' || n || repeat('.', 6000),
                       jsonb_build_object('n', n), now() + n * interval '1 millisecond'
                   FROM generate_series(1, %s) AS n""",
                [run.pk, events],
            )
        path = bundle_of(run, tmp_path)
        opened_by = subprocess.run(
            [sys.executable, "-c", PEAK_OF_OPENING, str(path)],
            env=process_env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        peaks[events] = int(opened_by.stdout.split()[-1]) / 1024  # MB
        copy = Run.objects.get(origin_run_id=run.pk)
        assert RunEvent.objects.filter(run=copy).count() == RunEvent.objects.filter(run=run).count()
        assert RunEvent.objects.filter(run=copy).count() >= events
    assert peaks[8_000] - peaks[1_000] <= 16, peaks


# -- refused ------------------------------------------------------------------------


def rewrite(path: Path, change) -> None:
    with zipfile.ZipFile(path) as bundle:
        files = {name: bundle.read(name) for name in bundle.namelist()}
    change(files)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as bundle:
        for name, data in files.items():
            bundle.writestr(name, data)


def flip_a_receipt_byte(files: dict[str, bytes]) -> None:
    data = bytearray(files["receipts.jsonl"])
    data[10] ^= 1
    files["receipts.jsonl"] = bytes(data)


def test_a_tampered_bundle_is_refused_with_its_failures_and_nothing_is_written(
    decided_run, tmp_path, capsys
):
    path = bundle_of(decided_run, tmp_path)
    rewrite(path, flip_a_receipt_byte)
    before = counts()
    out, err = io.StringIO(), io.StringIO()
    with pytest.raises(SystemExit) as exit:
        call_command("open_bundle", str(path), "--json", stdout=out, stderr=err)
    assert exit.value.code == 1
    said = json.loads(out.getvalue())
    assert said["run_id"] is None and said["imported"] is False
    assert said["failures"] == ["receipts.jsonl: its content does not match the manifest"]
    assert "FAILED receipts.jsonl: its content does not match the manifest" in err.getvalue()
    assert counts() == before


def test_a_file_changed_after_verification_is_refused_and_nothing_is_written(
    decided_run, tmp_path, monkeypatch
):
    """What is loaded is what was verified: each file is hashed again as
    it is read, and the transaction goes with a file that changed."""
    path = bundle_of(decided_run, tmp_path)
    verified = bundles.verify(path)

    def events_changed(files: dict[str, bytes]) -> None:
        files["events.jsonl"] = files["events.jsonl"].replace(b'"kind":"', b'"kind":"x', 1)

    rewrite(path, events_changed)
    monkeypatch.setattr(bundles, "verify", lambda _: verified)  # the file changed since
    before = counts()
    with pytest.raises(OpenRefused, match=r"events\.jsonl: changed since it was verified"):
        open_bundle(path)
    assert counts() == before


def reseal(files: dict[str, bytes]) -> None:
    """The manifest rewritten for the files as they are now, and signed
    again with this installation's key: as a faulty export would."""
    manifest = json.loads(files["manifest.json"])
    for name, data in files.items():
        if name != "manifest.json":
            entry = manifest["files"][name]
            entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    bundles.sign(manifest)
    files["manifest.json"] = json.dumps(manifest).encode()


@pytest.mark.parametrize(
    ("row", "refused"),
    [
        (b"[1, 2]\n", "a row that is not a JSON object"),
        (b" " * 600_000 + b"{}\n", "a row of more than 500000 bytes"),
    ],
    ids=["not-an-object", "too-long"],
)
def test_a_sealed_bundle_with_rows_no_export_writes_is_refused(
    decided_run, tmp_path, monkeypatch, row, refused
):
    monkeypatch.setattr("evidence.opening.MAX_ROW_BYTES", 500_000)
    path = bundle_of(decided_run, tmp_path)

    def events_changed(files: dict[str, bytes]) -> None:
        files["events.jsonl"] = row + files["events.jsonl"]
        reseal(files)

    rewrite(path, events_changed)
    assert bundles.verify(path).ok
    before = counts()
    with pytest.raises(OpenRefused, match=rf"events\.jsonl: {refused}"):
        open_bundle(path)
    assert counts() == before


# -- never executed, cancelled, settled or decided here -----------------------------


def expire(run: Run) -> None:
    Run.objects.filter(pk=run.pk).update(lease_expires_at=timezone.now() - dt.timedelta(seconds=1))


def test_an_imported_running_run_whose_lease_expired_is_never_claimed_or_requeued(
    journal, tmp_path
):
    run = submit(question="q", documents=DOCS)
    dead = Lease.claim(run.pk, "dead-owner")
    expire(run)
    path = bundle_of(run, tmp_path)
    dead.finish(RunStatus.FAILED, "ended where it ran")  # only the copy is left to claim
    copy = imported(path)
    assert (copy.status, copy.lease_owner) == (RunStatus.RUNNING, "")
    assert copy.lease_expires_at < timezone.now() and not copy.is_active

    assert Lease.claim(copy.pk, "me") is None
    assert Lease.claim_next("me") is None
    assert claim_and_drive(copy.pk) == "not_claimable"
    assert Executor().serve(once=True) == []
    out = io.StringIO()
    call_command("executor", "--once", "--json", stdout=out)
    assert out.getvalue() == ""
    assert Run.objects.claim_retry(copy.pk, None) is None
    swept = sweep(redeliver_after=0)
    assert copy.pk not in [*swept.cancelled, *swept.requeued, *swept.resumed, *swept.redelivered]
    assert Run.objects.get(pk=copy.pk).status == RunStatus.RUNNING
    assert copy.request_cancel(by="olga") is False
    assert Run.objects.get(pk=copy.pk).cancel_requested_at is None
    assert not Action.objects.filter(run=copy).exists() and sum(journal.counts().values()) == 0

    # And in the database: whatever writes it, an imported run gets no owner.
    with pytest.raises(IntegrityError, match="run_imported_never_owned"), transaction.atomic():
        Run.objects.filter(pk=copy.pk).update(lease_owner="me", lease_epoch=F("lease_epoch") + 1)


def test_an_imported_queued_run_is_never_claimed_or_handed_out(journal, tmp_path):
    run = submit(question="q", documents=DOCS)
    path = bundle_of(run, tmp_path)
    assert run.request_cancel(by="alice")  # only the copy is left to claim
    copy = imported(path)
    assert copy.status == RunStatus.QUEUED and not copy.is_active
    assert Lease.claim_next("me") is None and Lease.claim(copy.pk, "me") is None
    assert Run.objects.waiting_in_queue(0) == []
    assert Run.objects.claim_retry(copy.pk, None) is None
    assert copy.request_cancel(by="olga") is False
    assert Run.objects.get(pk=copy.pk).status == RunStatus.QUEUED


def test_an_imported_waiting_run_cannot_be_cancelled_decided_or_resumed(
    journal, operator, viewer, tmp_path
):
    run, _ = lost_delivery()
    copy = imported(bundle_of(run, tmp_path))
    item = OutcomeItem.objects.get(run=copy)
    assert (copy.status, item.state) == (RunStatus.NEEDS_OPERATOR, OutcomeState.OPEN)

    assert offers(item, gather(item)) == [] and run_offers(copy) == []
    held = blocks(item)
    assert held.code == "whole_run" and held.why.endswith("there (imported: read-only here)")
    with pytest.raises(DecisionRefused, match=r"imported from .* read-only"):
        decide(item.pk, asked(DecisionChoice.CONFIRMED_HAPPENED, operator, reason="seen"))
    for choice in (DecisionChoice.ABANDON, DecisionChoice.RESUME):
        with pytest.raises(DecisionRefused, match=r"imported from .* read-only"):
            decide_run(copy.pk, asked(choice, operator, reason="go"))
    system = Request(choice=DecisionChoice.WRITTEN, who=Who(system="test"), token="t-1")
    with pytest.raises(DecisionRefused, match="read-only"):
        decide(item.pk, system)
    assert copy.request_cancel(by="olga") is False
    assert not OperatorDecision.objects.filter(run=copy).exists()

    # Its item settled behind everyone's back: still nothing resumes it.
    OutcomeItem.objects.filter(pk=item.pk).update(
        state=OutcomeState.SETTLED, resolved_at=timezone.now(), resolution="test"
    )
    assert Run.objects.resume_if_settled(copy.pk, "settled") is False
    assert resume_if_settled_meanwhile(copy.pk, item.pk) is False
    swept = sweep(redeliver_after=0)
    assert copy.pk not in swept.resumed + swept.requeued + swept.redelivered
    copy.refresh_from_db()
    assert (copy.status, copy.cancel_requested_at) == (RunStatus.NEEDS_OPERATOR, None)
    assert viewer.get(f"/runs/{copy.pk}/").status_code == 200
    # The pages offer an operator nothing to do with it.
    page = operator_client(operator).get(f"/runs/{copy.pk}/").content.decode()
    assert "Cancel run" not in page and "Export bundle" not in page


def test_the_sweep_never_asks_about_an_imported_runs_unknown_writes(journal, tmp_path):
    """A receipt whose COMMIT answer was lost, exported once its transaction
    committed.  Here, that xid is this database's: asked about, it would
    settle the copy's item and resume the copy."""
    fault = {"point": "drop_connection_at_commit", "write": "receipt", "action": 3}
    run, outcome = run_with([{**fault, "outcome": "late", "stall_ms": 3000}])
    assert outcome == RunStatus.NEEDS_OPERATOR
    item = OutcomeItem.objects.get(run=run, kind=OutcomeKind.RECEIPT)
    wait_for(lambda: xact_status(item.xid) == "committed")
    copy = imported(bundle_of(run, tmp_path))
    copied = OutcomeItem.objects.get(run=copy, kind=OutcomeKind.RECEIPT)
    assert copied.xid == item.xid and copied.state == OutcomeState.OPEN

    shown = gather(copied)
    assert shown["now"]["xid_status"] is None and shown["now"]["error"].startswith("not asked")
    settled = settle_open_items()
    assert copy.pk not in settled.runs_resumed and run.pk in settled.runs_resumed
    assert OutcomeItem.objects.get(pk=copied.pk).state == OutcomeState.OPEN
    assert Run.objects.get(pk=copy.pk).status == RunStatus.NEEDS_OPERATOR
    assert not OperatorDecision.objects.filter(run=copy).exists()

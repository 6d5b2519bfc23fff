"""Bulk actions (runs/bulk.py, dashboard/bulk.py, `manage.py runs bulk`):
a dry run that writes nothing and says per run what would change and what
would be refused, and why; a job carried out by a real Celery worker, each
run's change recorded as its single action records it; idempotent by
request token; capped; stopped midway; refusing at execution a run that
changed since its dry run; settling unknown outcomes by evidence in bulk;
who may do what.

The real workers look at the broker's folder every 50 ms (`polled_often`),
and are killed once what a test asserts is committed: Celery notices a
SIGTERM only when its loop next wakes, seconds later."""

from __future__ import annotations

import datetime as dt
import io
import json
import threading
import uuid

import psycopg
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import Client
from django.utils import timezone

from runs import bulk, tasks
from runs.bulk import Ask, BulkJob, BulkState, ItemResult, Selection, create_job, dry_run
from runs.handover import hand_over
from runs.harness import database_url, wait_for
from runs.models import (
    AnswerRevision,
    OperatorDecision,
    OutcomeItem,
    OutcomeKind,
    OutcomeState,
    Run,
    RunEvent,
    RunStatus,
    digest,
)
from runs.outcomes import open_item
from runs.timeline import EventKind, timeline
from tests.conftest import make_user, signed_in
from tests.processes import Worker, polled_often, wait_until
from tests.processes import broker as broker  # the filesystem broker a worker reads
from tests.test_handover import fresh_producers as fresh_producers

pytestmark = pytest.mark.django_db(transaction=True)


def run_in(status: RunStatus, question: str = "a run", **fields: object) -> Run:
    """A run inserted in `status`, nothing executed (as an imported run is
    inserted: no transition leads from queued to waiting without an owner)."""
    if status in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED):
        fields["finished_at"] = timezone.now()
    if status == RunStatus.COMPLETED:
        fields["phase"] = "done"
    if status == RunStatus.RUNNING:  # an owner's, renewed
        lease = timezone.now() + dt.timedelta(minutes=1)
        fields = {
            "lease_owner": "executor@h:1",
            "lease_epoch": 1,
            "lease_expires_at": lease,
            **fields,
        }
    return Run.objects.create(question=question, documents=["a.md"], status=status, **fields)


def publication_item(run: Run, *, written: bool, xid: int | None = None) -> OutcomeItem:
    """An unanswered publication of revision 1: its transaction `xid`
    (None: no longer known), and the revision there or not (the probe)."""
    if written:
        AnswerRevision.objects.create(
            run=run, number=1, content="draft", content_digest=digest("draft"), epoch=1
        )
    return open_item(
        run_id=run.pk,
        kind=OutcomeKind.PUBLICATION,
        subject=f"publication:{uuid.uuid4().hex}",
        summary=f"publication of run {run.pk}: COMMIT sent, no answer",
        evidence={"xid": xid, "afterwards": "the run waits for an operator"},
        revision_number=1,
        xid=xid,
    )


def job_of(action: str, runs: list[Run], user: object, reason: str = "r") -> BulkJob:
    """A job of `action` on `runs`, as a confirm of their dry run makes it."""
    return create_job(
        Ask(action),
        Selection(),
        [run.pk for run in runs],
        user=user,
        reason=reason,
        token=uuid.uuid4().hex,
    ).job


def ids(*runs: Run) -> Selection:
    return Selection.by_ids(",".join(str(run.pk) for run in runs))


def recorded() -> dict[str, object]:
    """What a dry run must not change (the timeline's events written first)."""
    timeline.flush()
    return {
        "runs": sorted(Run.objects.values_list("pk", "status", "status_reason", "updated_at")),
        "decisions": OperatorDecision.objects.count(),
        "items": sorted(OutcomeItem.objects.values_list("pk", "state")),
        "events": RunEvent.objects.count(),
        "jobs": BulkJob.objects.count(),
    }


def confirm_form(planned: bulk.DryRun, **fields: str) -> dict[str, str]:
    ask, chosen = planned.ask, planned.selection
    form = {
        "action": ask.action,
        "choice": ask.choice,
        "kind": ask.kind,
        "shown": ",".join(map(str, planned.changing_ids)),
        "token": uuid.uuid4().hex,
        "reason": "the support queue was replayed by mistake",
    }
    if chosen.run_filter is not None:
        form["filter"] = chosen.query
    else:
        form["ids"] = ",".join(map(str, chosen.ids))
    return {**form, **fields}


# -- the dry run ------------------------------------------------------------------


def test_a_dry_run_changes_nothing_and_says_per_run_what_would_change_and_why_not(
    operator_user,
):
    queued = run_in(RunStatus.QUEUED, "queued")
    running = run_in(RunStatus.RUNNING, "running")
    completed = run_in(RunStatus.COMPLETED, "done")
    asked = run_in(
        RunStatus.RUNNING,
        "being cancelled",
        cancel_requested_at=timezone.now(),
        cancel_requested_by="olga",
    )
    before = recorded()
    planned = dry_run(ids(queued, running, completed, asked), Ask("cancel"))
    assert recorded() == before
    plans = {plan.run.pk: plan for plan in planned.plans}
    assert (planned.total, planned.changing, planned.refused_runs) == (4, 2, 2)
    assert plans[queued.pk].changes == ["ends at once, cancelled"]
    assert plans[running.pk].changes == [
        "cancel asked: its owner stops it before its next boundary"
    ]
    assert plans[completed.pk].refusals == [f"run {completed.pk} has already ended: completed"]
    assert plans[asked.pk].refusals == ["its cancel was already asked by olga"]

    held = run_in(RunStatus.NEEDS_OPERATOR, "held by an item")
    publication_item(held, written=False)
    free = run_in(RunStatus.NEEDS_OPERATOR, "no item holds it")
    before = recorded()
    planned = dry_run(ids(held, free, queued), Ask("resume"))
    assert recorded() == before
    plans = {plan.run.pk: plan for plan in planned.plans}
    assert plans[free.pk].changes[0].startswith("Back to the queue")
    # The single action's own words (decisions.decide_run).
    assert plans[held.pk].refusals == [
        f"resume is not offered for run {held.pk} (Needs Operator): abandon offered"
    ]
    assert plans[queued.pk].refusals == [
        f"resume is not offered for run {queued.pk} (Queued): nothing is offered"
    ]


def test_a_dry_run_by_filter_selects_the_runs_the_runs_list_shows(operator):
    waiting = [run_in(RunStatus.NEEDS_OPERATOR, f"waiting {i}") for i in range(3)]
    run_in(RunStatus.QUEUED, "queued")
    run_in(RunStatus.NEEDS_OPERATOR, "a drill's", is_drill=True)
    listed = operator.get("/?status=NEEDS_OPERATOR")
    shown = {run.pk for run in listed.context["runs"]}
    assert shown == {run.pk for run in waiting}
    # Its "act on these runs" line, counted apart (htmx loads it).
    assert 'id="bulk-act"' in listed.text and "/bulk/selects/?filter=status%3Dneeds_operator" in (
        listed.text
    )
    counted = operator.get("/bulk/selects/", {"filter": "status=needs_operator"})
    assert f"Act on these {len(waiting)} runs" in counted.text
    planned = dry_run(Selection.by_filter("status=NEEDS_OPERATOR"), Ask("abandon"))
    assert set(planned.run_ids) == shown
    page = operator.get("/bulk/dry-run/", {"filter": "status=needs_operator", "action": "abandon"})
    assert page.status_code == 200
    assert 'id="bulk-confirm"' in page.text
    assert all(f'id="plan-run-{run.pk}"' in page.text for run in waiting)


def test_a_filter_that_is_none_of_the_runs_lists_is_refused_not_read_as_every_run(operator):
    with pytest.raises(bulk.Refused, match="'stauts' is no filter of the runs list"):
        Selection.by_filter("stauts=needs_operator")
    page = operator.get("/bulk/dry-run/", {"filter": "status=waiting", "action": "cancel"})
    assert page.status_code == 400
    assert "status=&#x27;waiting&#x27; is not one of" in page.text


def test_ids_of_no_run_and_a_filter_of_no_run_are_refused_whole(operator):
    run = run_in(RunStatus.QUEUED)
    planned = dry_run(Selection.by_ids(f"{run.pk}, 999999"), Ask("cancel"))
    assert (planned.refused, planned.plans) == ("there is no run 999999", [])
    planned = dry_run(Selection.by_filter("status=failed"), Ask("cancel"))
    assert planned.refused == "no run is selected (the filter status=failed)"
    with pytest.raises(bulk.Refused, match="ids must be run numbers"):
        Selection.by_ids("1;DROP TABLE")
    page = operator.get("/bulk/dry-run/", {"ids": f"{run.pk},999999", "action": "cancel"})
    assert "Refused: there is no run 999999." in page.text
    assert 'id="bulk-confirm"' not in page.text


def test_a_selection_over_the_cap_is_refused_at_the_dry_run_with_why(
    settings, operator, operator_user
):
    settings.RUNDESK_BULK_MAX_RUNS = 2
    runs = [run_in(RunStatus.QUEUED, f"queued {i}") for i in range(3)]
    planned = dry_run(Selection.by_filter("status=queued"), Ask("cancel"))
    assert planned.plans == []
    assert planned.refused == (
        "more than 2 runs are selected (the filter status=queued); a job acts on at most 2 "
        "(RUNDESK_BULK_MAX_RUNS): narrow the selection"
    )
    page = operator.get("/bulk/dry-run/", {"filter": "status=queued", "action": "cancel"})
    assert "more than 2 runs" in page.text and 'id="bulk-confirm"' not in page.text
    with pytest.raises(bulk.Refused, match="3 runs are selected; a job acts on at most 2"):
        create_job(
            Ask("cancel"),
            Selection(),
            [run.pk for run in runs],
            user=operator_user,
            reason="r",
            token=uuid.uuid4().hex,
        )
    assert not BulkJob.objects.exists()
    assert set(Run.objects.values_list("status", flat=True)) == {RunStatus.QUEUED}


# -- the job ------------------------------------------------------------------------


def test_the_same_request_token_makes_one_job_and_each_run_changes_once(
    operator, operator_user, monkeypatch
):
    sent: list[int] = []
    monkeypatch.setattr(tasks.bulk_job, "delay", sent.append)
    waiting = [run_in(RunStatus.NEEDS_OPERATOR, f"waiting {i}") for i in range(2)]
    planned = dry_run(ids(*waiting), Ask("abandon"))
    form = confirm_form(planned)
    first = operator.post("/bulk/confirm/", form)
    again = operator.post("/bulk/confirm/", form)
    job = BulkJob.objects.get()
    assert first.url == again.url == f"/bulk/{job.pk}/"
    assert sent == [job.pk]  # handed to a worker once
    assert bulk.process(job.pk) == BulkState.DONE
    assert bulk.process(job.pk) == f"already_{BulkState.DONE}"  # redelivered: nothing more
    # Carried out again item by item (a worker that died after deciding,
    # before its item's result): the decision's token finds the first.
    BulkJob.objects.filter(pk=job.pk).update(state=BulkState.RUNNING, finished_at=None)
    job.items.update(result=ItemResult.PENDING, detail="", finished_at=None)
    assert bulk.process(job.pk) == BulkState.DONE
    assert OperatorDecision.objects.count() == 2
    assert set(job.items.values_list("detail", flat=True)) == {"already done by this job"}
    with pytest.raises(bulk.Refused, match="used for another bulk job"):
        create_job(
            Ask("cancel"),
            Selection(),
            [waiting[0].pk],
            user=operator_user,
            reason="r",
            token=form["token"],
        )


def test_a_job_is_stopped_midway_and_what_it_had_not_done_says_who_stopped_it(
    operator, operator_user, monkeypatch
):
    monkeypatch.setattr(bulk, "LOCK_WAIT", "20s")
    runs = [run_in(RunStatus.QUEUED, f"queued {i}") for i in range(4)]
    job = job_of("cancel", runs, operator_user, "a bad batch")
    # Someone holds the first run's row: the worker waits there, mid-job.
    holder = psycopg.connect(database_url())
    holder.execute("SELECT 1 FROM runs_run WHERE id = %s FOR UPDATE", [runs[0].pk])
    result: list[str] = []

    def work() -> None:
        try:
            result.append(bulk.process(job.pk))
        finally:
            connection.close()

    worker = threading.Thread(target=work)
    worker.start()
    try:
        wait_for(lambda: _waits_for_a_lock(), "the worker did not reach the held run", 10)
        response = operator.post(f"/bulk/{job.pk}/stop/")
        assert response.status_code == 302
    finally:
        holder.rollback()
        holder.close()
        worker.join(30)
    assert result == [BulkState.STOPPED]
    items = {item.run_id: item for item in job.items.all()}
    assert items[runs[0].pk].result == ItemResult.DONE  # the one in progress finished
    for run in runs[1:]:
        assert items[run.pk].result == ItemResult.STOPPED
        assert items[run.pk].detail == "not done: stopped by operator"
    statuses = dict(Run.objects.values_list("pk", "status"))
    assert statuses[runs[0].pk] == RunStatus.CANCELLED
    assert {statuses[run.pk] for run in runs[1:]} == {RunStatus.QUEUED}
    job.refresh_from_db()
    assert (job.state, job.stop_requested_by) == (BulkState.STOPPED, "operator")
    page = operator.get(f"/bulk/{job.pk}/")
    assert "stopped by operator" in page.text and "1 done, 0 refused, 3 not done" in page.text


def _sessions_where(condition: str) -> bool:
    """Whether a session of this database (not this test's) is as `condition` says."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity a LEFT JOIN pg_locks l USING (pid)"
            f" WHERE a.datname = current_database() AND a.pid <> pg_backend_pid() AND {condition})"
        )
        return cursor.fetchone()[0]


def _waits_for_a_lock() -> bool:
    return _sessions_where("NOT l.granted")


def test_a_run_that_changed_after_its_dry_run_is_refused_at_execution_with_why(operator_user):
    free = run_in(RunStatus.NEEDS_OPERATOR, "no item holds it")
    other = run_in(RunStatus.NEEDS_OPERATOR, "another")
    planned = dry_run(ids(free, other), Ask("resume"))
    assert planned.changing == 2
    # Between the dry run and the job, someone cancels one from its page.
    assert Run.objects.get(pk=free.pk).request_cancel(by="olga", reason="not needed")
    job = create_job(
        Ask("resume"),
        planned.selection,
        planned.changing_ids,
        user=operator_user,
        reason="the provider is back",
        token=uuid.uuid4().hex,
    ).job
    assert bulk.process(job.pk) == BulkState.DONE
    items = {item.run_id: item for item in job.items.all()}
    assert items[free.pk].result == ItemResult.REFUSED
    assert items[free.pk].detail == (
        f"resume is not offered for run {free.pk} (Cancelled): nothing is offered"
    )
    assert items[other.pk].result == ItemResult.DONE
    assert Run.objects.get(pk=free.pk).status == RunStatus.CANCELLED
    assert Run.objects.get(pk=other.pk).status == RunStatus.QUEUED


def test_a_bulk_check_again_settles_the_unknown_outcomes_the_evidence_can(operator_user):
    # A transaction still in flight: its write may yet commit.
    writer = psycopg.connect(database_url())
    xid = writer.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()[0]
    try:
        adopted = run_in(RunStatus.NEEDS_OPERATOR, "its revision is there")
        found = publication_item(adopted, written=True)
        lost = run_in(RunStatus.NEEDS_OPERATOR, "its revision is not there")
        missing = publication_item(lost, written=False)
        in_flight = run_in(RunStatus.NEEDS_OPERATOR, "its writer is still in flight")
        open_still = publication_item(in_flight, written=False, xid=xid)
        nothing = run_in(RunStatus.NEEDS_OPERATOR, "no item")
        before = recorded()
        planned = dry_run(
            ids(adopted, lost, in_flight, nothing), Ask("decide", "check_again", "publication")
        )
        assert recorded() == before
        plans = {plan.run.pk: plan for plan in planned.plans}
        assert plans[adopted.pk].changes[0].endswith("The evidence now settles it: committed.")
        assert plans[lost.pk].changes[0].endswith("The evidence now settles it: not written.")
        assert (
            plans[in_flight.pk].changes[0].endswith("The evidence now cannot tell: it stays open.")
        )
        assert plans[nothing.pk].refusals == ["no open answer publication item"]

        job = create_job(
            planned.ask,
            planned.selection,
            planned.changing_ids,
            user=operator_user,
            reason="the database was restarted: settle what the evidence shows",
            token=uuid.uuid4().hex,
        ).job
        assert bulk.process(job.pk) == BulkState.DONE
    finally:
        writer.close()
    states = dict(OutcomeItem.objects.values_list("pk", "state"))
    assert states[found.pk] == states[missing.pk] == OutcomeState.SETTLED
    assert states[open_still.pk] == OutcomeState.OPEN
    runs = dict(Run.objects.values_list("pk", "status"))
    assert runs[adopted.pk] == runs[lost.pk] == RunStatus.QUEUED  # nothing holds them now
    assert runs[in_flight.pk] == runs[nothing.pk] == RunStatus.NEEDS_OPERATOR
    # Each one is the operator's own decision, as on the item's page.
    for item in (found, missing, open_still):
        decision = OperatorDecision.objects.get(item=item)
        assert (decision.user, decision.choice) == (operator_user, "check_again")
        assert decision.reason == "the database was restarted: settle what the evidence shows"
        assert decision.reference == f"bulk job {job.pk}"
        assert decision.request_token == f"bulk-{job.pk}:item-{item.pk}"
    items = {item.run_id: item for item in job.items.all()}
    assert items[adopted.pk].decisions == [OperatorDecision.objects.get(item=found).pk]
    assert "settled; the run is back in the queue" in items[adopted.pk].detail
    assert "the evidence still cannot tell" in items[in_flight.pk].detail
    # What the dry run refused is left alone, as it said.
    assert job.total == 3 and nothing.pk not in items


@pytest.mark.slow
def test_a_confirmed_job_runs_in_a_real_worker_each_change_audited_as_a_single_action(
    process_env, tmp_path, broker, fresh_producers, operator, operator_user
):
    waiting = [run_in(RunStatus.NEEDS_OPERATOR, f"waiting {i}") for i in range(3)]
    queued = [run_in(RunStatus.QUEUED, f"queued {i}") for i in range(2)]
    worker = Worker(process_env, tmp_path / "worker.log", broker=polled_often(), beat=False)
    try:
        planned = dry_run(Selection.by_filter("status=needs_operator"), Ask("abandon"))
        response = operator.post("/bulk/confirm/", confirm_form(planned, reason="provider gone"))
        job = BulkJob.objects.get()
        assert response.url == f"/bulk/{job.pk}/"
        wait_until(lambda: _state(job) == BulkState.DONE, 60, "job not done", worker)
        for run in waiting:
            decision = OperatorDecision.objects.get(run=run)
            assert (decision.user, decision.decided_by, decision.choice) == (
                operator_user,
                "operator",
                "abandon",
            )
            assert (decision.reason, decision.reference) == ("provider gone", f"bulk job {job.pk}")
            assert decision.state_after == RunStatus.CANCELLED
            run.refresh_from_db()
            assert run.status_reason == "abandoned by operator: provider gone"

        # A job whose worker died midway: one run done, the rest pending,
        # nobody moving it.  Beat hands it out again; a worker carries on.
        cancel = job_of("cancel", queued, operator_user, "duplicates")
        assert cancel.start()
        first = cancel.items.order_by("id").first()
        outcome = bulk.act(cancel, first.run_id, bulk.Who(user=operator_user))
        cancel.items.filter(pk=first.pk).update(
            result=ItemResult.DONE, detail=outcome.detail, finished_at=timezone.now()
        )
        BulkJob.objects.filter(pk=cancel.pk).update(
            progressed_at=timezone.now() - bulk.STALLED_AFTER * 2
        )
        assert tasks.redeliver_bulk_jobs() == 1
        wait_until(lambda: _state(cancel) == BulkState.DONE, 60, "job not carried on", worker)
    finally:
        worker.kill()  # what is asserted is committed: no warm stop (module docstring)
    assert "runs.tasks.bulk_job" in worker.output()
    for run in queued:
        run.refresh_from_db()
        assert (run.status, run.cancel_requested_by) == (RunStatus.CANCELLED, "operator")
        # Recorded as the run page's cancel records it, once.
        event = RunEvent.objects.get(run=run, kind=EventKind.CANCEL_REQUESTED)
        assert event.data == {"by": "operator", "reason": f"duplicates (bulk job {cancel.pk})"}
    assert set(cancel.items.values_list("result", flat=True)) == {ItemResult.DONE}


def _state(job: BulkJob) -> str:
    return BulkJob.objects.values_list("state", flat=True).get(pk=job.pk)


@pytest.mark.slow
def test_a_job_whose_worker_is_killed_midway_is_carried_on_and_changes_each_run_once(
    process_env, tmp_path, broker, fresh_producers, operator_user
):
    runs = [run_in(RunStatus.QUEUED, f"queued {i}") for i in range(3)]
    job = job_of("cancel", runs, operator_user, "duplicates")
    first, held, last = job.items.order_by("id")
    # Someone holds the second run's row: the worker waits there, mid-job.
    holder = psycopg.connect(database_url())
    holder.execute("SELECT 1 FROM runs_run WHERE id = %s FOR UPDATE", [held.run_id])
    a = Worker(process_env, tmp_path / "worker-a.log", broker=polled_often(), beat=False)
    b = None
    try:
        try:
            assert hand_over(tasks.bulk_job, job.pk) == ""
            wait_until(
                lambda: _result(first) == ItemResult.DONE and _waits_for_a_lock(),
                60,
                "worker A did not reach the held run",
                a,
            )
            # Worker B starts now (a start takes seconds), and takes
            # nothing until the redelivery below: A took the job's only task.
            b = Worker(process_env, tmp_path / "worker-b.log", broker=polled_often(), beat=False)
            a.kill()  # mid-item: its transaction never commits
        finally:
            holder.rollback()
            holder.close()
        wait_for(_no_stranger_in_a_transaction, "worker A's session lingers", 10)
        assert (_result(held), _result(last)) == (ItemResult.PENDING, ItemResult.PENDING)
        assert Run.objects.get(pk=held.run_id).status == RunStatus.QUEUED
        assert "runs.tasks.bulk_job" not in b.output()

        # Nobody moves it now; beat hands it out again, and worker B carries on.
        BulkJob.objects.filter(pk=job.pk).update(
            progressed_at=timezone.now() - bulk.STALLED_AFTER * 2
        )
        assert tasks.redeliver_bulk_jobs() == 1
        wait_until(lambda: _state(job) == BulkState.DONE, 60, "job not carried on", b)
    finally:
        for worker in (a, b):
            if worker is not None:
                worker.kill()
    assert set(job.items.values_list("result", flat=True)) == {ItemResult.DONE}
    for run in runs:
        assert Run.objects.get(pk=run.pk).status == RunStatus.CANCELLED
        assert RunEvent.objects.filter(run=run, kind=EventKind.CANCEL_REQUESTED).count() == 1


def _result(item: bulk.BulkJobItem) -> str:
    return bulk.BulkJobItem.objects.values_list("result", flat=True).get(pk=item.pk)


def _no_stranger_in_a_transaction() -> bool:
    return not _sessions_where("a.state IN ('active', 'idle in transaction')")


def test_two_workers_on_one_job_take_each_run_once(operator_user):
    runs = [run_in(RunStatus.QUEUED, f"queued {i}") for i in range(12)]
    job = job_of("cancel", runs, operator_user)
    said: list[str] = []

    def work() -> None:
        try:
            said.append(bulk.process(job.pk))
        finally:
            connection.close()

    workers = [threading.Thread(target=work) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    # One ended it; the other found it ended, or ended with it.
    assert BulkState.DONE in said and len(said) == 2
    assert _state(job) == BulkState.DONE
    assert set(job.items.values_list("result", flat=True)) == {ItemResult.DONE}
    cancels = RunEvent.objects.filter(kind=EventKind.CANCEL_REQUESTED)
    assert sorted(cancels.values_list("run_id", flat=True)) == sorted(run.pk for run in runs)


# -- who may do what ----------------------------------------------------------------


@pytest.mark.parametrize(
    "method, path",
    [
        ("get", "/bulk/"),
        ("get", "/bulk/selects/?filter=status%3Dqueued"),
        ("get", "/bulk/dry-run/?ids=1&action=cancel"),
        ("post", "/bulk/confirm/"),
        ("get", "/bulk/1/"),
        ("post", "/bulk/1/stop/"),
    ],
)
def test_anonymous_is_sent_to_sign_in(client: Client, method: str, path: str):
    response = getattr(client, method)(path)
    assert response.status_code == 302 and response.url.startswith("/login/")


def test_a_viewer_reads_the_dry_run_and_the_jobs_but_confirms_and_stops_nothing(
    operator_user,
):
    viewer = signed_in(make_user("vera"))
    run = run_in(RunStatus.QUEUED)
    page = viewer.get("/bulk/dry-run/", {"ids": str(run.pk), "action": "cancel"})
    assert page.status_code == 200 and "ends at once, cancelled" in page.text
    assert 'id="bulk-confirm"' not in page.text
    assert 'id="bulk-act"' not in viewer.get("/").text
    planned = dry_run(ids(run), Ask("cancel"))
    assert viewer.post("/bulk/confirm/", confirm_form(planned)).status_code == 403
    job = job_of("cancel", [run], operator_user)
    assert viewer.get(f"/bulk/{job.pk}/").status_code == 200
    assert viewer.get("/bulk/").status_code == 200
    assert viewer.post(f"/bulk/{job.pk}/stop/").status_code == 403
    assert not BulkJob.objects.exclude(pk=job.pk).exists()
    assert Run.objects.get(pk=run.pk).status == RunStatus.QUEUED


def test_wrong_methods_are_refused(operator):
    assert operator.post("/bulk/dry-run/").status_code == 405
    assert operator.get("/bulk/confirm/").status_code == 405
    assert operator.get("/bulk/1/stop/").status_code == 405
    assert operator.post("/bulk/").status_code == 405


def test_confirm_and_stop_need_the_csrf_token(operator_user, monkeypatch):
    monkeypatch.setattr(tasks.bulk_job, "delay", lambda job_id: None)
    strict = signed_in(operator_user, enforce_csrf_checks=True)
    run = run_in(RunStatus.QUEUED)
    planned = dry_run(ids(run), Ask("cancel"))
    assert strict.post("/bulk/confirm/", confirm_form(planned)).status_code == 403
    assert not BulkJob.objects.exists()
    job = job_of("cancel", [run], operator_user)
    assert strict.post(f"/bulk/{job.pk}/stop/").status_code == 403
    job.refresh_from_db()
    assert job.stop_requested_at is None
    # With the page's token it goes through.
    page = strict.get("/bulk/dry-run/", {"ids": str(run.pk), "action": "cancel"})
    token = page.context["csrf_token"]
    form = confirm_form(planned, csrfmiddlewaretoken=str(token))
    assert strict.post("/bulk/confirm/", form).status_code == 302


def test_a_confirm_without_a_reason_starts_nothing_and_says_so(operator):
    run = run_in(RunStatus.QUEUED)
    planned = dry_run(ids(run), Ask("cancel"))
    response = operator.post("/bulk/confirm/", confirm_form(planned, reason="  "))
    assert response.status_code == 400
    assert "Say why: the reason is kept with every run" in response.text
    assert not BulkJob.objects.exists()


def test_the_progress_region_stops_polling_once_the_job_ends(operator, operator_user):
    run = run_in(RunStatus.QUEUED)
    job = job_of("cancel", [run], operator_user)
    region = {"HX-Request": "true", "HX-Target": "bulk-progress"}
    live = operator.get(f"/bulk/{job.pk}/progress/", headers=region)
    assert live.status_code == 200 and "every 2s" in live.text
    bulk.process(job.pk)
    ended = operator.get(f"/bulk/{job.pk}/progress/", headers=region)
    assert ended.status_code == 286 and "every 2s" not in ended.text
    assert "ended: cancelled by operator: r (bulk job" in ended.text


def test_a_stop_asked_through_htmx_answers_the_region_saying_what_it_stopped(
    operator, operator_user
):
    runs = [run_in(RunStatus.QUEUED, f"queued {i}") for i in range(2)]
    job = job_of("cancel", runs, operator_user)  # no worker has taken it yet
    region = {"HX-Request": "true", "HX-Target": "bulk-progress"}
    response = operator.post(f"/bulk/{job.pk}/stop/", headers=region)
    assert response.status_code == 200
    assert f"Bulk job {job.pk} stopped: 2 runs not done." in response.text
    assert "every 2s" not in response.text  # it ended: nothing left to follow
    assert _state(job) == BulkState.STOPPED
    again = operator.post(f"/bulk/{job.pk}/stop/", headers=region)
    assert f"Bulk job {job.pk} was stopped by operator." in again.text
    assert bulk.process(job.pk) == f"already_{BulkState.STOPPED}"
    assert {Run.objects.get(pk=run.pk).status for run in runs} == {RunStatus.QUEUED}


# -- the command line ---------------------------------------------------------------


def bulk_command(*args: str) -> dict:
    out = io.StringIO()
    call_command("runs", "bulk", *args, "--json", stdout=out)
    return json.loads(out.getvalue())


def test_the_command_dry_runs_then_carries_out_a_job_and_says_so_in_json(operator_user):
    queued = run_in(RunStatus.QUEUED, "queued")
    done = run_in(RunStatus.COMPLETED, "done")
    before = recorded()
    said = bulk_command("--ids", f"{queued.pk},{done.pk}", "--action", "cancel", "--dry-run")
    assert recorded() == before
    assert said["job"] is None
    assert said["dry_run"]["would_change"] == 1 and said["dry_run"]["would_refuse"] == 1
    runs = {run["id"]: run for run in said["dry_run"]["runs"]}
    assert runs[done.pk]["refusals"] == [f"run {done.pk} has already ended: completed"]
    out = io.StringIO()
    call_command(
        "runs",
        "bulk",
        "--ids",
        f"{queued.pk},{done.pk}",
        "--action",
        "cancel",
        "--dry-run",
        stdout=out,
    )
    assert out.getvalue().splitlines() == [
        "dry run: cancel each run, the 2 ids given: 2 runs, 1 would change, 1 would be refused",
        f"  run {queued.pk} (queued)",
        "    would: ends at once, cancelled",
        f"  run {done.pk} (completed)",
        f"    refused: run {done.pk} has already ended: completed",
    ]

    args = ["--ids", f"{queued.pk},{done.pk}", "--action", "cancel", "--reason", "duplicate"]
    said = bulk_command(*args, "--as", "operator", "--token", "cli-1")
    job = said["job"]
    assert (job["state"], job["repeated"], job["requested_by"]) == ("done", False, "operator")
    # The run the dry run refused is left alone.
    assert job["counts"] == {"pending": 0, "done": 1, "refused": 0, "stopped": 0}
    results = {row["run_id"]: row for row in job["results"]}
    assert results[queued.pk]["result"] == "done"
    assert done.pk not in results
    assert Run.objects.get(pk=queued.pk).status == RunStatus.CANCELLED
    again = bulk_command(*args, "--as", "operator", "--token", "cli-1")
    assert again["job"]["id"] == job["id"] and again["job"]["repeated"] is True


def test_the_command_queues_the_job_for_a_worker_with_queue(broker, fresh_producers, operator_user):
    run = run_in(RunStatus.QUEUED)
    said = bulk_command(
        "--ids", str(run.pk), "--action", "cancel", "--reason", "r", "--as", "operator", "--queue"
    )
    job = said["job"]
    assert (job["state"], job["counts"]["pending"]) == ("queued", 1)
    (message,) = [json.loads(path.read_text()) for path in broker.iterdir()]
    assert message["headers"]["task"] == "runs.tasks.bulk_job"
    assert message["headers"]["argsrepr"] == f"({job['id']},)"
    assert Run.objects.get(pk=run.pk).status == RunStatus.QUEUED  # the worker cancels it


def test_the_command_refuses_with_why(settings, operator_user):
    settings.RUNDESK_BULK_MAX_RUNS = 1
    run_in(RunStatus.QUEUED)
    run_in(RunStatus.QUEUED)
    out = io.StringIO()
    with pytest.raises(CommandError, match="more than 1 runs are selected"):
        call_command(
            "runs",
            "bulk",
            "--filter",
            "status=queued",
            "--action",
            "cancel",
            "--dry-run",
            "--json",
            stdout=out,
        )
    assert "more than 1 runs" in json.loads(out.getvalue())["refused"]
    make_user("vera")
    with pytest.raises(CommandError, match="vera may not act on runs"):
        call_command(
            "runs", "bulk", "--ids", "1", "--action", "cancel", "--reason", "r", "--as", "vera"
        )
    with pytest.raises(CommandError, match="decide needs the kind of items"):
        call_command("runs", "bulk", "--ids", "1", "--action", "decide", "--dry-run")

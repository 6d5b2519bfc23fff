"""The API's bulk jobs (/api/bulk/): a dry run that writes nothing (a
viewer's too, as the dry-run page is), a job confirmed by an operator and
carried out by a real Celery worker, followed and stopped through the API,
idempotent by request token (the token with another body: 409), capped;
the anonymous refused (401), a wrong method said (405), every answer
checked against the OpenAPI document (tests/test_api.py's ApiClient)."""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import pytest
from django.db import connection
from django.http import HttpResponse
from django.test import Client

from runs import bulk, tasks
from runs.bulk import BulkJob, BulkState, ItemResult
from runs.models import OperatorDecision, Run, RunStatus
from tests.conftest import make_user, signed_in
from tests.processes import Worker, polled_often, wait_until
from tests.processes import broker as broker  # the filesystem broker a worker reads
from tests.test_api import ApiClient, bearer, token_of
from tests.test_api import document as document  # the OpenAPI document, as a fixture
from tests.test_api import operator_api as operator_api  # olga's token
from tests.test_api import operator_user as operator_user  # olga
from tests.test_api import viewer_api as viewer_api  # vera's token
from tests.test_bulk import publication_item, recorded, run_in
from tests.test_handover import fresh_producers as fresh_producers

pytestmark = pytest.mark.django_db(transaction=True)

DRY_RUN = "/api/bulk/dry-run/"
JOBS = "/api/bulk/"


@pytest.fixture
def handed_over(monkeypatch) -> list[int]:
    """The jobs handed to the workers (none runs here): their ids."""
    sent: list[int] = []
    monkeypatch.setattr(tasks.bulk_job, "delay", sent.append)
    return sent


def confirmed(**fields: Any) -> dict[str, Any]:
    return {
        "filter": "status=queued",
        "action": "cancel",
        "reason": "a batch submitted twice",
        "request_token": uuid.uuid4().hex,
        **fields,
    }


# -- who may do what -------------------------------------------------------------------


def test_the_anonymous_are_refused_401_and_nothing_is_written(document, operator_user) -> None:
    run_in(RunStatus.QUEUED)
    anonymous = ApiClient(Client(), document)
    before = recorded()
    for answer in [
        anonymous.post(DRY_RUN, {"filter": "", "action": "cancel"}),
        anonymous.post(JOBS, confirmed()),
        anonymous.get(JOBS),
        anonymous.get(f"{JOBS}1/"),
        anonymous.post(f"{JOBS}1/stop/"),
    ]:
        assert answer.status_code == 401
        assert answer.json()["error"]["code"] == "unauthenticated"
    assert recorded() == before


def test_a_viewer_dry_runs_and_follows_but_starts_and_stops_nothing(
    viewer_api, operator_api, handed_over
) -> None:
    queued = run_in(RunStatus.QUEUED)
    started = operator_api.post(JOBS, confirmed(ids=[queued.pk], filter=None))
    job_id = started.json()["job"]["id"]
    before = recorded()
    planned = viewer_api.post(DRY_RUN, {"ids": [queued.pk], "action": "cancel"})
    assert planned.status_code == 200 and planned.json()["would_change"] == 1
    assert viewer_api.get(JOBS).json()["jobs"][0]["id"] == job_id
    assert viewer_api.get(f"{JOBS}{job_id}/").status_code == 200
    for refused in [
        viewer_api.post(JOBS, confirmed()),
        viewer_api.post(f"{JOBS}{job_id}/stop/"),
    ]:
        assert refused.status_code == 403
        assert "operator permission" in refused.json()["error"]["message"]
    assert recorded() == before


def test_a_sessions_confirm_needs_the_csrf_token(document, operator_user, handed_over) -> None:
    run_in(RunStatus.QUEUED)
    session = signed_in(operator_user, enforce_csrf_checks=True)
    refused = ApiClient(session, document).post(JOBS, confirmed())
    assert refused.status_code == 403 and "CSRF" in refused.json()["error"]["message"]
    assert not BulkJob.objects.exists() and handed_over == []


def test_a_wrong_method_is_405_in_json(viewer_api) -> None:
    for method, path in [
        ("get", DRY_RUN),
        ("put", JOBS),
        ("delete", f"{JOBS}1/"),
        ("post", f"{JOBS}1/"),
        ("get", f"{JOBS}1/stop/"),
    ]:
        answer = viewer_api.call(method, path)
        assert answer.status_code == 405, (method, path)
        assert answer.json()["error"]["code"] == "method_not_allowed"
        assert answer["Allow"]


# -- the dry run ------------------------------------------------------------------------


def test_a_dry_run_says_per_run_what_would_change_and_why_not_and_writes_nothing(
    viewer_api,
) -> None:
    queued = run_in(RunStatus.QUEUED, "queued")
    done = run_in(RunStatus.COMPLETED, "done")
    before = recorded()
    answer = viewer_api.post(DRY_RUN, {"ids": [queued.pk, done.pk], "action": "cancel"})
    assert answer.status_code == 200
    planned = answer.json()
    assert (planned["total"], planned["would_change"], planned["would_refuse"]) == (2, 1, 1)
    assert planned["refused"] is None and planned["ids"] == [queued.pk, done.pk]
    runs = {run["id"]: run for run in planned["runs"]}
    assert runs[queued.pk]["changes"] == ["ends at once, cancelled"]
    assert runs[queued.pk]["refusals"] == []
    assert runs[done.pk]["changes"] == []
    assert runs[done.pk]["refusals"] == [f"run {done.pk} has already ended: completed"]
    by_filter = viewer_api.post(DRY_RUN, {"filter": "status=completed", "action": "resume"})
    assert [run["id"] for run in by_filter.json()["runs"]] == [done.pk]
    assert by_filter.json()["would_change"] == 0
    assert recorded() == before


@pytest.mark.parametrize(
    ("body", "field", "says"),
    [
        ({"filter": "stauts=queued", "action": "cancel"}, "filter", "is no filter"),
        ({"filter": "status=lost", "action": "cancel"}, "filter", "status"),
        ({"action": "cancel"}, None, "one of the two"),
        ({"filter": "", "ids": [1], "action": "cancel"}, None, "one of the two"),
        ({"ids": [], "action": "cancel"}, "ids", "at least 1"),
        ({"filter": "", "action": "explode"}, "action", "cancel"),
        ({"filter": "", "action": "decide", "choice": "check_again"}, "action", "kind"),
        ({"filter": "", "action": "cancel", "kind": "effect"}, "action", "takes no choice"),
    ],
)
def test_a_selection_or_action_the_api_cannot_use_is_a_400_naming_it(
    viewer_api, body, field, says
) -> None:
    before = recorded()
    answer = viewer_api.post(DRY_RUN, body)
    assert answer.status_code == 400, answer.json()
    error = answer.json()["error"]
    assert error.get("field") == field and says in error["message"], error
    assert recorded() == before


def test_the_cap_refuses_a_selection_whole_at_the_dry_run_and_at_the_confirm(
    settings, operator_api, handed_over
) -> None:
    settings.RUNDESK_BULK_MAX_RUNS = 2
    for i in range(3):
        run_in(RunStatus.QUEUED, f"queued {i}")
    planned = operator_api.post(DRY_RUN, {"filter": "status=queued", "action": "cancel"}).json()
    assert (planned["total"], planned["cap"], planned["runs"]) == (3, 2, [])
    assert planned["refused"].startswith("more than 2 runs are selected (the filter status=queued)")
    refused = operator_api.post(JOBS, confirmed())
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "refused"
    assert "nothing was started: more than 2 runs" in refused.json()["error"]["message"]
    assert not BulkJob.objects.exists() and handed_over == []
    assert set(Run.objects.values_list("status", flat=True)) == {RunStatus.QUEUED}


def test_a_confirm_on_which_nothing_would_change_starts_nothing(operator_api, handed_over):
    run_in(RunStatus.COMPLETED)
    refused = operator_api.post(JOBS, confirmed(filter="status=completed"))
    assert refused.status_code == 409
    assert "nothing would change on the 1 runs selected" in refused.json()["error"]["message"]
    blank = operator_api.post(JOBS, confirmed(reason="  "))
    assert blank.status_code == 400 and blank.json()["error"]["field"] == "reason"
    assert not BulkJob.objects.exists() and handed_over == []


# -- the job -------------------------------------------------------------------------


def test_the_same_request_token_answers_the_same_job_and_another_body_is_409(
    operator_api, document, handed_over
) -> None:
    queued = [run_in(RunStatus.QUEUED, f"queued {i}") for i in range(2)]
    body = confirmed()
    first = operator_api.post(JOBS, body)
    assert first.status_code == 201, first.json()
    job = first.json()["job"]
    assert (job["state"], job["total"], job["filter"]) == ("queued", 2, "status=queued")
    assert [result["run_id"] for result in job["results"]] == [run.pk for run in queued]
    assert first.json()["repeated"] is False and first.json()["handover"] is None
    again = operator_api.post(JOBS, body)
    assert again.status_code == 200
    assert again.json()["repeated"] is True and again.json()["job"]["id"] == job["id"]
    assert handed_over == [job["id"]]  # handed to a worker once
    for other in [
        {**body, "reason": "another reason"},
        {**body, "filter": "status=queued&agent=research"},
        {**body, "action": "abandon", "filter": "status=needs_operator"},
    ]:
        conflict = operator_api.post(JOBS, other)
        assert conflict.status_code == 409, other
        error = conflict.json()["error"]
        assert (error["code"], error["field"]) == ("conflict", "request_token")
        assert f"another bulk request (job {job['id']})" in error["message"]
    # Another operator with the same token: not theirs.
    stranger = bearer(token_of(make_user("omar", operator=True)), document)
    assert stranger.post(JOBS, body).status_code == 409
    assert BulkJob.objects.count() == 1 and handed_over == [job["id"]]


def test_two_confirms_at_once_with_one_token_start_one_job(operator_user, handed_over) -> None:
    for i in range(3):
        run_in(RunStatus.QUEUED, f"queued {i}")
    body = json.dumps(confirmed())
    secret = token_of(operator_user)
    answers: list[HttpResponse] = []
    barrier = threading.Barrier(2)

    def confirming() -> None:
        try:
            client = Client(headers={"Authorization": f"Bearer {secret}"})
            barrier.wait()
            answers.append(client.post(JOBS, body, content_type="application/json"))
        finally:
            connection.close()

    threads = [threading.Thread(target=confirming) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(answer.status_code for answer in answers) == [200, 201]
    (job,) = BulkJob.objects.all()
    assert {answer.json()["job"]["id"] for answer in answers} == {job.pk}
    assert handed_over == [job.pk] and job.items.count() == 3


def test_a_token_the_pages_used_is_not_taken_for_the_apis(
    operator, operator_api, handed_over
) -> None:
    run = run_in(RunStatus.QUEUED)
    token = uuid.uuid4().hex
    page = operator.post(
        "/bulk/confirm/",
        {
            "action": "cancel",
            "ids": str(run.pk),
            "shown": str(run.pk),
            "reason": "r",
            "token": token,
        },
    )
    assert page.status_code == 302
    refused = operator_api.post(JOBS, confirmed(request_token=token, reason="r"))
    assert refused.status_code == 409
    assert "started on the pages or by the command" in refused.json()["error"]["message"]
    assert BulkJob.objects.count() == 1


def test_a_job_is_stopped_and_what_it_had_not_done_says_who_stopped_it(
    operator_api, handed_over
) -> None:
    for i in range(3):
        run_in(RunStatus.QUEUED, f"queued {i}")
    job_id = operator_api.post(JOBS, confirmed()).json()["job"]["id"]  # no worker takes it
    stopped = operator_api.post(f"{JOBS}{job_id}/stop/")
    assert stopped.status_code == 200
    answer = stopped.json()
    assert (answer["stopped"], answer["said"]) == (
        3,
        f"Bulk job {job_id} stopped: 3 runs not done.",
    )
    job = answer["job"]
    assert (job["state"], job["stop_requested_by"]) == ("stopped", "olga")
    assert job["counts"] == {"pending": 0, "done": 0, "refused": 0, "stopped": 3}
    assert {result["detail"] for result in job["results"]} == {"not done: stopped by olga"}
    assert set(Run.objects.values_list("status", flat=True)) == {RunStatus.QUEUED}
    again = operator_api.post(f"{JOBS}{job_id}/stop/").json()
    assert (again["stopped"], again["said"]) == (0, f"Bulk job {job_id} was stopped by olga.")
    assert operator_api.post(f"{JOBS}999999/stop/").status_code == 404


def test_results_and_jobs_read_a_page_at_a_time_to_the_last(
    operator_api, viewer_api, handed_over
) -> None:
    runs = [run_in(RunStatus.QUEUED, f"queued {i}") for i in range(5)]
    job_ids = [
        operator_api.post(JOBS, confirmed(ids=[run.pk], filter=None)).json()["job"]["id"]
        for run in runs[:3]
    ]
    big = operator_api.post(JOBS, confirmed()).json()["job"]["id"]  # the queued: all 5
    seen, after = [], 0
    while True:
        page = viewer_api.get(f"{JOBS}{big}/", {"limit": 2, "after": after}).json()
        seen += [result["run_id"] for result in page["results"]]
        if (after := page["next_after"]) is None:
            break
    assert seen == [run.pk for run in runs]
    pending = viewer_api.get(f"{JOBS}{big}/", {"result": "pending"}).json()["results"]
    assert len(pending) == 5
    assert viewer_api.get(f"{JOBS}{big}/", {"result": "refused"}).json()["results"] == []
    wrong = viewer_api.get(f"{JOBS}{big}/", {"result": "maybe"})
    assert wrong.status_code == 400 and wrong.json()["error"]["field"] == "result"
    listed, cursor = [], ""
    while True:
        page = viewer_api.get(JOBS, {"limit": 1, "before": cursor}).json()
        listed += [job["id"] for job in page["jobs"]]
        if not (cursor := page["next_cursor"]):
            break
    assert listed == [big, *reversed(job_ids)]  # newest first
    assert viewer_api.get(JOBS, {"before": "yesterday"}).status_code == 400
    assert viewer_api.get(f"{JOBS}999999/").status_code == 404


def test_a_decision_on_every_open_item_of_a_kind_is_dry_run_then_taken_by_evidence(
    operator_api, operator_user, handed_over
) -> None:
    adopted = run_in(RunStatus.NEEDS_OPERATOR, "its revision is there")
    found = publication_item(adopted, written=True)
    nothing = run_in(RunStatus.NEEDS_OPERATOR, "no item")
    asked = {"ids": [adopted.pk, nothing.pk], "action": "decide"}
    asked |= {"choice": "check_again", "kind": "publication"}
    before = recorded()
    planned = operator_api.post(DRY_RUN, asked).json()
    assert recorded() == before
    assert (planned["choice"], planned["kind"], planned["would_change"]) == (
        "check_again",
        "publication",
        1,
    )
    runs = {run["id"]: run for run in planned["runs"]}
    assert runs[adopted.pk]["changes"][0].endswith("The evidence now settles it: committed.")
    assert runs[nothing.pk]["refusals"] == ["no open answer publication item"]
    started = operator_api.post(JOBS, confirmed(**asked, filter=None)).json()["job"]
    assert started["asks"] == "“check the evidence again” on every open answer publication item"
    assert bulk.process(started["id"]) == BulkState.DONE  # what the worker runs
    (result,) = operator_api.get(f"{JOBS}{started['id']}/").json()["results"]
    decision = OperatorDecision.objects.get(item=found)
    assert (result["run_id"], result["result"], result["decisions"]) == (
        adopted.pk,
        ItemResult.DONE,
        [decision.pk],
    )
    assert "settled; the run is back in the queue" in result["detail"]
    assert (decision.user, decision.choice) == (operator_user, "check_again")


@pytest.mark.slow
def test_a_job_confirmed_through_the_api_is_carried_out_by_a_real_worker_and_followed(
    process_env, tmp_path, broker, fresh_producers, operator_api, operator_user
) -> None:
    waiting = [run_in(RunStatus.NEEDS_OPERATOR, f"waiting {i}") for i in range(3)]
    ended = run_in(RunStatus.COMPLETED, "ended")
    worker = Worker(process_env, tmp_path / "worker.log", broker=polled_often(), beat=False)
    try:
        body = confirmed(
            ids=[*(run.pk for run in waiting), ended.pk], filter=None, action="abandon"
        )
        started = operator_api.post(JOBS, {**body, "reason": "provider gone"})
        assert started.status_code == 201, started.json()
        assert started.json()["handover"] is None
        job_id = started.json()["job"]["id"]

        def followed() -> dict[str, Any]:
            return operator_api.get(f"{JOBS}{job_id}/").json()

        wait_until(lambda: followed()["state"] == BulkState.DONE, 60, "job not done", worker)
    finally:
        # What is asserted is committed: a kill, not a warm stop (Celery
        # notices a SIGTERM only when its loop next wakes, seconds later).
        worker.kill()
    assert "runs.tasks.bulk_job" in worker.output()
    job = followed()
    # The ended run was refused at the dry run: the job left it alone.
    assert job["total"] == 3 and job["counts"]["done"] == 3
    for result, run in zip(job["results"], waiting, strict=True):
        assert (result["run_id"], result["result"]) == (run.pk, ItemResult.DONE)
        assert result["run_status"] == RunStatus.CANCELLED
        assert result["detail"] == "abandoned by olga: provider gone"
        (decision,) = OperatorDecision.objects.filter(run=run)
        assert result["decisions"] == [decision.pk]
        assert (decision.user, decision.choice, decision.reason, decision.reference) == (
            operator_user,
            "abandon",
            "provider gone",
            f"bulk job {job_id}",
        )
    assert Run.objects.get(pk=ended.pk).status == RunStatus.COMPLETED

"""The JSON API (/api/): every operation refuses the anonymous and a bad
or revoked token (401), lets viewers read and refuses them acts (403),
says a wrong method (405), all in JSON; its OpenAPI document is valid and
every answer here conforms to the schema it declares.  It reads runs with
the runs list page's own filters and keyset pages, submits runs and
decides items by the pages' paths, idempotent by request token, and two
concurrent decisions on one item settle it once (the other: 409)."""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import jsonschema
import psycopg
import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.http import HttpResponse
from django.test import Client
from openapi_spec_validator import validate

from dashboard.models import ApiToken
from runs.bulk import Ask, BulkJob, Selection, create_job
from runs.models import DecisionChoice, OperatorDecision, OutcomeItem, OutcomeKind, Run, RunStatus
from runs.submission import submit
from tests.conftest import make_user, signed_in
from tests.faultruns import run_with
from tests.receivers import LocalServer, status

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("short_settle")]

QUESTION = {"question": "Compare these funds", "documents": ["northwind-clean-energy.md"]}


# -- clients that check every answer against the document ----------------------------


class ApiClient:
    """A test client for the API that checks every answer it gets: JSON,
    of a status the operation declares, in the shape declared for it."""

    def __init__(self, client: Client, document: dict[str, Any]) -> None:
        self.client, self.document = client, document

    def get(self, path: str, params: dict[str, Any] | None = None) -> HttpResponse:
        return self.checked("get", path, self.client.get(path, params or {}))

    def post(self, path: str, body: Any = None) -> HttpResponse:
        sent = json.dumps(body if body is not None else {})
        return self.checked(
            "post", path, self.client.post(path, sent, content_type="application/json")
        )

    def call(self, method: str, path: str) -> HttpResponse:
        return self.checked(method, path, getattr(self.client, method)(path))

    def checked(self, method: str, path: str, response: HttpResponse) -> HttpResponse:
        assert response["Content-Type"].startswith("application/json"), response.content[:300]
        conforms(self.document, method, path, response)
        return response


def conforms(document: dict[str, Any], method: str, path: str, response: HttpResponse) -> None:
    """`response` is in the shape the document declares for the operation
    at `path` and its status; every error in the one error shape."""
    body = response.json()
    operation = _operation(document, method, path)
    if operation is None or response.status_code == 405:
        # No operation of this method (405), or no address of the API (404).
        schema: dict[str, Any] = {"$ref": "#/components/schemas/ErrorOut"}
    else:
        declared = operation["responses"]
        assert str(response.status_code) in declared, (method, path, response.status_code, body)
        schema = declared[str(response.status_code)]["content"]["application/json"]["schema"]
    jsonschema.Draft202012Validator(
        {**schema, "components": document["components"]},
        format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER,
    ).validate(body)


def _operation(document: dict[str, Any], method: str, path: str) -> dict[str, Any] | None:
    for template, operations in document["paths"].items():
        pattern = re.sub(r"\{[^}]+\}", r"[^/]+", template)
        if re.fullmatch(pattern, path.split("?")[0]):
            return operations.get(method)
    return None


@pytest.fixture
def document() -> dict[str, Any]:
    user = make_user("reader")
    return signed_in(user).get("/api/openapi.json").json()


def bearer(secret: str, document: dict[str, Any], **options: Any) -> ApiClient:
    return ApiClient(Client(headers={"Authorization": f"Bearer {secret}"}, **options), document)


def token_of(user: User, name: str = "script") -> str:
    return ApiToken.objects.issue(user, name).secret


@pytest.fixture
def viewer_api(document: dict[str, Any]) -> ApiClient:
    return bearer(token_of(make_user("vera")), document)


@pytest.fixture
def operator_user() -> User:
    return make_user("olga", operator=True)


@pytest.fixture
def operator_api(operator_user: User, document: dict[str, Any]) -> ApiClient:
    return bearer(token_of(operator_user), document)


@pytest.fixture
def lost_delivery(settings, journal):
    """A run waiting for an operator: its delivery reached a real receiver,
    whose answer was lost (an open effect item)."""
    with LocalServer(status(200)) as receiver:
        settings.RUNDESK_DELIVERY_URL = receiver.url
        run, outcome = run_with([{"point": "delivery_timeout"}])
        assert outcome == RunStatus.NEEDS_OPERATOR and len(receiver.requests) == 1
        yield run, OutcomeItem.objects.get(run=run, kind=OutcomeKind.EFFECT)


def decision(choice: str = DecisionChoice.CONFIRMED_HAPPENED, **fields: str) -> dict[str, str]:
    return {
        "choice": choice,
        "reason": "the receiver has it",
        "reference": "msg-1",
        "request_token": uuid.uuid4().hex,
        **fields,
    }


def submission(**fields: Any) -> dict[str, Any]:
    return {"agent": "research", "input": QUESTION, "request_token": uuid.uuid4().hex, **fields}


def operations(run: Run, item: OutcomeItem, job: BulkJob) -> list[tuple[str, str, Any]]:
    """Every operation of the API, on a run, an item and a bulk job that
    exist (the bulk job cancels the run submitted before it)."""
    cancel = {"filter": "status=queued", "action": "cancel"}
    return [
        ("get", "/api/runs/", None),
        ("get", f"/api/runs/{run.pk}/", None),
        ("post", "/api/runs/", submission()),
        ("post", f"/api/runs/{run.pk}/decide/", decision(DecisionChoice.ABANDON)),
        ("get", "/api/items/", None),
        ("get", f"/api/items/{item.pk}/", None),
        ("post", f"/api/items/{item.pk}/decide/", decision()),
        ("post", DRY_RUN, cancel),
        ("post", "/api/bulk/", {**cancel, "reason": "r", "request_token": uuid.uuid4().hex}),
        ("get", "/api/bulk/", None),
        ("get", f"/api/bulk/{job.pk}/", None),
        ("post", f"/api/bulk/{job.pk}/stop/", None),
    ]


# The one post that writes nothing: a viewer's too, as the dry-run page is.
DRY_RUN = "/api/bulk/dry-run/"


@pytest.fixture
def bulk_job(lost_delivery, operator_user) -> BulkJob:
    """A bulk job no worker has taken: abandon the waiting run."""
    run, _ = lost_delivery
    return create_job(
        Ask("abandon"),
        Selection(),
        [run.pk],
        user=operator_user,
        reason="r",
        token=uuid.uuid4().hex,
    ).job


def send(api: ApiClient, method: str, path: str, body: Any) -> HttpResponse:
    return api.get(path) if method == "get" else api.post(path, body)


# -- the document ----------------------------------------------------------------------


def test_the_openapi_document_is_valid_and_describes_every_operation(
    lost_delivery, bulk_job, document
) -> None:
    validate(document)
    assert document["openapi"].startswith("3.")
    run, item = lost_delivery
    described = {
        (method, path)
        for path, methods in document["paths"].items()
        for method in methods
        if method in ("get", "post")
    }
    tested = {
        (method, re.sub(r"/\d+/", "/{id}/", path))
        for method, path, _ in operations(run, item, bulk_job)
    }
    assert {(m, re.sub(r"\{[^}]+\}", "{id}", p)) for m, p in described} == tested
    schemes = document["components"]["securitySchemes"]
    assert {"type": "http", "scheme": "bearer"} in schemes.values()


def test_docs_api_md_shows_every_operation(document) -> None:
    shown = (Path(__file__).resolve().parent.parent / "docs" / "API.md").read_text()
    for path, methods in document["paths"].items():
        for method in methods:
            row = f"| {method.upper()} | `{re.sub(r'{[^}]+}', '{id}', path)}` |"
            assert row in shown, row
            assert f"$RUNDESK{path.split('{')[0]}" in shown, path


def test_the_document_is_served_to_a_token_and_refused_to_the_anonymous(viewer_api) -> None:
    assert viewer_api.client.get("/api/openapi.json").status_code == 200
    anonymous = Client().get("/api/openapi.json")
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["code"] == "unauthenticated"


# -- who may do what -------------------------------------------------------------------


def test_every_operation_refuses_the_anonymous_with_401(lost_delivery, bulk_job, document) -> None:
    anonymous = ApiClient(Client(), document)
    for method, path, body in operations(*lost_delivery, bulk_job):
        answer = send(anonymous, method, path, body)
        assert answer.status_code == 401, (method, path)
        assert answer.json()["error"]["code"] == "unauthenticated"
        assert answer["WWW-Authenticate"].startswith("Bearer")
    assert Run.objects.count() == 1 and not OperatorDecision.objects.exists()


@pytest.mark.parametrize(
    "header",
    ["Bearer rdk_not-a-token", "Bearer ", "Basic b2xnYTpwYXNzd29yZA==", "rdk_no-scheme"],
)
def test_a_bad_token_is_refused_with_401_even_with_a_session(
    lost_delivery, bulk_job, document, operator_user, header
) -> None:
    client = signed_in(operator_user, headers={"Authorization": header})
    api = ApiClient(client, document)
    for method, path, body in operations(*lost_delivery, bulk_job):
        answer = send(api, method, path, body)
        assert answer.status_code == 401, (method, path, header)
    assert Run.objects.count() == 1 and not OperatorDecision.objects.exists()


def test_a_revoked_token_is_refused_with_401(
    lost_delivery, bulk_job, document, operator_user
) -> None:
    issued = ApiToken.objects.issue(operator_user, "ci")
    api = bearer(issued.secret, document)
    assert api.get("/api/runs/").status_code == 200
    assert issued.token.revoke()
    for method, path, body in operations(*lost_delivery, bulk_job):
        answer = send(api, method, path, body)
        assert answer.status_code == 401
        assert "revoked" in answer.json()["error"]["message"]
    assert Run.objects.count() == 1 and not OperatorDecision.objects.exists()


def test_an_inactive_users_token_is_refused(document, operator_user) -> None:
    api = bearer(token_of(operator_user), document)
    User.objects.filter(pk=operator_user.pk).update(is_active=False)
    assert api.get("/api/runs/").status_code == 401


def test_a_viewer_reads_everything_and_acts_on_nothing(lost_delivery, bulk_job, viewer_api) -> None:
    for method, path, body in operations(*lost_delivery, bulk_job):
        answer = send(viewer_api, method, path, body)
        if method == "get" or path == DRY_RUN:
            assert answer.status_code == 200, path
        else:
            assert answer.status_code == 403, path
            assert "operator permission" in answer.json()["error"]["message"]
    _, item = lost_delivery
    assert Run.objects.count() == 1 and not OperatorDecision.objects.exists()
    assert list(BulkJob.objects.values_list("state", flat=True)) == ["queued"]
    item.refresh_from_db()
    assert item.state == "open"


def test_an_operator_reads_and_acts(lost_delivery, bulk_job, operator_api) -> None:
    for method, path, body in operations(*lost_delivery, bulk_job):
        answer = send(operator_api, method, path, body)
        assert answer.status_code in (200, 201), (path, answer.json())
    assert Run.objects.count() == 2 and OperatorDecision.objects.count() == 2
    # A job started to cancel the submitted run (no worker here carries it
    # out); the job asked for stopped.
    started = BulkJob.objects.exclude(pk=bulk_job.pk).get()
    assert list(started.items.values_list("run__status", flat=True)) == [RunStatus.QUEUED]
    bulk_job.refresh_from_db()
    assert bulk_job.state == "stopped"


def test_a_wrong_method_is_405_in_json(lost_delivery, viewer_api) -> None:
    run, item = lost_delivery
    for method, path in [
        ("put", "/api/runs/"),
        ("delete", f"/api/runs/{run.pk}/"),
        ("post", f"/api/runs/{run.pk}/"),
        ("patch", "/api/items/"),
        ("get", f"/api/items/{item.pk}/decide/"),
        ("put", f"/api/runs/{run.pk}/decide/"),
        ("post", "/api/openapi.json"),
    ]:
        answer = viewer_api.call(method, path)
        assert answer.status_code == 405, (method, path)
        assert answer.json()["error"]["code"] == "method_not_allowed"
        assert answer["Allow"]


def test_a_session_reads_and_its_posts_need_the_csrf_token(
    lost_delivery, document, operator_user
) -> None:
    run, item = lost_delivery
    session = signed_in(operator_user, enforce_csrf_checks=True)
    api = ApiClient(session, document)
    assert api.get(f"/api/runs/{run.pk}/").status_code == 200
    refused = api.post(f"/api/items/{item.pk}/decide/", decision())
    assert refused.status_code == 403 and "CSRF" in refused.json()["error"]["message"]
    assert api.post("/api/runs/", submission()).status_code == 403
    assert not OperatorDecision.objects.exists() and Run.objects.count() == 1
    session.get("/api/tokens/")  # a page sets the CSRF cookie, as a browser gets it
    csrf = session.cookies["csrftoken"].value
    taken = session.post(
        f"/api/items/{item.pk}/decide/",
        json.dumps(decision()),
        content_type="application/json",
        headers={"X-CSRFToken": csrf},
    )
    assert taken.status_code == 200, taken.json()
    conforms(document, "post", f"/api/items/{item.pk}/decide/", taken)


def test_a_token_needs_no_csrf_token(document, operator_user) -> None:
    api = bearer(token_of(operator_user), document, enforce_csrf_checks=True)
    assert api.post("/api/runs/", submission()).status_code == 201


def test_what_is_not_there_is_a_404_in_json(viewer_api, operator_api) -> None:
    for path in ["/api/runs/999999/", "/api/items/999999/", "/api/nothing/", "/api/runs"]:
        answer = viewer_api.get(path)
        assert answer.status_code == 404, path
        assert answer.json()["error"]["code"] == "not_found"
    assert "end with a slash" in viewer_api.get("/api/runs").json()["error"]["message"]
    answer = operator_api.post("/api/items/999999/decide/", decision())
    assert answer.status_code == 404


# -- runs ----------------------------------------------------------------------------


def test_the_runs_list_takes_the_pages_filters_and_refuses_as_it_does(viewer_api) -> None:
    kept = submit(question="Renewables", documents=["northwind-clean-energy.md"])
    other = submit(question="Treasuries", documents=["crestline-short-treasury.md"])
    Run.objects.filter(pk=other.pk).update(status=RunStatus.CANCELLED, finished_at=other.created_at)
    submit(question="A drill's", documents=["northwind-clean-energy.md"], drill=True)

    def listed(**params: str) -> list[int]:
        answer = viewer_api.get("/api/runs/", params)
        assert answer.status_code == 200, answer.json()
        return [run["id"] for run in answer.json()["runs"]]

    assert listed() == [other.pk, kept.pk]  # newest first, no drill
    assert listed(status="QUEUED") == [kept.pk]  # any case, as the page reads it
    assert listed(q="treasur") == [other.pk]
    assert len(listed(drills="yes")) == 1
    viewer = signed_in(make_user("vic"))
    for params in [{"status": "lost"}, {"unknown": "maybe"}, {"q": "x" * 201}]:
        answer = viewer_api.get("/api/runs/", params)
        assert answer.status_code == 400
        said = answer.json()["error"]["message"]
        page = viewer.get("/", params)
        # The page's own words: the same code refused it.
        assert page.status_code == 400 and said.replace("'", "&#x27;") in page.content.decode()


def test_pages_of_runs_follow_their_cursor_to_the_last(viewer_api) -> None:
    made = [submit(question=f"run {n}", documents=["northwind-clean-energy.md"]) for n in range(7)]
    seen, cursor, pages = [], None, 0
    while True:
        params = {"limit": "3", **({"before": cursor} if cursor else {})}
        page = viewer_api.get("/api/runs/", params).json()
        pages += 1
        seen += [run["id"] for run in page["runs"]]
        if (cursor := page["next_cursor"]) is None:
            break
    assert pages == 3 and seen == [run.pk for run in reversed(made)]
    for params in [{"before": "not-a-cursor"}, {"limit": "0"}, {"limit": "many"}]:
        answer = viewer_api.get("/api/runs/", params)
        assert answer.status_code == 400, params
    assert viewer_api.get("/api/runs/", {"limit": "0"}).json()["error"]["field"] == "limit"


def test_a_run_reads_with_its_actions_receipts_and_items(lost_delivery, viewer_api) -> None:
    run, item = lost_delivery
    read = viewer_api.get(f"/api/runs/{run.pk}/").json()
    assert read["status"] == RunStatus.NEEDS_OPERATOR and read["open_items"] == 1
    actions = {action["step_key"]: action for action in read["actions"]}
    assert actions["deliver"]["state"] == "unknown" and actions["deliver"]["receipt"] is None
    assert actions["read:0"]["receipt"]["result_digest"]
    with_receipt = sum(action["receipt"] is not None for action in read["actions"])
    assert read["receipts"]["count"] == with_receipt == run.receipts.count()
    assert read["receipts"]["actions_without_receipt"] == len(read["actions"]) - with_receipt
    assert [listed["id"] for listed in read["items"]] == [item.pk]
    assert read["items"][0]["blocks"] == "whole_run"
    assert read["input"]["documents"]


# -- submitting ------------------------------------------------------------------------


def test_a_submission_queues_a_run_once_per_request_token(operator_api) -> None:
    asked = submission(action_budget=12)
    first = operator_api.post("/api/runs/", asked)
    assert first.status_code == 201 and first.json()["repeated"] is False
    run = Run.objects.get(pk=first.json()["run"]["id"])
    assert run.status == RunStatus.QUEUED and run.action_budget == 12
    assert run.input == QUESTION and run.agent == "research"
    again = operator_api.post("/api/runs/", asked)
    assert again.status_code == 200 and again.json()["repeated"] is True
    assert again.json()["run"]["id"] == run.pk and Run.objects.count() == 1
    other = operator_api.post("/api/runs/", {**asked, "action_budget": 13})
    assert other.status_code == 409 and other.json()["error"]["field"] == "request_token"
    assert Run.objects.count() == 1


def test_two_submissions_at_once_with_one_token_queue_one_run(document, operator_user) -> None:
    asked = submission()
    secret = token_of(operator_user)
    answers: list[HttpResponse] = []
    barrier = threading.Barrier(2)

    def submitting() -> None:
        try:
            client = Client(headers={"Authorization": f"Bearer {secret}"})
            barrier.wait()
            answers.append(
                client.post("/api/runs/", json.dumps(asked), content_type="application/json")
            )
        finally:
            connection.close()

    threads = [threading.Thread(target=submitting) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert sorted(answer.status_code for answer in answers) == [200, 201]
    assert len({answer.json()["run"]["id"] for answer in answers}) == 1
    assert Run.objects.count() == 1


@pytest.mark.parametrize(
    ("change", "field", "said"),
    [
        ({"agent": "nobody"}, "agent", "nobody"),
        ({"input": {"question": "x"}}, "input", "documents"),
        ({"input": {"question": 3, "documents": []}}, "input", "question"),
        ({"action_budget": 0}, "action_budget", "at least 1"),
        ({"input": "not an object"}, "input", ""),
        ({"request_token": ""}, "request_token", ""),
        ({"request_token": "x" * 101}, "request_token", ""),
        ({"request_token": None}, "request_token", ""),
    ],
)
def test_a_bad_submission_names_its_field_and_queues_nothing(
    operator_api, change, field, said
) -> None:
    answer = operator_api.post("/api/runs/", submission(**change))
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["field"] == field and said in error["message"]
    assert not Run.objects.exists()


def test_a_body_that_is_no_json_is_a_400(operator_api) -> None:
    answer = operator_api.client.post("/api/runs/", "{", content_type="application/json")
    assert answer.status_code == 400
    conforms(operator_api.document, "post", "/api/runs/", answer)


def test_a_nul_in_a_parameter_is_refused(viewer_api) -> None:
    answer = viewer_api.get("/api/runs/", {"q": "a\x00b"})
    assert answer.status_code == 400 and answer.json()["error"]["field"] == "q"


# -- items and decisions ---------------------------------------------------------------


def test_items_list_open_and_resolved_with_the_inboxs_filters(
    lost_delivery, viewer_api, operator_user
) -> None:
    run, item = lost_delivery

    def listed(**params: str) -> list[int]:
        return [row["id"] for row in viewer_api.get("/api/items/", params).json()["items"]]

    assert listed() == listed(state="open") == listed(kind="effect", run=str(run.pk)) == [item.pk]
    assert listed(state="resolved") == [] and listed(kind="receipt") == []
    assert viewer_api.get("/api/items/", {"run": "first"}).status_code == 400
    assert viewer_api.get("/api/items/", {"before": "x"}).json()["error"]["field"] == "before"
    decided = bearer(token_of(operator_user), viewer_api.document)
    assert decided.post(f"/api/items/{item.pk}/decide/", decision()).status_code == 200
    assert listed(state="resolved") == [item.pk] and listed(state="open") == []


def test_an_item_reads_with_its_offers_and_its_decisions(lost_delivery, operator_api) -> None:
    _, item = lost_delivery
    read = operator_api.get(f"/api/items/{item.pk}/").json()
    assert read["state"] == "open" and read["kind"] == "effect"
    offered = [offer["choice"] for offer in read["offers"]]
    assert DecisionChoice.CONFIRMED_HAPPENED in offered and all(
        offer["does"] for offer in read["offers"]
    )
    assert read["evidence"]["delivery"]["idempotency_key"] and read["decisions"] == []
    operator_api.post(f"/api/items/{item.pk}/decide/", decision())
    read = operator_api.get(f"/api/items/{item.pk}/").json()
    assert read["state"] == "resolved" and read["offers"] == []
    assert [d["decided_by"] for d in read["decisions"]] == ["olga"]


def test_a_decision_settles_the_item_and_its_repeat_changes_nothing(
    lost_delivery, operator_api
) -> None:
    run, item = lost_delivery
    asked = decision()
    first = operator_api.post(f"/api/items/{item.pk}/decide/", asked)
    assert first.status_code == 200, first.json()
    taken = first.json()
    assert taken["repeated"] is False and taken["run_resumed"] is True
    assert taken["decision"]["choice"] == DecisionChoice.CONFIRMED_HAPPENED
    run.refresh_from_db()
    assert run.status == RunStatus.QUEUED
    again = operator_api.post(f"/api/items/{item.pk}/decide/", asked).json()
    assert again["repeated"] is True and again["decision"]["id"] == taken["decision"]["id"]
    assert OperatorDecision.objects.count() == 1
    other = operator_api.post(
        f"/api/items/{item.pk}/decide/",
        {**asked, "choice": DecisionChoice.CONFIRMED_NOT_HAPPENED},
    )
    assert other.status_code == 409
    assert other.json()["error"]["decision"] == taken["decision"]["id"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"reason": "   "}, "reason"),
        ({"reason": "x" * 4001}, "reason"),
        ({"reason": "a\x00b"}, "reason"),
        ({"reference": "r" * 301}, "reference"),
        ({"request_token": ""}, "request_token"),
        ({"choice": None}, "choice"),
    ],
)
def test_a_bad_decision_names_its_field_and_decides_nothing(
    lost_delivery, operator_api, change, field
) -> None:
    _, item = lost_delivery
    answer = operator_api.post(f"/api/items/{item.pk}/decide/", decision(**change))
    assert answer.status_code == 400 and answer.json()["error"]["field"] == field
    assert not OperatorDecision.objects.exists()


def test_a_run_waiting_for_an_operator_is_abandoned_not_resumed_while_an_item_holds_it(
    lost_delivery, operator_api
) -> None:
    run, _ = lost_delivery
    read = operator_api.get(f"/api/runs/{run.pk}/").json()
    assert [offer["choice"] for offer in read["offers"]] == [DecisionChoice.ABANDON]
    path = f"/api/runs/{run.pk}/decide/"
    held = operator_api.post(path, decision(DecisionChoice.RESUME))
    assert held.status_code == 409 and "not offered" in held.json()["error"]["message"]
    asked = decision(DecisionChoice.ABANDON, reason="the customer withdrew")
    taken = operator_api.post(path, asked).json()
    assert taken["decision"]["state_after"] == RunStatus.CANCELLED and not taken["run_resumed"]
    assert operator_api.post(path, asked).json()["repeated"] is True
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED and OperatorDecision.objects.count() == 1
    assert operator_api.post("/api/runs/999999/decide/", asked).status_code == 404


def test_a_choice_the_evidence_does_not_offer_is_refused(lost_delivery, operator_api) -> None:
    _, item = lost_delivery
    answer = operator_api.post(f"/api/items/{item.pk}/decide/", decision(choice="written"))
    assert answer.status_code == 409 and "not offered" in answer.json()["error"]["message"]
    assert not OperatorDecision.objects.exists()


def test_two_decisions_at_once_one_settles_the_item_the_other_is_told_409(
    lost_delivery, document, operator_user
) -> None:
    _, item = lost_delivery
    secrets = [token_of(operator_user), token_of(make_user("omar", operator=True))]
    answers: list[HttpResponse] = []
    barrier = threading.Barrier(2)

    def deciding(secret: str, choice: str) -> None:
        try:
            client = Client(headers={"Authorization": f"Bearer {secret}"})
            body = json.dumps(decision(choice))
            barrier.wait()
            answers.append(
                client.post(f"/api/items/{item.pk}/decide/", body, content_type="application/json")
            )
        finally:
            connection.close()

    threads = [
        threading.Thread(target=deciding, args=(secrets[0], DecisionChoice.CONFIRMED_HAPPENED)),
        threading.Thread(target=deciding, args=(secrets[1], DecisionChoice.CONFIRMED_NOT_HAPPENED)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    path = f"/api/items/{item.pk}/decide/"
    for answer in answers:
        conforms(document, "post", path, answer)
    (won,) = [answer for answer in answers if answer.status_code == 200]
    (lost,) = [answer for answer in answers if answer.status_code != 200]
    assert lost.status_code == 409
    assert lost.json()["error"]["decision"] == won.json()["decision"]["id"]
    assert OperatorDecision.objects.filter(item=item).count() == 1


def test_a_decision_a_strangers_lock_holds_is_a_503_at_once(lost_delivery, operator_api) -> None:
    run, item = lost_delivery
    with psycopg.connect(**connection.get_connection_params()) as stranger:
        stranger.execute("SELECT 1 FROM runs_run WHERE id = %s FOR SHARE", [run.pk])
        started = time.monotonic()
        answer = operator_api.post(f"/api/items/{item.pk}/decide/", decision())
        assert time.monotonic() - started < 15
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "locked"
        assert "locked by another session" in answer.json()["error"]["message"]
        assert answer["Retry-After"]
    assert not OperatorDecision.objects.exists()
    assert operator_api.post(f"/api/items/{item.pk}/decide/", decision()).status_code == 200


def test_a_read_a_strangers_lock_holds_is_a_503_not_a_hang(viewer_api) -> None:
    run = submit(question="held", documents=["northwind-clean-energy.md"])
    with psycopg.connect(**connection.get_connection_params()) as stranger:
        stranger.execute("LOCK TABLE runs_run IN ACCESS EXCLUSIVE MODE")
        started = time.monotonic()
        answer = viewer_api.get(f"/api/runs/{run.pk}/")
        assert time.monotonic() - started < 15
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "locked"
    assert viewer_api.get(f"/api/runs/{run.pk}/").status_code == 200


def test_a_post_whose_token_a_strangers_lock_holds_is_a_503_not_a_hang(operator_api) -> None:
    with psycopg.connect(**connection.get_connection_params()) as stranger:
        stranger.execute("LOCK TABLE dashboard_apitoken IN ACCESS EXCLUSIVE MODE")
        started = time.monotonic()
        answer = operator_api.post("/api/runs/", submission())
        assert time.monotonic() - started < 15
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "locked"
    assert not Run.objects.exists()
    assert operator_api.post("/api/runs/", submission()).status_code == 201

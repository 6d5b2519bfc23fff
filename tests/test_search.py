"""Finding runs: labels given at submission (submit_run --label) and
filtered on, a text search over questions and inputs served by its index,
a time range, and sorts whose pages follow each other with nothing
skipped and nothing twice."""

from __future__ import annotations

import datetime as dt
import io
import json

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from runs import finding
from runs.models import Phase, Run, RunStatus
from runs.submission import submit

pytestmark = pytest.mark.django_db

T0 = dt.datetime(2026, 11, 1, 12, 0, tzinfo=dt.UTC)


def run_at(
    minutes: int,
    question: str = "a question",
    *,
    status: RunStatus = RunStatus.QUEUED,
    labels: dict[str, str] | None = None,
    started: int | None = None,
    **input_extra: object,
) -> Run:
    created = T0 + dt.timedelta(minutes=minutes)
    fields: dict[str, object] = {}
    if status in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED):
        fields["finished_at"] = created + dt.timedelta(minutes=1)
    if status == RunStatus.COMPLETED:
        fields["phase"] = Phase.DONE
    if started is not None:
        fields["started_at"] = T0 + dt.timedelta(minutes=started)
    return Run.objects.create(
        question=question,
        input={"question": question, "documents": ["a.md"], **input_extra},
        documents=["a.md"],
        status=status,
        labels=labels or {},
        created_at=created,
        **fields,
    )


def ids(response) -> list[int]:
    return [run.pk for run in response.context["runs"]]


# -- labels ---------------------------------------------------------------------------


def test_submit_run_keeps_its_labels_and_the_list_filters_on_them(viewer):
    out = io.StringIO()
    call_command(
        "submit_run",
        "--question",
        "Compare the funds",
        "--doc",
        "northwind-clean-energy.md",
        "--label",
        "team=risk",
        "--label",
        "ticket=T-42",
        "--json",
        stdout=out,
    )
    labelled = Run.objects.get(pk=json.loads(out.getvalue())["run_id"])
    assert labelled.labels == {"team": "risk", "ticket": "T-42"}
    other = submit(
        question="Other", documents=["northwind-clean-energy.md"], labels={"team": "ops"}
    )

    assert ids(viewer.get("/", {"label": "team=risk"})) == [labelled.pk]
    assert ids(viewer.get("/", {"label": ["team=risk", "ticket=T-42"]})) == [labelled.pk]
    assert ids(viewer.get("/", {"label": ["team=risk", "ticket=T-43"]})) == []
    assert ids(viewer.get("/", {"label": "team=ops"})) == [other.pk]
    page = viewer.get("/").content.decode()
    assert "team=risk" in page and "ticket=T-42" in page  # shown in the list
    run_page = viewer.get(f"/runs/{labelled.pk}/").content.decode()
    assert 'id="run-labels"' in run_page and "ticket=T-42" in run_page


@pytest.mark.parametrize(
    ("label", "said"),
    [
        ("team", "is not key=value"),
        ("=risk", "is not key=value"),
        ("te am=risk", "letters, digits"),
        ("team=" + "x" * 201, "1 to 200 characters"),
    ],
)
def test_a_bad_label_is_refused_and_nothing_is_queued(label, said):
    with pytest.raises(CommandError, match=said):
        call_command("submit_run", "--question", "q", "--doc", "a.md", "--label", label)
    assert not Run.objects.exists()


def test_a_bad_label_filter_answers_400_saying_why(viewer):
    response = viewer.get("/", {"label": "no-equals-sign"})
    assert response.status_code == 400
    assert "is not key=value" in response.content.decode()


# -- search ---------------------------------------------------------------------------


def test_search_finds_words_of_the_question_and_of_the_input_strings(viewer):
    funds = run_at(1, "Compare the Northwind funds")
    by_input = run_at(2, "Another question", customer="Acme Holdings")
    run_at(3, "Unrelated")
    assert ids(viewer.get("/", {"q": "northwind"})) == [funds.pk]
    assert ids(viewer.get("/", {"q": "FUND"})) == [funds.pk]  # a prefix, any case
    assert ids(viewer.get("/", {"q": "acme hold"})) == [by_input.pk]
    assert ids(viewer.get("/", {"q": "question"})) == [by_input.pk]  # a key is no word
    assert ids(viewer.get("/", {"q": "northwind acme"})) == []  # every word
    assert ids(viewer.get("/", {"q": "' & ! :*"})) == []  # no word: nothing, no error


def test_search_and_labels_are_served_by_their_indexes():
    """On a seeded table of 20,000 runs the planner reads the search's GIN
    index and the labels' (EXPLAIN), and the answers are right."""
    with connection.cursor() as cursor:
        cursor.execute(
            """INSERT INTO runs_run (agent, agent_version, input, question, documents, status,
                   status_reason, phase, phase_reason, action_budget, faults, faults_fired,
                   lease_owner, lease_epoch, cancel_requested_by, is_drill, origin_format,
                   origin_installation, origin_seal, created_at, updated_at, labels)
               SELECT 'research', '1', jsonb_build_object('question', 'seeded run ' || g),
                   'seeded run ' || g, '{}', 'queued', '', 'research', '', 40, '[]', '{}', '',
                   0, '', false, '', '', '', now() - make_interval(secs => g), now(),
                   jsonb_build_object('batch', 'b' || (g % 100))
               FROM generate_series(1, 20000) g"""
        )
        cursor.execute("ANALYZE runs_run")
    rare = run_at(0, "Quarterly zeppelin report", labels={"team": "airships"})

    searched = finding.matching(Run.objects.all(), "zeppelin")
    assert "run_search_idx" in searched.explain()
    assert list(searched) == [rare]
    labelled = finding.labelled(Run.objects.all(), {"team": "airships"})
    assert "run_labels_idx" in labelled.explain()
    assert list(labelled) == [rare]


# -- time, sort, pages ----------------------------------------------------------------


def test_time_range_filters_on_the_chosen_time(viewer):
    early = run_at(0, status=RunStatus.COMPLETED)  # ends at minute 1
    late = run_at(30, status=RunStatus.COMPLETED)  # ends at minute 31
    query = {"from": "2026-11-01T12:20", "to": "2026-11-01T12:40"}
    assert ids(viewer.get("/", query)) == [late.pk]
    assert ids(viewer.get("/", {**query, "time": "finished"})) == [late.pk]
    assert ids(viewer.get("/", {"to": "2026-11-01T12:02", "time": "finished"})) == [early.pk]
    bad = viewer.get("/", {"from": "yesterday"})
    assert bad.status_code == 400 and "is not a date or a time" in bad.content.decode()


def walk(viewer, sort: str, size: int) -> list[int]:
    """Every page of the list in `sort`'s order, following its cursors."""
    seen: list[int] = []
    cursor = ""
    while True:
        query = {"sort": sort, **({"before": cursor} if cursor else {})}
        response = viewer.get("/", query)
        assert response.status_code == 200
        page = ids(response)
        assert len(page) <= size
        seen += page
        cursor = response.context["next_cursor"]
        if not cursor:
            return seen


@pytest.mark.parametrize("sort", list(finding.SORTS))
def test_every_sort_pages_through_every_run_once_in_order(viewer, sort, monkeypatch):
    monkeypatch.setattr("dashboard.views.PAGE_SIZE", 4)
    statuses = [RunStatus.QUEUED, RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED]
    runs = []
    for n in range(15):
        # Ties on purpose: two runs per created minute and per start.
        started = None if n % 4 == 0 else n // 3
        status = statuses[n % 4] if started is not None else RunStatus.QUEUED
        runs.append(run_at(n // 2, f"run {n}", status=status, started=started))
    seen = walk(viewer, sort, 4)
    assert sorted(seen) == sorted(run.pk for run in runs)  # each once

    key = finding.SORTS[sort]
    rows = {run.pk: Run.objects.get(pk=run.pk) for run in runs}
    expected = sorted(rows.values(), key=lambda run: expected_key(run, key))
    assert seen == [run.pk for run in expected]


def expected_key(run: Run, sort: finding.Sort) -> tuple:
    """The order a sort promises, worked out in Python: its keys, then the
    id; a nullable sort's runs without the column last, newest first."""
    column, desc = sort.keys[0]
    if sort.nullable and getattr(run, column) is None:
        return (1, -run.created_at.timestamp(), -run.pk)
    parts: list[object] = [0]
    for column, desc in sort.keys:
        value = getattr(run, column)
        value = value.timestamp() if isinstance(value, dt.datetime) else value
        if desc:
            value = -value if not isinstance(value, str) else value
        parts.append(value)
    parts.append(-run.pk if sort.keys[-1][1] else run.pk)
    return tuple(parts)


def test_a_cursor_of_another_sort_answers_400(viewer):
    run_at(0)
    response = viewer.get("/", {"sort": "status", "before": "2026-11-01T12:00:00+00:00|1"})
    assert response.status_code == 400
    assert "(sort status)" in response.content.decode()
    assert viewer.get("/", {"sort": "sideways"}).status_code == 400

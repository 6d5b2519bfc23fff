"""Completed with gaps: a completed run whose answer leaves work out (a read
refused or failed, documents research ended before for its budget) keeps
its status, and says so: Run.objects.completed_with_gaps() finds it in one
query, runs/words.left_out names what was left out, the runs list marks it
and filters on it, its page says what at the top, and a refused action is
not shown as a success.  Real runs, executed here, over real files."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from django.conf import settings as django_settings
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from evidence.bundle_report import report_html
from runs.executor import claim_and_drive
from runs.models import Action, Phase, Run, RunStatus
from runs.submission import submit
from runs.timeline import timeline
from runs.words import LeftOut, left_out
from tests.faultruns import DOCS, run_with
from tests.test_run_page_words import section, visible

pytestmark = pytest.mark.django_db(transaction=True)

TOOL_ERROR = "the tool failed (fault plan: tool_error)"


@pytest.fixture
def corpus(tmp_path: Path, settings) -> Path:
    """The sample corpus, and a PDF beside its documents (the read tool
    refuses it: no text)."""
    folder = tmp_path / "corpus"
    shutil.copytree(django_settings.RUNDESK_CORPUS_DIR, folder)
    (folder / "prospectus.pdf").write_bytes(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n1 0 obj")
    settings.RUNDESK_CORPUS_DIR = folder
    return folder


def completed(question: str, documents: list[str], **options) -> Run:
    run = submit(question=question, documents=documents, **options)
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    timeline.flush()
    run.refresh_from_db()
    return run


def action(run: Run, step_key: str) -> Action:
    return Action.objects.get(run=run, step_key=step_key)


@pytest.fixture
def refused(corpus: Path) -> Run:
    return completed("Compare the prospectus", ["prospectus.pdf", DOCS[0]])


@pytest.fixture
def over_budget() -> Run:
    return completed("Compare all three on a small budget", DOCS, action_budget=6)


@pytest.fixture
def clean() -> Run:
    return completed("Compare two in full", DOCS[:2])


# -- what a run leaves out ------------------------------------------------------


def test_a_refused_read_is_a_gap_named_by_what_it_did(refused):
    assert refused.status == RunStatus.COMPLETED  # the status is kept
    assert left_out(refused) == [
        LeftOut(
            "reading prospectus.pdf: refused: a PDF document, not text",
            action(refused, "read:0").pk,
        )
    ]
    assert list(Run.objects.completed_with_gaps()) == [refused]


def test_a_document_gone_before_its_read_is_a_gap():
    # Submission lets a document not there yet through; it never came.
    run = completed("Compare", ["gone-by-now.md", DOCS[1]])
    assert left_out(run) == [
        LeftOut(
            "reading gone-by-now.md: refused: no such document in the corpus",
            action(run, "read:0").pk,
        )
    ]


def test_an_exhausted_budget_names_the_documents_not_read(over_budget):
    assert over_budget.phase_reason == "action budget of 6 exhausted"
    assert left_out(over_budget) == [
        LeftOut(f"1 of 3 documents not read (action budget of 6 exhausted): {DOCS[2]}")
    ]
    assert list(Run.objects.completed_with_gaps()) == [over_budget]


def test_many_documents_not_read_are_named_up_to_five_and_counted(corpus):
    names = [f"fund-{n}.md" for n in range(8)]
    for name in names:
        (corpus / name).write_text(f"# {name}\n\nExpense ratio: 0.{name[5]}%\n")
    # Room for one document (read, summary) and the two finishing actions.
    run = completed("Compare eight", names, action_budget=4)
    assert [gap.words for gap in left_out(run)] == [
        "7 of 8 documents not read (action budget of 4 exhausted): "
        "fund-1.md, fund-2.md, fund-3.md, fund-4.md, fund-5.md and 2 more"
    ]


@pytest.mark.parametrize(
    ("step", "said"),
    [
        (1, f"reading {DOCS[0]}: failed: {TOOL_ERROR}"),  # read:0
        (4, f"summarising {DOCS[1]} (the model): failed: {TOOL_ERROR}"),  # summarize:1
    ],
)
def test_a_failed_read_is_a_gap_linked_to_its_action(step, said):
    run, outcome = run_with([{"point": "tool_error", "action": step}])
    assert outcome == RunStatus.COMPLETED
    (gap,) = left_out(run)
    assert gap.words == said
    assert Action.objects.get(pk=gap.action_id).state == "failed"
    assert list(Run.objects.completed_with_gaps()) == [run]


def test_a_clean_run_leaves_nothing_out(clean):
    assert left_out(clean) == []
    assert not Run.objects.completed_with_gaps().exists()


def test_a_run_with_no_documents_listed_says_research_ended_early():
    # Another agent's run: its input names no documents to count.
    run = Run.objects.create(
        question="q",
        documents=[],
        status=RunStatus.COMPLETED,
        phase=Phase.DONE,
        phase_reason="deadline passed",
        finished_at=timezone.now(),
    )
    assert left_out(run) == [LeftOut("research ended early: deadline passed")]
    assert list(Run.objects.completed_with_gaps()) == [run]


def test_only_completed_runs_are_completed_with_gaps(corpus):
    # Refused its only document, then cancelled before it could answer.
    run = submit(
        question="q",
        documents=["prospectus.pdf", DOCS[0]],
        faults=[{"point": "cancel", "action": 2}],
    )
    assert claim_and_drive(run.pk) == RunStatus.CANCELLED
    assert left_out(run)  # its refused read, all the same
    assert not Run.objects.completed_with_gaps().exists()


def test_with_gaps_is_one_query_whatever_the_runs(refused, over_budget, clean):
    with CaptureQueriesContext(connection) as queries:
        found = set(Run.objects.completed_with_gaps().values_list("pk", flat=True))
        listed = {run.pk: run.with_gaps for run in Run.objects.listing()}
    assert found == {refused.pk, over_budget.pk}
    assert listed == {refused.pk: True, over_budget.pk: True, clean.pk: False}
    assert len(queries) == 2


# -- the runs list -----------------------------------------------------------------


def row(page: str, run: Run) -> str:
    """The runs list's row of `run`."""
    found = re.search(rf'<tr class="[^"]*">\s*<td><a href="/runs/{run.pk}/">.*?</tr>', page, re.S)
    assert found, f"no row of run {run.pk}"
    return found.group(0)


def test_the_list_marks_completed_runs_with_gaps_in_words(viewer: Client, refused, clean):
    page = viewer.get("/").content.decode()
    marked = row(page, refused)
    assert 'class="completed with-gaps"' in marked
    assert ">completed</span>" in marked
    marker = re.search(r'<span class="left-out" title="([^"]+)">([^<]+)</span>', marked)
    assert marker and "with gaps" in marker.group(2) and "leaves work out" in marker.group(1)
    assert "with gaps" not in visible(row(page, clean))
    assert "left-out" not in row(page, clean)


def test_the_status_filter_offers_completed_with_gaps(viewer: Client, refused, over_budget, clean):
    queued = submit(question="still queued", documents=DOCS[:1])
    page = viewer.get("/", {"status": "completed_with_gaps"}).content.decode()
    shown = set(map(int, re.findall(r'<tr class="[^"]*">\s*<td><a href="/runs/(\d+)/"', page)))
    assert shown == {refused.pk, over_budget.pk}
    assert '<option value="completed_with_gaps" selected>completed with gaps</option>' in page
    assert 'id="clear-filters"' in page
    # The statuses stay: completed lists every completed run, gaps or not.
    page = viewer.get("/", {"status": "completed"}).content.decode()
    shown = set(map(int, re.findall(r'<tr class="[^"]*">\s*<td><a href="/runs/(\d+)/"', page)))
    assert shown == {refused.pk, over_budget.pk, clean.pk} and queued.pk not in shown
    # As a person may type it.
    assert viewer.get("/?status=Completed_With_Gaps").status_code == 200


def test_an_unknown_status_is_refused_naming_the_new_choice(viewer: Client):
    response = viewer.get("/?status=gappy")
    assert response.status_code == 400
    text = visible(response.content.decode())
    assert "status='gappy' is not one of:" in text and "completed_with_gaps" in text


# -- the run page ----------------------------------------------------------------------


def top(page: str) -> str:
    return section(page, '<section id="run-left-out"', "</section>")


def test_the_run_page_says_at_its_top_what_was_left_out(viewer: Client, refused):
    page = viewer.get(f"/runs/{refused.pk}/").content.decode()
    read = action(refused, "read:0")
    block = top(page)
    assert page.index('id="run-status"') < page.index(block) < page.index('id="chart-timeline"')
    assert visible(block) == (
        "Completed with gaps: the answer leaves out "
        "reading prospectus.pdf: refused: a PDF document, not text"
    )
    assert f'href="#action-{read.pk}"' in block
    # The action it links to, not drawn as a success.
    action_row = section(page, f'<tr id="action-{read.pk}">', "</tr>")
    assert '<span class="state refused"' in action_row
    assert "'prospectus.pdf': a PDF document, not text" in visible(action_row)
    assert "completed" not in visible(action_row)
    # Its second document was read: its row says completed.
    other = action(refused, "read:1")
    assert ">completed</span>" in section(page, f'<tr id="action-{other.pk}">', "</tr>")


def test_the_run_page_names_documents_not_read_unlinked(viewer: Client, over_budget):
    block = top(viewer.get(f"/runs/{over_budget.pk}/").content.decode())
    assert f"1 of 3 documents not read (action budget of 6 exhausted): {DOCS[2]}" in visible(block)
    assert "<a " not in block  # no action was dispatched for it


def test_a_failed_read_is_linked_from_the_top(viewer: Client):
    run, _ = run_with([{"point": "tool_error", "action": 1}])
    page = viewer.get(f"/runs/{run.pk}/").content.decode()
    failed = action(run, "read:0")
    assert f'<a href="#action-{failed.pk}">reading {DOCS[0]}: failed: ' in top(page)
    assert '<span class="state failed">' in section(page, f'<tr id="action-{failed.pk}">', "</tr>")


def test_a_clean_run_page_says_nothing_of_gaps(viewer: Client, clean):
    page = viewer.get(f"/runs/{clean.pk}/").content.decode()
    assert 'id="run-left-out"' not in page and "Completed with gaps" not in page
    assert 'class="state refused"' not in page


# -- a bundle's report.html --------------------------------------------------------


def test_a_bundles_report_says_it_too(refused, clean):
    report = report_html(refused)
    read = action(refused, "read:0")
    block = top(report)
    assert visible(block) == (
        "Completed with gaps: the answer leaves out "
        "reading prospectus.pdf: refused: a PDF document, not text"
    )
    assert f'href="#action-{read.pk}"' in block
    assert '<span class="state refused"' in section(report, f'<tr id="action-{read.pk}">', "</tr>")
    assert 'id="run-left-out"' not in report_html(clean)

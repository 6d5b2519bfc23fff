"""Small things a tired reader trips on: a run's page says when it was
submitted, started and ended, with the zone; the drill that restarts
PostgreSQL says the real reason it cannot run; the runs list says that drill
runs are hidden (their ids are skipped) and offers them; an answer's
headings are never larger than the page's own."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.db import connection
from django.utils import timezone
from playwright.sync_api import Page, expect

from runs.drills import restart_refused
from runs.models import Run
from runs.submission import submit
from tests.faultruns import run_with

pytestmark = pytest.mark.django_db(transaction=True)


def run_times(page: str) -> str:
    found = re.search(r'<dd id="run-times">(.*?)</dd>', page, re.S)
    assert found, "no submitted/started/ended line"
    return re.sub(r"<[^>]+>", "", found.group(1))


def test_a_run_page_says_when_it_was_submitted_started_and_ended_with_the_zone(viewer, journal):
    run, _ = run_with([])
    said = run_times(viewer.get(f"/runs/{run.pk}/").content.decode())

    def at(moment) -> str:
        return timezone.localtime(moment).strftime("%Y-%m-%d %H:%M:%S %Z")

    assert said == (
        f"submitted {at(run.created_at)} · started {at(run.started_at)} · "
        f"ended {at(run.finished_at)}"
    )
    assert " UTC" in said  # the zone the times are in (settings.TIME_ZONE)


def test_a_queued_run_says_it_has_not_started_or_ended(viewer):
    run = submit(question="not yet", documents=["a.md"])
    said = run_times(viewer.get(f"/runs/{run.pk}/").content.decode())
    assert said.endswith("· not started yet · not ended") and said.startswith("submitted ")


def served_from() -> Path:
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('data_directory')")
        return Path(cursor.fetchone()[0])


def test_the_restart_drill_says_why_it_cannot_run_not_that_database_url_is_set(tmp_path):
    # DATABASE_URL is set here, as `make demo` sets it for its processes:
    # that is never the reason given.
    data = tmp_path / "postgres"
    no_server = restart_refused(data)
    assert f"no embedded PostgreSQL runs from {data}" in no_server
    data.mkdir()
    (data / "postmaster.pid").write_text("4242\n")
    another = restart_refused(data)
    assert f"it is served from {served_from()}, not by the embedded one in {data}" in another
    for said in (no_server, another):
        assert "DATABASE_URL" not in said


def test_the_restart_drill_runs_on_the_server_it_controls_whatever_database_url_says():
    data = served_from()
    if not (data / "postmaster.pid").exists():
        pytest.skip(f"this test process cannot see {data}")
    assert restart_refused(data) is None


def test_the_runs_list_says_drill_runs_are_hidden_and_links_to_them(viewer):
    Run.objects.create(question="a drill's run", documents=["a.md"], is_drill=True)
    page = viewer.get("/?status=queued").content.decode()
    note = re.search(r'<span class="muted" id="drills-hidden">(.*?)</span>', page, re.S)
    assert note and "drill runs hidden" in note.group(1)
    link = re.search(r'href="([^"]+)">show</a>', note.group(1)).group(1)
    assert "drills=1" in link and "status=queued" in link  # the other filters kept
    shown = viewer.get("/" + link.replace("&amp;", "&")).content.decode()
    assert "a drill&#x27;s run" in shown and 'id="drills-hidden"' not in shown


@pytest.mark.slow
@pytest.mark.usefixtures("journal")
def test_an_answers_headings_are_never_larger_than_the_pages_own(page: Page):
    run, _ = run_with([])
    page.goto(f"/runs/{run.pk}/")
    answer = page.locator(".answer").first
    expect(answer).to_be_visible()
    sizes = page.evaluate(
        """() => {
            const px = (el) => parseFloat(getComputedStyle(el).fontSize);
            const inAnswer = [...document.querySelectorAll('.answer :is(h1,h2,h3,h4,h5,h6)')];
            const own = px(document.querySelector('article.revision > h3'));
            const title = px(document.querySelector('main h1'));
            return {answer: inAnswer.map(px), own: own, page: title};
        }"""
    )
    assert sizes["answer"], "the answer has headings to compare"
    # Under the revision's heading they sit under, and so under the page's.
    assert max(sizes["answer"]) <= sizes["own"] <= sizes["page"]

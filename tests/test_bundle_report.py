"""report.html of an investigation bundle: the run page in one file that
opens offline.  On a real run whose delivery answer was lost and which an
operator settled: it shows the item, its evidence and the decision; the
same run gives the same bytes; it points nowhere and runs no model output;
and Chromium, with every request refused, draws its timeline."""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest
from django.db import connection
from playwright.sync_api import Browser, Route, expect
from playwright.sync_api import Request as BrowserRequest

from evidence.bundle_report import EVENTS_SHOWN, report_html
from evidence.capture import capture
from evidence.models import EvidenceCopy
from runs.decisions import Request, Who, decide
from runs.executor import claim_and_drive
from runs.models import (
    AnswerRevision,
    DecisionChoice,
    OutcomeItem,
    OutcomeKind,
    Receipt,
    Run,
    RunStatus,
)
from runs.submission import submit
from runs.timeline import timeline
from tests.conftest import manage
from tests.faultruns import DOCS
from tests.receivers import LocalServer, status
from tests.test_browser import SCREENSHOTS

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("short_settle")]

HOSTILE_QUESTION = (
    "Deliver the fund comparison <script>window.pwned = 'question'</script>"
    "<img src=x onerror=\"window.pwned = 'img'\">"
)
# A draft answer as a model might write it: a script, a tracking image and
# a link to elsewhere.
HOSTILE_ANSWER = (
    "## Draft\n\n<script>window.pwned = 'answer'</script>\n\n"
    "![pixel](https://tracker.example/p.png) see [the source](https://evil.example/x) "
    "and [a local file](notes.html)\n"
)
REASON = "Found in the receiver's log as D-7 <b>not bold</b>"


@pytest.fixture
def operator_name() -> str:
    return "olga"  # the report names who decided


@pytest.fixture
def settled(settings, journal, operator_user) -> tuple[Run, OutcomeItem]:
    """A run whose delivery reached the receiver but whose answer was lost;
    an operator confirmed it happened, and the run completed."""
    with LocalServer(status(200)) as receiver:
        settings.RUNDESK_DELIVERY_URL = receiver.url
        run = submit(
            question=HOSTILE_QUESTION, documents=DOCS, faults=[{"point": "delivery_timeout"}]
        )
        assert claim_and_drive(run.pk) == RunStatus.NEEDS_OPERATOR
        item = OutcomeItem.objects.get(run=run, kind=OutcomeKind.EFFECT)
        decide(
            item.pk,
            Request(
                choice=DecisionChoice.CONFIRMED_HAPPENED,
                who=Who(user=operator_user),
                token=uuid.uuid4().hex,
                reason=REASON,
                reference="D-7",
            ),
        )
        assert claim_and_drive(run.pk) == RunStatus.COMPLETED
        assert len(receiver.requests) == 1
    last = AnswerRevision.objects.filter(run=run).order_by("-number").first()
    AnswerRevision.objects.create(
        run=run,
        number=last.number + 1,
        content=HOSTILE_ANSWER,
        content_digest="0" * 64,
        epoch=last.epoch,
    )
    timeline.flush()
    capture.flush()
    run.refresh_from_db()
    return run, item


class Addresses(HTMLParser):
    """Every element's src and href and event handler attributes, and every
    script element's attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.addresses: list[tuple[str, str, str]] = []
        self.scripts: list[dict[str, str | None]] = []
        self.handlers: list[tuple[str, str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("src", "href"):
                self.addresses.append((tag, name, value or ""))
            if name.startswith("on"):
                self.handlers.append((tag, name))
        if tag == "script":
            self.scripts.append(dict(attrs))


def parsed(html: str) -> Addresses:
    parser = Addresses()
    parser.feed(html)
    return parser


def timeline_json(html: str) -> str:
    found = re.search(
        r'<script id="chart-timeline-data" type="application/json">(.*?)</script>', html, re.S
    )
    assert found, "no timeline data block"
    return found.group(1)


def test_report_shows_the_run_its_lost_delivery_and_the_decision_taken(settled):
    run, item = settled
    html = report_html(run)
    assert (
        "Exported from Rundesk — an investigation bundle; verify it with "
        "<code>python manage.py verify_bundle</code>"
    ) in html
    assert f"<title>Run {run.pk} · Rundesk investigation bundle</title>" in html
    assert '<span class="status completed" id="run-status">completed</span>' in html
    # The item, its evidence as labelled fields, and the decision with its reason.
    article = html[html.index(f'id="item-{item.pk}"') :]
    article = article[: article.index("</article>")]
    assert "outside effect" in article
    assert "<dt>Idempotency-Key sent</dt>" in article
    assert f"rundesk:run-{run.pk}:deliver" in article
    assert "olga" in article and "confirmed: it happened" in article and "D-7" in article
    assert "Found in the receiver&#x27;s log as D-7 &lt;b&gt;not bold&lt;/b&gt;" in article
    decision = item.decisions.get()
    assert decision.evidence_digest in article  # the evidence shown when deciding, whole
    # Every receipt's digest, whole, the delivery's (written by the decision) too.
    receipts = Receipt.objects.filter(run=run)
    assert receipts.filter(step_key="deliver").exists()
    for receipt in receipts:
        assert f"<code>{receipt.result_digest}</code>" in html
    assert "All " in html and "oldest first." in html  # the whole event log, a small run
    assert "left out of this bundle" not in html
    copy = EvidenceCopy.objects.filter(run=run).order_by("id").first()
    assert copy is not None and f'id="copy-{copy.pk}-output"' in html


def test_the_same_run_gives_the_same_bytes(settled, process_env):
    run, _ = settled
    first = report_html(run)
    again = report_html(Run.objects.get(pk=run.pk))
    assert first == again
    # Another process (a Celery worker, the export command), another hash seed.
    script = (
        "import hashlib, sys; from evidence.bundle_report import report_html; "
        "from runs.models import Run; "
        f"sys.stdout.write(hashlib.sha256(report_html(Run.objects.get(pk={run.pk})).encode())"
        ".hexdigest())"
    )
    other = manage("shell", "-c", script, env={**process_env, "PYTHONHASHSEED": "7"})
    out, err = other.communicate(timeout=120)
    assert other.returncode == 0, err
    assert out.strip().splitlines()[-1] == hashlib.sha256(first.encode()).hexdigest()
    figure = json.loads(timeline_json(first))
    assert figure["data"], "the timeline has no trace"
    assert '"uid"' not in timeline_json(first)  # plotly adds no random trace id


def test_the_report_points_nowhere_and_runs_no_model_output(settled):
    run, _ = settled
    html = report_html(run)
    found = parsed(html)
    outside = [
        (tag, name, value)
        for tag, name, value in found.addresses
        if not (value.startswith("#") or value.startswith("data:"))
    ]
    assert outside == []
    assert "tracker.example" not in html and "evil.example" not in html
    # The image is no part of an answer (runs.answers.answer_html); two links lose their address.
    assert "2 addresses of links pointing off this page left out" in html
    # Escaped where it is text, removed where it is rendered markdown.
    assert "&lt;script&gt;window.pwned = &#x27;question&#x27;&lt;/script&gt;" in html
    assert "&lt;img src=x onerror=" in html
    assert "<script>window.pwned" not in html and found.handlers == []
    # Only the page's own scripts may run: plotly.js and the drawing script,
    # both with the nonce the page's policy names; the rest is data.
    policy = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', html)
    assert policy and "default-src 'none'" in policy.group(1)
    nonce = re.search(r"'nonce-([0-9a-f]{32})'", policy.group(1)).group(1)
    running = [s for s in found.scripts if s.get("type") != "application/json"]
    assert len(running) == 2 and all(s == {"nonce": nonce} for s in running)
    assert '<link rel="stylesheet"' not in html


def test_evidence_copies_are_left_out_when_asked(settled):
    run, _ = settled
    copies = list(EvidenceCopy.objects.filter(run=run))
    assert copies, "the run captured no copy of a model call"
    html = report_html(run, include_evidence=False)
    assert 'id="copies-left-out"' in html and f"{len(copies)} cop" in html
    assert "of model calls (inputs and outputs) left out" in html
    assert 'id="copies"' not in html
    assert not any(f'id="copy-{copy.pk}-output"' in html for copy in copies)


def test_the_event_log_shows_the_first_2000_events_and_says_where_the_rest_are():
    run = submit(question="A run with many events", documents=DOCS)
    timeline.flush()
    before = run.events.count()
    assert before >= 1
    with connection.cursor() as cursor:
        cursor.execute(
            """INSERT INTO runs_runevent (run_id, kind, message, data, created_at)
               SELECT %s, 'fault_injected', 'event number ' || n, '{}',
                      now() + interval '1 hour' + n * interval '1 millisecond'
               FROM generate_series(1, %s) AS n""",
            [run.pk, EVENTS_SHOWN + 25],
        )
    total = run.events.count()
    html = report_html(run)
    left_out = total - EVENTS_SHOWN
    assert (
        f"The first {EVENTS_SHOWN} of {total} events, oldest first; {left_out} later events "
        "left out here: events.jsonl in this bundle has them all."
    ) in html
    log = html[html.index('<table class="events">') :]
    assert log.count("<tr><td>") == EVENTS_SHOWN
    assert "submitted" in log  # the oldest, before the inserted ones
    last = EVENTS_SHOWN - before  # the inserted events that fit come after the run's own
    assert f">event number {last}<" in log
    assert f">event number {last + 1}<" not in log


@pytest.fixture
def offline_report(settled, tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "report.html"
    path.write_text(report_html(settled[0]))
    yield path


@pytest.mark.slow
def test_the_report_opens_offline_in_chromium_and_draws_its_timeline(
    browser: Browser, offline_report: Path
):
    url = offline_report.as_uri()
    refused: list[str] = []
    requested: list[str] = []
    problems: list[str] = []

    def only_the_file(route: Route, request: BrowserRequest) -> None:
        if request.url == url:
            route.continue_()
        else:
            refused.append(request.url)
            route.abort()

    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.route("**/*", only_the_file)
    page = context.new_page()
    page.on("request", lambda request: requested.append(request.url))
    page.on("console", lambda m: m.type == "error" and problems.append(m.text))
    page.on("pageerror", lambda error: problems.append(str(error)))
    page.goto(url)
    expect(page.locator("#chart-timeline svg.main-svg").first).to_be_visible()
    expect(page.locator("#chart-timeline .bars path").first).to_be_attached()
    expect(page.locator("#bundle-note")).to_contain_text("verify_bundle")
    expect(page.locator(".answer.draft img")).to_have_count(0)  # no image, fetched or not
    assert page.evaluate("typeof window.pwned") == "undefined"
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / "bundle-report.png", full_page=True)
    context.close()
    assert problems == []
    assert refused == []
    assert requested == [url]

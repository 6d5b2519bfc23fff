"""The run page in an operator's words: evidence as labelled fields, plain
labels for internal names, one row per checkpoint, drafts rendered like the
final answer, a timeline that shows a paused run's actions and its lease
changes, plotly.js only where a chart is drawn, an empty gaps page that
says so, who cancelled a run, 403 and 404 pages in the site's layout, and
the open-item count in every page's navigation."""

from __future__ import annotations

import datetime as dt
import json
import threading
from html.parser import HTMLParser

import pytest
from django.contrib.auth.models import AnonymousUser, User
from django.db import connection
from django.test import RequestFactory
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from dashboard.context import inbox
from evidence import locks, pglog
from evidence.bundle_report import PLOTLY_JS
from evidence.capture import record_gaps
from evidence.models import GapReason, IncidentSource
from runs.decisions import settle_by_evidence
from runs.executor import drive
from runs.leases import Lease
from runs.models import (
    Action,
    ActionState,
    CheckpointOutcome,
    OutcomeKind,
    OutcomeState,
    Phase,
    Run,
    RunEvent,
    RunStatus,
)
from runs.outcomes import Settlement, open_item
from runs.submission import submit
from runs.timeline import EventKind, timeline
from tests.faultruns import DOCS, run_with, wait_for
from tests.test_pglog import THREE_WAY

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("short_settle")]

PLOTLY = f"/static/{PLOTLY_JS}"
# Internal names an operator must not have to read.
INTERNAL = [
    value
    for choices in (RunStatus, Phase, ActionState, CheckpointOutcome, OutcomeKind, EventKind)
    for value in choices.values
    if "_" in value
] + list(GapReason.values)


class _Text(HTMLParser):
    """The text a reader sees: no tags, attributes, scripts or styles."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self.hidden = 0

    def handle_starttag(self, tag: str, attrs: object) -> None:
        self.hidden += tag in ("script", "style")

    def handle_endtag(self, tag: str) -> None:
        self.hidden -= tag in ("script", "style")

    def handle_data(self, data: str) -> None:
        if not self.hidden:
            self.parts.append(data)


def visible(html: str) -> str:
    parser = _Text()
    parser.feed(html)
    return " ".join(" ".join(parser.parts).split())


def section(html: str, start: str, end: str) -> str:
    return html[html.index(start) : html.index(end, html.index(start))]


def chart(html: str, name: str) -> dict:
    data = section(html, f'<script id="{name}-data" type="application/json">', "</script>")
    return json.loads(data.split(">", 1)[1])


@pytest.fixture
def operator_name() -> str:
    return "alice"  # the pages say who cancelled a run


# -- evidence ---------------------------------------------------------------------


def test_item_evidence_is_labelled_fields_never_a_python_dict(viewer):
    run = submit(question="q", documents=["a.md"])
    item = open_item(
        run_id=run.pk,
        kind=OutcomeKind.RECEIPT,
        subject="receipt:labelled",
        summary="a receipt whose COMMIT got no answer",
        evidence={
            "xid": 98765,
            "backend_pid": 4242,
            "backend_start": "2025-01-02T03:04:05.678000+00:00",
            "error": "server closed the connection",
            "checks": [
                {
                    "at": "2025-01-02T03:04:06+00:00",
                    "xid_status": "in progress",
                    "backend_alive": True,
                    "row_found": False,
                },
                {"at": "2025-01-02T03:04:07+00:00", "error": "no answer yet"},
            ],
            "lease_epoch": 3,
            "afterwards": "the run waits for an operator",
            "receiver_note": "<script>alert('x')</script>",
            "extra": {"nested": [1, 2]},
        },
    )
    page = viewer.get(f"/runs/{run.pk}/").content.decode()
    evidence = section(page, f'<details id="item-{item.pk}-evidence"', "</details>")
    # No repr of a dict, escaped or not.
    for repr_ in ("{'", "{&#x27;", "'xid'", "&#x27;xid&#x27;", "True", "False"):
        assert repr_ not in evidence, repr_
    for label, value in [
        ("Transaction id (xid)", "98765"),
        ("Writer&#x27;s backend pid", "4242"),
        ("Writer&#x27;s backend started", "2025-01-02 03:04:05.678"),
        ("What the writer saw", "server closed the connection"),
        ("Lease epoch", "3"),
        ("Afterwards", "the run waits for an operator"),
    ]:
        assert f"<dt>{label}</dt>\n  <dd>{value}</dd>" in evidence, label
    # The checks, as a small table: time, xid status, row found, writer alive.
    checks = section(evidence, '<table class="checks">', "</table>")
    assert (
        "<th>Time</th><th>xid status</th><th>Row found</th><th>Writer alive</th><th>Error</th>"
        in checks
    )
    assert (
        "<td>2025-01-02 03:04:06.000</td><td>in progress</td><td>no</td><td>yes</td><td></td>"
        in checks
    )
    assert "<td>no answer yet</td>" in checks
    # Keys nobody told the page about are still shown, labelled, escaped.
    assert "<dt>Receiver note</dt>" in evidence
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in evidence
    assert "<script>alert" not in page
    assert "<dt>Extra</dt>" in evidence and "<dt>Nested</dt>" in evidence
    # An open item's evidence is shown at once; after settling, what settled it too.
    assert f'<details id="item-{item.pk}-evidence" open>' in page
    decided = settle_by_evidence(item, Settlement("committed", {"xid": 98765}))
    assert decided is not None
    decision = decided.decision
    page = viewer.get(f"/runs/{run.pk}/").content.decode()
    evidence = section(page, f'<details id="item-{item.pk}-evidence"', "</details>")
    assert f"<dt>Settled by decision</dt>\n  <dd>{decision.pk}</dd>" in evidence
    assert "settled" in visible(section(page, f'id="item-{item.pk}"', "</h3>"))
    assert f'<details id="item-{item.pk}-evidence">' in page  # closed once settled


def test_a_lost_delivery_shows_its_identity_and_idempotency_key(viewer, journal):
    run, _ = run_with([{"point": "delivery_timeout"}])
    page = viewer.get(f"/runs/{run.pk}/").content.decode()
    key = run.actions.get(step_key="deliver").idempotency_key
    assert f"<dt>Idempotency-Key sent</dt>\n  <dd>{key}</dd>" in page
    assert f"<dt>Action identity</dt>\n  <dd>rundesk:run-{run.pk}:deliver</dd>" in page
    assert "{&#x27;" not in page and "{'" not in page


# -- plain labels -----------------------------------------------------------------


def test_run_page_and_runs_list_say_states_in_plain_words(viewer, journal):
    run, _ = run_with(
        [
            {"point": "drop_connection_at_commit", "write": "checkpoint", "action": 1},
            {"point": "checkpoint_serialize_error", "action": 3},
            {"point": "delivery_timeout"},
        ]
    )
    assert run.status == RunStatus.NEEDS_OPERATOR
    page = viewer.get(f"/runs/{run.pk}/").content.decode()
    shown = visible(page.replace(section(page, "<h2>Fault plan</h2>", "</pre>"), ""))
    for words in [
        f"Run {run.pk} waits for an operator",
        "failed before write",
        "committed (settled by evidence)",
        "outcome unknown",
        "read document",
        "deliver report",
        "outside effect (irreversible)",
        "lease taken",
        "action dispatched",
        "COMMIT got no answer",
        "left for an operator",
    ]:
        assert words in shown, words
    for name in INTERNAL:
        assert name not in shown, name
    listing = visible(viewer.get("/").content.decode())
    assert "waits for an operator" in listing
    assert "needs_operator" not in listing and "Needs Operator" not in listing


# -- one row per checkpoint -------------------------------------------------------


def test_a_settled_unknown_checkpoint_is_one_row_with_its_history(viewer, journal):
    run, _ = run_with([{"point": "drop_connection_at_commit", "write": "checkpoint", "action": 1}])
    # The database keeps two rows for checkpoint 1: the attempt whose COMMIT
    # got no answer, and the state it saved.
    assert run.checkpoints.filter(number=1).count() == 2
    numbers = set(run.checkpoints.values_list("number", flat=True))
    page = viewer.get(f"/runs/{run.pk}/").content.decode()
    table = section(page, '<table class="checkpoints">', "</table>")
    assert table.count('<tr id="checkpoint-') == len(numbers)
    assert table.count('<tr id="checkpoint-1"') == 1
    first = visible(section(table, '<tr id="checkpoint-1"', "</tr>"))
    assert "committed (settled by evidence)" in first
    assert "COMMIT sent, no answer" in first
    assert "settled: committed: xid" in first
    assert "its saved state is readable" in first
    # The chart too: one marker per checkpoint number.
    figure = chart(page, "chart-timeline")
    markers = [t for t in figure["data"] if t["name"].startswith("checkpoint ")]
    assert sum(len(t["x"]) for t in markers) == len(numbers)


# -- the draft answer -------------------------------------------------------------


def test_the_draft_answer_is_rendered_and_sanitised_like_the_final_one(viewer):
    run = submit(question="q", documents=["a.md"])
    lease = Lease.claim(run.pk, "owner")
    assert lease is not None
    lease.publish_revision(
        1,
        "# Draft so far\n\n<script>alert(1)</script>\n\n"
        '<img src="x" onerror="alert(2)">\n\n| a | b |\n|---|---|\n| 1 | 2 |',
        is_final=False,
    )
    lease.publish_revision(2, "# Final\n\n| a | b |\n|---|---|\n| 3 | 4 |", is_final=True)
    page = viewer.get(f"/runs/{run.pk}/").content.decode()
    draft = section(page, '<div class="answer draft">', "</div>")
    assert "<h1>Draft so far</h1>" in draft and "<table>" in draft and "<td>1</td>" in draft
    assert "# Draft so far" not in page  # not shown as raw markdown
    assert "<script>alert(1)</script>" not in page and "onerror" not in page
    assert '<div class="answer final"><h1>Final</h1>' in page
    assert "Revision 1 (draft)" in page and "Revision 2 (final)" in page


# -- the timeline chart -----------------------------------------------------------


def test_action_bars_stay_visible_across_a_pause_and_lease_changes_are_drawn(viewer):
    """read:0 was in flight when its owner lost the lease; ten minutes later
    another owner resumed the run and dispatched it again."""
    run = submit(question="paused", documents=DOCS)
    first = Lease.claim(run.pk, "first-owner")
    assert first is not None
    read0 = first.record_boundary(
        step_key="read:0", kind="read_document", effect_class="read", input={}
    )
    t0 = timezone.now() - dt.timedelta(minutes=11)
    later = t0 + dt.timedelta(minutes=10)

    def event(kind: EventKind, at: dt.datetime, action: int | None = None, **data: object) -> None:
        RunEvent.objects.create(run=run, kind=kind, action_id=action, created_at=at, data=data)

    event(EventKind.LEASE_ACQUIRED, t0, epoch=1)
    event(EventKind.ACTION_DISPATCHED, t0 + dt.timedelta(milliseconds=10), read0)
    event(EventKind.LEASE_LOST, t0 + dt.timedelta(milliseconds=60))
    event(EventKind.RUN_REQUEUED, t0 + dt.timedelta(seconds=20))
    event(EventKind.LEASE_ACQUIRED, later, epoch=2)
    event(EventKind.RESUMED, later + dt.timedelta(milliseconds=2))
    event(EventKind.ACTION_REDISPATCHED, later + dt.timedelta(milliseconds=5), read0)
    event(EventKind.ACTION_COMPLETED, later + dt.timedelta(milliseconds=9), read0)
    Action.objects.filter(pk=read0).update(
        state=ActionState.COMPLETED,
        attempts=2,
        dispatched_at=later + dt.timedelta(milliseconds=5),
        finished_at=later + dt.timedelta(milliseconds=9),
    )

    figure = chart(viewer.get(f"/runs/{run.pk}/").content.decode(), "chart-timeline")
    bars = {t["name"]: t for t in figure["data"] if t["type"] == "bar"}
    cut = bars["attempt cut short: lease lost or given back"]
    done = bars["action completed"]
    assert cut["y"] == ["read:0"] and done["y"] == ["read:0"]
    # Their hovers say when, in real clock times.
    clock = timezone.localtime(t0 + dt.timedelta(milliseconds=10)).strftime("%H:%M:%S.%f")[:-3]
    assert f"dispatched at {clock}" in cut["customdata"][0][5]
    clock = timezone.localtime(later + dt.timedelta(milliseconds=5)).strftime("%H:%M:%S.%f")[:-3]
    assert f"dispatched at {clock}" in done["customdata"][0][5]
    # A 50 ms and a 4 ms attempt around ten minutes nobody ran it: the ten
    # minutes are cut, and both bars are wide enough to see.
    ends = [base + x for bar in bars.values() for base, x in zip(bar["base"], bar["x"])]
    width = max(ends) - min(base for bar in bars.values() for base in bar["base"])
    for bar in (cut, done):
        assert bar["x"][0] >= width / 300
    assert cut["customdata"][0][4] == "50 ms" and done["customdata"][0][4] == "4 ms"
    labels = [a["text"] for a in figure["layout"]["annotations"]]
    assert "nobody ran it for 10 min: lease lost, until epoch 2 took it" in labels
    # Cut where nothing was drawn: up to the run back in the queue, and after.
    assert "… 20 s …" in labels and "… 9 min 40 s …" in labels
    for label in ["lease taken, epoch 1", "lease lost", "back in the queue"]:
        assert label in labels, label
    assert "lease taken, epoch 2" in labels and "resumed" in labels
    assert len(figure["layout"]["shapes"]) >= 5  # a vertical line for each


def test_a_stale_owners_attempt_and_the_new_owners_are_both_drawn(viewer, journal):
    run = submit(
        question="q", documents=DOCS, faults=[{"point": "tool_delay", "action": 2, "ms": 1500}]
    )
    stale = Lease.claim(run.pk, "old-owner")
    assert stale is not None
    out: list[str] = []

    def work() -> None:
        try:
            out.append(drive(stale, threading.Event()))
        finally:
            connection.close()

    thread = threading.Thread(target=work)
    thread.start()
    wait_for(lambda: Action.objects.filter(run=run, step_key="summarize:0").exists())
    Run.objects.filter(pk=run.pk).update(
        lease_expires_at=timezone.now() - dt.timedelta(seconds=1), faults=[]
    )
    new = Lease.claim(run.pk, "new-owner")
    assert new is not None
    thread.join()
    assert out == ["lease_lost"]
    assert drive(new, threading.Event()) == RunStatus.COMPLETED
    timeline.flush()

    figure = chart(viewer.get(f"/runs/{run.pk}/").content.decode(), "chart-timeline")
    bars = {t["name"]: t for t in figure["data"] if t["type"] == "bar"}
    assert "summarize:0" in bars["attempt cut short: lease lost or given back"]["y"]
    assert "summarize:0" in bars["action completed"]["y"]
    assert all(width > 0 for bar in bars.values() for width in bar["x"])
    labels = [a["text"] for a in figure["layout"]["annotations"]]
    assert "lease lost" in labels and "lease taken, epoch 2" in labels


# -- plotly only where a chart is ---------------------------------------------------


def test_plotly_is_loaded_only_on_pages_with_a_chart(viewer, journal):
    run, _ = run_with([])
    (report,) = pglog.parse(THREE_WAY)
    incident = locks.store(IncidentSource.LOG, report.graph, summary="imported")

    def loads_plotly(url: str) -> bool:
        return f'<script src="{PLOTLY}" defer></script>' in viewer.get(url).content.decode()

    assert loads_plotly(f"/runs/{run.pk}/") and loads_plotly(f"/locks/{incident.pk}/")
    assert not loads_plotly("/") and not loads_plotly("/locks/")
    assert not loads_plotly("/gaps/")  # no gap: no chart
    assert not loads_plotly("/runs/987654/")
    record_gaps({(run.pk, None, GapReason.QUEUE_FULL.value, "capacity 5"): 2})
    assert loads_plotly("/gaps/")


def test_gaps_page_without_gaps_says_so_instead_of_an_empty_chart(viewer):
    page = viewer.get("/gaps/").content.decode()
    assert "No capture gaps: every evidence record was saved" in page
    assert 'id="chart-gaps' not in page and "<table" not in page


# -- cancelled, by whom -----------------------------------------------------------


def test_a_cancelled_run_says_who_cancelled_it(viewer, operator, journal):
    queued = submit(question="to cancel", documents=["a.md"])
    cancel = {"reason": "wrong question", "confirm": "on"}
    assert operator.post(f"/runs/{queued.pk}/cancel/", cancel).status_code == 302
    page = viewer.get(f"/runs/{queued.pk}/").content.decode()
    assert '<span class="status cancelled" id="run-status">cancelled by alice</span>' in page
    assert "by alice (wrong question); the run ended by it at" in visible(page)
    row = section(viewer.get("/").content.decode(), f'<a href="/runs/{queued.pk}/">', "</tr>")
    assert "cancelled by alice" in row
    # A running run cancelled mid-way names who asked once its owner stops.
    running, _ = run_with([{"point": "cancel", "action": 3}])
    assert running.status == RunStatus.CANCELLED
    page = viewer.get(f"/runs/{running.pk}/").content.decode()
    assert "cancelled by the fault plan" in page


# -- 403 and 404 ------------------------------------------------------------------


def test_a_viewer_posting_an_operator_action_gets_a_403_page_that_says_why(settings, viewer):
    settings.DEBUG = False
    queued = submit(question="to cancel", documents=["a.md"])
    response = viewer.post(f"/runs/{queued.pk}/cancel/")
    assert response.status_code == 403
    page = response.content.decode()
    assert '<a class="brand" href="/">Rundesk</a>' in page and 'href="/inbox/"' in page
    assert "<h1>Not allowed</h1>" in page
    assert "This needs the operator permission" in page and "viewer" in visible(page)
    assert "Nothing was changed" in page
    assert response["Content-Security-Policy"].startswith("default-src 'self'")
    queued.refresh_from_db()
    assert queued.status == RunStatus.QUEUED


def test_404_pages_are_in_the_site_layout(settings, viewer, client):
    settings.DEBUG = False
    for url in ["/runs/987654/", "/locks/987654/", "/no-such-page/"]:
        response = viewer.get(url)
        assert response.status_code == 404, url
        page = response.content.decode()
        assert '<a class="brand" href="/">Rundesk</a>' in page and "<h1>Not found</h1>" in page
        assert f"<code>{url}</code>" in page and 'href="/inbox/"' in page
    hostile = viewer.get("/<script>x</script>/").content.decode()
    assert "<script>x</script>" not in hostile
    # Signed out: the layout without the navigation.
    anonymous = client.get("/no-such-page/")
    assert anonymous.status_code == 404
    assert "<h1>Not found</h1>" in anonymous.content.decode()
    assert 'href="/inbox/"' not in anonymous.content.decode()


# -- the inbox badge --------------------------------------------------------------


def test_every_page_shows_the_open_item_count_linking_to_the_inbox(viewer, journal):
    run, _ = run_with([{"point": "delivery_timeout"}])
    for n in range(2):
        open_item(
            run_id=run.pk,
            kind=OutcomeKind.RECEIPT,
            subject=f"receipt:badge-{n}",
            summary="waiting",
            evidence={},
        )
    settled = open_item(
        run_id=run.pk, kind=OutcomeKind.RECEIPT, subject="receipt:done", summary="s", evidence={}
    )
    assert settle_by_evidence(settled, Settlement("committed", {})) is not None
    assert run.outcome_items.filter(state=OutcomeState.OPEN).count() == 3
    (report,) = pglog.parse(THREE_WAY)
    incident = locks.store(IncidentSource.LOG, report.graph, summary="imported")
    for url in ["/", f"/runs/{run.pk}/", "/locks/", f"/locks/{incident.pk}/", "/gaps/"]:
        page = viewer.get(url).content.decode()
        badge = section(page, '<a href="/inbox/"', "</a>")
        assert visible(badge + "</a>") == "Inbox 3", url
        assert 'class="badge waiting" title="3 open outcome items"' in badge


def test_the_badge_costs_one_query_and_none_on_htmx_fragments(viewer, journal):
    run, _ = run_with([{"point": "delivery_timeout"}])
    request = RequestFactory().get("/")
    request.user = User.objects.get(username="viewer")
    with CaptureQueriesContext(connection) as queries:
        counted = inbox(request)["inbox_open"]
        assert counted() == 1 and counted() == 1
    # One query (in a savepoint of its own: a lock on the items costs the
    # page its badge, not the page).
    control = ("BEGIN", "COMMIT", "SAVEPOINT", "RELEASE")
    asked = [q["sql"] for q in queries if not q["sql"].startswith(control)]
    assert len(asked) == 1
    assert "outcomeitem" in asked[0] and "COUNT(*)" in asked[0]

    def counts(response_of) -> int:
        with CaptureQueriesContext(connection) as queries:
            response_of()
        return sum('COUNT(*) AS "__count" FROM "runs_outcomeitem"' in q["sql"] for q in queries)

    assert counts(lambda: viewer.get("/")) == 1
    assert (
        counts(lambda: viewer.get("/", headers={"HX-Request": "true", "HX-Target": "run-rows"}))
        == 0
    )
    headers = {"HX-Request": "true"}
    assert counts(lambda: viewer.get(f"/runs/{run.pk}/live/", headers=headers)) == 0
    anonymous = RequestFactory().get("/")
    anonymous.user = AnonymousUser()
    assert inbox(anonymous) == {}

"""The run timeline as a tired operator reads it at 3 a.m. (issue 36,
point 2): a wait for an operator is a labelled span that says how long and
what ended it; a long wait is cut so the actions stay wide; an action is
drawn in its state now, its history in its hover; each kind of marker has
a symbol and colour of its own; the legend is always there, clear of the
time axis; a run nobody took draws no chart at all; a refused read is not
drawn as a success.  Each from a real run, its figure as the run page
builds it (evidence.run_facts)."""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from evidence import charts
from evidence.run_facts import run_facts
from runs.decisions import Request, Who, decide
from runs.executor import claim_and_drive
from runs.models import (
    DecisionChoice,
    OutcomeItem,
    OutcomeKind,
    Run,
    RunEvent,
    RunStatus,
)
from runs.submission import submit
from runs.timeline import EventKind, timeline
from tests.faultruns import KEYS, run_with
from tests.receivers import LocalServer, status

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("short_settle")]

WAITING = "waiting for an operator"
COMPLETED = "action completed"
UNKNOWN = "action outcome unknown"


@pytest.fixture
def operator_name() -> str:
    return "olga"


@pytest.fixture
def waiting(settings, journal) -> Any:
    """A run whose delivery reached a real receiver but whose answer was
    lost: it waits for an operator, its delivery's outcome unknown."""
    with LocalServer(status(200)) as receiver:
        settings.RUNDESK_DELIVERY_URL = receiver.url
        run, outcome = run_with([{"point": "delivery_timeout"}])
        assert outcome == RunStatus.NEEDS_OPERATOR
        yield run, OutcomeItem.objects.get(run=run, kind=OutcomeKind.EFFECT)


def confirm(item: OutcomeItem, user: User) -> None:
    decide(
        item.pk,
        Request(
            choice=DecisionChoice.CONFIRMED_HAPPENED,
            who=Who(user=user),
            token=uuid.uuid4().hex,
            reason="delivery D-9 is in the receiver's log",
            reference="D-9",
        ),
    )
    timeline.flush()


def figure_of(run: Run) -> dict[str, Any] | None:
    return run_facts(Run.objects.get(pk=run.pk))["timeline"]


def traces(figure: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {trace["name"]: trace for trace in figure["data"]}


def labels(figure: dict[str, Any]) -> list[str]:
    return [a["text"] for a in figure["layout"].get("annotations", [])]


def ends(figure: dict[str, Any]) -> list[float]:
    """Where each bar and marker of the figure is on its time axis."""
    xs = []
    for trace in figure["data"]:
        if trace["type"] == "bar":
            xs += [b + x for b, x in zip(trace["base"], trace["x"], strict=True)] + trace["base"]
        else:
            xs += trace["x"]
    return xs


def plotted(figure: dict[str, Any]) -> float:
    """How wide the figure's data is on its time axis (plotly's autorange)."""
    return max(ends(figure)) - min(ends(figure))


def waited_since(run: Run) -> dt.datetime:
    return RunEvent.objects.get(run=run, kind=EventKind.NEEDS_OPERATOR).created_at


def test_a_wait_ended_by_a_decision_is_a_span_that_says_how_long_and_by_whom(
    waiting, operator_user
):
    run, item = waiting
    confirm(item, operator_user)
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    timeline.flush()
    requeued = RunEvent.objects.get(run=run, kind=EventKind.RUN_REQUEUED).created_at
    waited = charts.human_duration((requeued - waited_since(run)).total_seconds())

    figure = figure_of(run)
    wait = traces(figure)[WAITING]
    assert wait["type"] == "bar" and wait["y"] == [charts.IDLE_LANE]
    assert wait["x"][0] > 0  # from the wait to the run back in the queue
    said = f"{WAITING}: {waited}, ended by the decision of olga (confirmed: it happened)"
    assert wait["customdata"][0][0] == said
    assert said in labels(figure)  # written on the chart, not only in a hover
    # The waits' lane is the chart's top lane.
    assert figure["layout"]["yaxis"]["categoryarray"][-1] == charts.IDLE_LANE


def test_a_wait_still_open_says_since_when_and_is_drawn_the_same_whenever_read(waiting):
    run, _ = waiting
    since = timezone.localtime(waited_since(run)).strftime("%H:%M:%S")
    figure = figure_of(run)
    said = f"{WAITING} since {since}, still waiting"
    assert said in labels(figure)
    wait = traces(figure)[WAITING]
    assert wait["customdata"][0][0] == said and wait["customdata"][0][2] == "now"
    # Open: it runs on past everything else drawn, a fixed share of the width.
    assert wait["base"][0] + wait["x"][0] == pytest.approx(max(ends(figure)))
    assert wait["x"][0] >= 0.1 * plotted(figure)
    # Nothing in it depends on the clock: a bundle exported later is the same.
    assert json.dumps(figure_of(run)) == json.dumps(figure)


def test_a_long_wait_is_cut_and_the_actions_stay_wide(waiting, operator_user):
    run, item = waiting
    # The operator takes a while (the actions took some 60 ms): without
    # the cut, every action would be a sliver beside the wait.
    time.sleep(2)
    confirm(item, operator_user)
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    timeline.flush()

    figure = figure_of(run)
    cuts = [text for text in labels(figure) if text.startswith("… ") and text.endswith(" …")]
    assert len(cuts) == 1 and cuts[0][2:-2].endswith(" s")  # how much was left out
    width = plotted(figure)
    assert traces(figure)[WAITING]["x"][0] <= 0.2 * width
    bars = [t for t in figure["data"] if t["type"] == "bar" and t["name"] != WAITING]
    starts = [b for t in bars for b in t["base"]]
    done = [b + x for t in bars for b, x in zip(t["base"], t["x"], strict=True)]
    assert max(done) - min(starts) >= 0.6 * width
    # The time axis says real clock times, none inside the cut.
    ticks = figure["layout"]["xaxis"]["ticktext"]
    assert ticks and all(len(tick.split(":")) == 3 for tick in ticks)
    assert figure["layout"]["xaxis"]["title"]["text"].endswith(", UTC")


def test_a_delivery_confirmed_by_an_operator_is_drawn_completed_with_its_history(
    waiting, operator_user
):
    run, item = waiting
    before = traces(figure_of(run))
    assert before[UNKNOWN]["y"] == ["deliver"]  # as it stood while it waited

    confirm(item, operator_user)
    after = traces(figure_of(run))
    assert UNKNOWN not in after
    done = after[COMPLETED]
    history = done["customdata"][done["y"].index("deliver")][5]
    assert "action outcome unknown at " in history
    assert "confirmed: it happened, by olga at " in history
    assert "(reference D-9)" in history
    assert history.index("outcome unknown") < history.index("confirmed: it happened")
    assert "now: action completed" in history


def test_each_kind_of_marker_has_its_own_symbol_and_colour(journal):
    run, _ = run_with([{"point": "drop_connection_at_commit", "write": "checkpoint", "action": 1}])
    figure = figure_of(run)
    committed = traces(figure)["checkpoint committed"]
    settled = traces(figure)["checkpoint committed (settled by evidence)"]
    assert committed["marker"]["symbol"] != settled["marker"]["symbol"]
    assert committed["marker"]["color"] != settled["marker"]["color"]
    markers = [
        (t["marker"]["symbol"], t["marker"]["color"])
        for t in figure["data"]
        if t["type"] == "scatter"
    ]
    assert len(markers) == len(set(markers))
    assert len(markers) == len({symbol for symbol, _ in markers})


def test_the_legend_is_shown_for_a_single_trace_and_clear_of_the_time_axis(settings, journal):
    settings.RUNDESK_CHECKPOINT_EVERY = 1000  # no checkpoint: every bar one colour
    run, outcome = run_with([], documents=["northwind-clean-energy.md"])
    assert outcome == RunStatus.COMPLETED
    figure = figure_of(run)
    assert [t["name"] for t in figure["data"]] == [COMPLETED]
    assert figure["layout"]["showlegend"] is True
    legend = figure["layout"]["legend"]
    # Right of the plot (x in the plot's own fraction): the time axis, its
    # ticks and its date stay uncovered.
    assert legend["x"] >= 1 and legend["xanchor"] == "left"


def test_a_queued_run_draws_no_chart_and_says_so(viewer):
    run = submit(question="Compare the funds", documents=["northwind-clean-energy.md"])
    assert figure_of(run) is None
    page = viewer.get(f"/runs/{run.pk}/").content.decode()
    assert "chart-timeline" not in page
    assert 'id="timeline-empty"' in page and "Nothing to draw yet" in page


def test_a_refused_read_is_drawn_refused_not_completed(settings, tmp_path, journal):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "fund.md").write_text("# Fund\n\n- Expense ratio: 0.10%\n")
    (corpus / "scan.bin").write_bytes(bytes(range(256)) * 4)
    settings.RUNDESK_CORPUS_DIR = corpus
    run, outcome = run_with([], documents=["fund.md", "scan.bin"])
    assert outcome == RunStatus.COMPLETED
    assert "refused" in run.receipts.get(step_key=KEYS[2]).result

    by_name = traces(figure_of(run))
    refused = by_name["read refused: a definite answer, nothing read"]
    assert refused["y"] == [KEYS[2]]
    assert KEYS[2] not in by_name[COMPLETED]["y"]
    assert refused["marker"]["color"] != by_name[COMPLETED]["marker"]["color"]

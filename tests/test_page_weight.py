"""Page weight: the pages and the bundle report load a partial plotly.js
bundle (static/vendor/, `make plotly`) that holds every trace type the
charts draw, of the plotly.js version the plotly package builds figures for,
and a bundle's report.html stays small."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import plotly.graph_objects as go
import pytest
from django.contrib.staticfiles import finders
from django.templatetags.static import static
from plotly.basedatatypes import BaseTraceType
from plotly.offline import get_plotlyjs

from evidence import charts, locks, pglog
from evidence.bundle_report import PLOTLY_JS, report_html
from evidence.models import IncidentSource
from runs.executor import claim_and_drive
from runs.models import Run
from runs.submission import submit
from runs.timeline import timeline
from tests.test_pglog import THREE_WAY

pytestmark = pytest.mark.django_db(transaction=True)

MAX_BUNDLE_BYTES = 1_200_000
MAX_REPORT_BYTES = 1_500_000
# How a plotly.js bundle registers a trace type (src/registry.js, minified).
REGISTERED_TRACE = re.compile(r'moduleType:"trace",name:"(\w+)"')
VERSION = re.compile(r"plotly\.js (?:\([^)]*\) )?v(\d+\.\d+)\.\d+")


def vendored() -> str:
    found = finders.find(PLOTLY_JS)
    assert found, f"{PLOTLY_JS} is not among the static files"
    return Path(found).read_text()


def registered_traces() -> set[str]:
    return set(REGISTERED_TRACE.findall(vendored()))


@pytest.fixture
def run() -> Run:
    run = submit(question="Compare the funds", documents=["northwind-clean-energy.md"])
    claim_and_drive(run.pk)
    timeline.flush()
    return run


def test_the_marker_finds_every_trace_type_of_the_whole_plotly_js():
    # The marker the tests below rely on, checked against plotly.js whole:
    # if a plotly.js release minified registrations otherwise, this fails
    # rather than the bundle test passing on nothing.
    assert {"scatter", "bar", "pie", "heatmap", "scattergl"} <= set(
        REGISTERED_TRACE.findall(get_plotlyjs())
    )


def test_the_vendored_bundle_is_small_and_of_the_plotly_js_the_figures_are_built_for():
    text = vendored()
    assert len(text.encode()) <= MAX_BUNDLE_BYTES
    (ours,) = set(VERSION.findall(text[:500]))
    (theirs,) = set(VERSION.findall(get_plotlyjs()[:500]))
    assert ours == theirs  # major.minor of the plotly package's own plotly.js


def test_the_bundle_holds_every_trace_type_of_the_charts_real_figures(run):
    (report,) = pglog.parse(THREE_WAY)
    incident = locks.store(IncidentSource.LOG, report.graph, summary="imported")
    figures = [
        charts.timeline(run, list(run.actions.order_by("id")), []),
        charts.lock_graph(incident),
        charts.gaps_over_time([("2026-01-01T00:00:00+00:00", "lock_not_available", 3)]),
    ]
    drawn = {trace.get("type", "scatter") for figure in figures for trace in figure["data"]}
    assert drawn and drawn <= registered_traces()


def test_the_bundle_holds_every_trace_type_charts_py_names():
    # Any trace a chart may add (a branch the figures above did not take):
    # each go.<Trace> that evidence/charts.py names.
    tree = ast.parse(Path(charts.__file__).read_text())
    named = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "go"
    }
    traces = {
        getattr(go, name)().plotly_name
        for name in named
        if isinstance(getattr(go, name), type) and issubclass(getattr(go, name), BaseTraceType)
    }
    assert {"scatter", "bar"} <= traces
    assert traces <= registered_traces()


def test_chart_pages_load_the_vendored_bundle_and_it_is_served(viewer, run):
    (report,) = pglog.parse(THREE_WAY)
    incident = locks.store(IncidentSource.LOG, report.graph, summary="imported")
    src = static(PLOTLY_JS)
    for url in (f"/runs/{run.pk}/", f"/locks/{incident.pk}/"):
        page = viewer.get(url).content.decode()
        assert f'<script src="{src}" defer>' in page, url
        assert "plotly.min.js" not in page, url
    served = viewer.get(src)
    assert served.status_code == 200
    assert b"".join(served.streaming_content) == vendored().encode()


def test_the_bundle_report_inlines_the_vendored_bundle_and_stays_small(run):
    html = report_html(run)
    assert len(html.encode()) <= MAX_REPORT_BYTES
    assert vendored()[:2000] in html

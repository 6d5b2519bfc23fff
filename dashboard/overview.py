"""The overview (/overview/): the whole fleet at a glance, beside "Needs
you".  What happened over time is read from the summaries the roll-up
keeps (runs/summaries.py), what is true now from partial indexes
(runs/fleet.py): no figure scans the runs or their events, so the page
costs the same at a thousand runs or a million.  Every figure links to the
list behind it; the figures refresh themselves (htmx, every few seconds)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from django.http import HttpResponse
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone
from django.utils.http import urlencode
from django.views.decorators.http import require_safe

from dashboard import params
from dashboard.htmx import HtmxHttpRequest, asks_for
from dashboard.security import rejects_bad_input
from evidence.charts import LAYOUT
from evidence.models import GapReason, IncidentSource
from runs import fleet, summaries
from runs.models import AlertChannel, OutcomeKind, RunStatus, SummaryGrain, SummaryMeasure
from runs.words import plain

# Each measure's colour and name in the runs-over-time figure.
SERIES = {
    SummaryMeasure.SUBMITTED: ("#3b7dd8", "submitted"),
    SummaryMeasure.COMPLETED: ("#2e9d4e", "completed"),
    SummaryMeasure.FAILED: ("#d9473b", "failed"),
    SummaryMeasure.CANCELLED: ("#9aa5b1", "cancelled"),
}


def runs_list(**query: str) -> str:
    """The runs list's URL, filtered by `query`."""
    return reverse("runs-list") + "?" + urlencode(query)


def _iso(moment: dt.datetime) -> str:
    """A minute in UTC, as the runs list's from and to read it."""
    return moment.astimezone(dt.UTC).isoformat()[:16]


def runs_over_time(window: summaries.Window, now: dt.datetime) -> dict[str, Any] | None:
    """Runs submitted (a line) and ended (stacked bars, by how) per bucket;
    each point's customdata is the runs list of that bucket and measure."""
    rows = summaries.over_time(window, now)
    if not rows:
        return None
    step = dt.timedelta(minutes=1) if window.grain == SummaryGrain.MINUTE else dt.timedelta(hours=1)
    # A link per point (hundreds over a week): written out, not urlencoded
    # one by one; the values need no escaping (statuses, ISO times).
    base = reverse("runs-list")
    by_measure: dict[str, tuple[list[str], list[int], list[str]]] = {}
    for bucket, measure, count in rows:
        xs, ys, links = by_measure.setdefault(measure, ([], [], []))
        xs.append(bucket.isoformat())
        ys.append(count)
        span = f"from={_iso(bucket)}&to={_iso(bucket + step)}"
        if measure == SummaryMeasure.SUBMITTED:
            links.append(f"{base}?time=created&{span}")
        else:
            links.append(f"{base}?time=finished&status={measure}&{span}")
    # The figure as plotly.js reads it, written out: plotly.py's checked
    # Figure costs more than the rest of the page at a week's buckets.
    traces = []
    for measure, (colour, name) in SERIES.items():
        if measure not in by_measure:
            continue
        xs, ys, links = by_measure[measure]
        trace = {"name": name, "x": xs, "y": ys, "customdata": links, "marker": {"color": colour}}
        if measure == SummaryMeasure.SUBMITTED:
            trace |= {"type": "scatter", "mode": "lines+markers"}
        else:
            # A bucket's width (ms on a date axis): plotly's own, from the
            # spacing of the bars, is nothing for a lone one.
            trace |= {"type": "bar", "width": step.total_seconds() * 1000 * 0.9}
        traces.append(trace)
    return {
        "data": traces,
        "layout": {
            **LAYOUT,
            "margin": {"l": 50, "r": 20, "t": 10, "b": 40},
            "height": 300,
            "barmode": "stack",
            # The whole window, however few of its buckets have runs.
            "xaxis": {
                "type": "date",
                "range": [summaries.start_of(window, now).isoformat(), now.isoformat()],
            },
            "yaxis": {"title": {"text": "runs"}},
            "legend": {"orientation": "h"},
        },
    }


@dataclass(frozen=True)
class AgentFigures:
    agent: str
    run: summaries.Latency | None
    step: summaries.Latency | None
    runs_per_minute: float
    steps_per_minute: float
    link: str


def per_agent(window: summaries.Window, now: dt.datetime) -> list[AgentFigures]:
    start = summaries.start_of(window, now, window.totals_grain)
    minutes = (now - start).total_seconds() / 60
    found = []
    for agent, latencies in sorted(summaries.latencies(window, now).items()):
        run, step = latencies.get("run"), latencies.get("step")
        found.append(
            AgentFigures(
                agent,
                run,
                step,
                round((run.count if run else 0) / minutes, 2),
                round((step.count if step else 0) / minutes, 2),
                runs_list(agent=agent, time="finished", **{"from": _iso(start)}),
            )
        )
    return found


def figures(window: summaries.Window, now: dt.datetime) -> dict[str, Any]:
    """Everything the overview shows, for `window` at `now`."""
    since = now - window.span
    gaps = fleet.gaps_by_reason(since)
    hours = window.span.total_seconds() / 3600
    return {
        "now": now,
        "window": window,
        "windows": summaries.WINDOWS,
        "rolled_up_to": summaries.rolled_up_to(),
        "over_time": runs_over_time(window, now),
        "agents": per_agent(window, now),
        "in_state": [
            (plain(RunStatus, status), n, runs_list(status=status))
            for status, n in fleet.in_state().items()
        ],
        "waiting": [
            (words, line, link)
            for line in fleet.waiting(now)
            for words, link in [_waiting_words(line.reason)]
        ],
        "ages": [words for words, _ in fleet.AGES],
        "items": [(plain(OutcomeKind, line.kind), line) for line in fleet.open_items(now)],
        "gaps": [(plain(GapReason, reason), n, round(n / hours, 2)) for reason, n in gaps.items()],
        "locks": [
            (
                plain(IncidentSource, source),
                n,
                reverse("locks") + "?" + urlencode({"source": source}),
            )
            for source, n in fleet.lock_incidents(since).items()
        ],
        "alerts": [(plain(AlertChannel, c), n) for c, n in fleet.alerts_failing().items()],
        "owners": fleet.owners(now),
        "running_link": runs_list(status=RunStatus.RUNNING),
        "plotly": True,
    }


@require_safe
@rejects_bad_input
def overview(request: HtmxHttpRequest) -> HttpResponse:
    window = summaries.WINDOWS[params.choice(request, "window", list(summaries.WINDOWS)) or "hour"]
    context = figures(window, timezone.now())
    if asks_for(request, "overview-figures"):
        return render(request, "overview.html#figures", context)
    return render(request, "overview.html", context)


def _waiting_words(reason: str) -> tuple[str, str]:
    """What holds waiting runs, said, and where it is acted on."""
    if reason == fleet.HOLD:
        return "a tool hold", reverse("holds")
    if reason:
        return plain(OutcomeKind, reason), reverse("inbox") + "?" + urlencode({"kind": reason})
    return "no item holds it", runs_list(status=RunStatus.NEEDS_OPERATOR)

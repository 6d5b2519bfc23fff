"""The dashboard's plotly figures, built on the server as JSON.

The page carries a figure in a `<script type="application/json">` element
and static/js/rundesk.js draws it: no inline script, so the page's
Content-Security-Policy allows no script but the site's own files.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import plotly.graph_objects as go
from django.utils import timezone

from evidence.models import CaptureGap, LockIncident
from runs.models import Run

STATE_COLOURS = {
    "completed": "#2e9d4e",
    "dispatched": "#3b7dd8",
    "failed": "#d9473b",
    "unknown": "#e0a21b",
}
OUTCOME_COLOURS = {
    "committed": "#2e9d4e",
    "resolved_committed": "#2e9d4e",
    "failed_before_write": "#d9473b",
    "resolved_not_written": "#d9473b",
    "unknown": "#e0a21b",
}
LAYOUT = {
    "margin": {"l": 110, "r": 20, "t": 10, "b": 40},
    "plot_bgcolor": "#fff",
    "paper_bgcolor": "#fff",
    "font": {"size": 12},
    "hoverlabel": {"align": "left"},
}


def timeline(run: Run) -> str:
    """Actions as bars from boundary to outcome, coloured by state;
    checkpoints and capture gaps on lanes of their own; answer revisions and
    phase changes as vertical lines."""
    now = timezone.now()
    figure = go.Figure()
    actions = list(run.actions.select_related("receipt").order_by("id"))
    for state, colour in STATE_COLOURS.items():
        bars = [a for a in actions if a.state == state]
        if not bars:
            continue
        figure.add_trace(
            go.Bar(
                name=f"action {state}",
                orientation="h",
                y=[a.step_key for a in bars],
                base=[a.dispatched_at.isoformat() for a in bars],
                x=[_ms((a.finished_at or now) - a.dispatched_at) for a in bars],
                marker={"color": colour},
                customdata=[
                    [a.epoch, a.input_digest[:12], (a.error or "")[:200], a.attempts] for a in bars
                ],
                hovertemplate=(
                    "%{y}<br>epoch %{customdata[0]}, attempt %{customdata[3]}"
                    "<br>input %{customdata[1]}…<br>%{customdata[2]}<extra>" + state + "</extra>"
                ),
            )
        )
    checkpoints = list(run.checkpoints.order_by("id"))
    for outcome, colour in OUTCOME_COLOURS.items():
        points = [c for c in checkpoints if c.outcome == outcome]
        if points:
            figure.add_trace(
                go.Scatter(
                    name=f"checkpoint {outcome}",
                    mode="markers",
                    x=[c.created_at.isoformat() for c in points],
                    y=["checkpoints"] * len(points),
                    marker={"color": colour, "size": 11, "symbol": "diamond"},
                    customdata=[
                        [c.number, c.xid or "", (c.error or c.resolution)[:200]] for c in points
                    ],
                    hovertemplate=(
                        "checkpoint %{customdata[0]}<br>xid %{customdata[1]}<br>%{customdata[2]}"
                        "<extra>" + outcome + "</extra>"
                    ),
                )
            )
    gaps = list(CaptureGap.objects.filter(run=run).order_by("id"))
    if gaps:
        figure.add_trace(
            go.Scatter(
                name="capture gap",
                mode="markers",
                x=[g.created_at.isoformat() for g in gaps],
                y=["capture gaps"] * len(gaps),
                marker={"color": "#8a5cd1", "size": 10, "symbol": "x"},
                customdata=[[g.reason, g.detail[:200]] for g in gaps],
                hovertemplate="%{customdata[0]}<br>%{customdata[1]}<extra>gap</extra>",
            )
        )
    for revision in run.revisions.order_by("number"):
        _vertical(figure, revision.committed_at.isoformat(), f"rev {revision.number}", "#2e9d4e")
    for event in run.events.filter(kind="phase_changed").order_by("id"):
        _vertical(figure, event.created_at.isoformat(), "finalizing", "#e0a21b")
    lanes = [a.step_key for a in actions] + ["checkpoints", "capture gaps"]
    figure.update_layout(
        **LAYOUT,
        height=max(220, 26 * len(lanes) + 80),
        barmode="overlay",
        xaxis={"type": "date", "title": None},
        yaxis={
            "categoryorder": "array",
            "categoryarray": list(reversed(lanes)),
            "automargin": True,
        },
        legend={"orientation": "h", "y": -0.15},
        # The run page redraws this chart as the run goes on: the reader's
        # zoom and pan stay.
        uirevision=f"run-{run.pk}",
    )
    return figure.to_json()


def lock_graph(incident: LockIncident) -> str:
    """The waits-for graph: processes on a circle, an arrow from each waiter
    to its blocker, labelled with the lock; the cycle's arrows in red."""
    waits = list(incident.waits.all())
    labels: dict[int, str] = {}
    for wait in waits:
        labels.setdefault(
            wait.waiter_pid, _node_label(wait.waiter_role, wait.waiter_pid, wait.waiter_run_id)
        )
        labels.setdefault(
            wait.blocker_pid, _node_label(wait.blocker_role, wait.blocker_pid, wait.blocker_run_id)
        )
    pids = sorted(labels)
    place = {
        pid: (math.cos(2 * math.pi * i / len(pids)), math.sin(2 * math.pi * i / len(pids)))
        for i, pid in enumerate(pids)
    }
    cycle = list(incident.cycle or [])
    cycle_edges = set(zip(cycle, cycle[1:] + cycle[:1], strict=True)) if cycle else set()
    figure = go.Figure()
    for wait in waits:
        (x0, y0), (x1, y1) = place[wait.waiter_pid], place[wait.blocker_pid]
        in_cycle = (wait.waiter_pid, wait.blocker_pid) in cycle_edges
        figure.add_annotation(
            x=x1 * 0.85 + x0 * 0.15,
            y=y1 * 0.85 + y0 * 0.15,
            ax=x0 * 0.85 + x1 * 0.15,
            ay=y0 * 0.85 + y1 * 0.15,
            xref="x",
            yref="y",
            axref="x",
            ayref="y",
            showarrow=True,
            arrowhead=3,
            arrowwidth=2.5 if in_cycle else 1.5,
            arrowcolor="#d9473b" if in_cycle else "#5b6570",
            text=f"{wait.mode} on {wait.locked or wait.lock_type}"
            + (f" · seen {wait.waited_ms} ms" if wait.waited_ms else ""),
            font={"size": 11, "color": "#d9473b" if in_cycle else "#1d232a"},
        )
    figure.add_trace(
        go.Scatter(
            mode="markers+text",
            x=[place[p][0] for p in pids],
            y=[place[p][1] for p in pids],
            text=[labels[p] for p in pids],
            textposition="bottom center",
            marker={
                "size": 26,
                "color": ["#d9473b" if p in cycle else "#3b7dd8" for p in pids],
            },
            hovertext=[_queries(waits, p) for p in pids],
            hoverinfo="text",
            showlegend=False,
        )
    )
    axis = {"visible": False, "range": [-1.6, 1.6]}
    figure.update_layout(**LAYOUT, height=460, xaxis=axis, yaxis={**axis, "scaleanchor": "x"})
    return figure.to_json()


def gaps_over_time(gaps: Iterable[tuple[str, str, int]]) -> str:
    """Gaps per hour, stacked by reason: (hour isoformat, reason, count) rows."""
    by_reason: dict[str, tuple[list[str], list[int]]] = {}
    for hour, reason, count in gaps:
        hours, counts = by_reason.setdefault(reason, ([], []))
        hours.append(hour)
        counts.append(count)
    figure = go.Figure(
        [
            go.Bar(name=reason, x=hours, y=counts)
            for reason, (hours, counts) in sorted(by_reason.items())
        ]
    )
    figure.update_layout(**LAYOUT, height=300, barmode="stack", xaxis={"type": "date"})
    return figure.to_json()


def _ms(delta: object) -> float:
    return max(delta.total_seconds() * 1000, 1.0)  # type: ignore[attr-defined]


def _vertical(figure: go.Figure, x: str, label: str, colour: str) -> None:
    figure.add_vline(x=x, line={"color": colour, "dash": "dot", "width": 1})
    figure.add_annotation(x=x, y=1, yref="paper", text=label, showarrow=False, font={"size": 10})


def _node_label(role: str, pid: int, run_id: int | None) -> str:
    return f"{role or 'process'} {pid}" + (f" · run {run_id}" if run_id else "")


def _queries(waits: list, pid: int) -> str:
    for wait in waits:
        if wait.waiter_pid == pid and wait.waiter_query:
            return wait.waiter_query[:300]
        if wait.blocker_pid == pid and wait.blocker_query:
            return wait.blocker_query[:300]
    return f"process {pid}"

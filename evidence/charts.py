"""The plotly figures of a run's timeline, a lock incident and capture gaps,
built on the server as plain dicts, for the dashboard's pages and a
bundle's report.html alike.

A template writes a figure into the page with `json_script` (a `<script
type="application/json">` element) and static/js/rundesk.js draws it: no
inline script, so the page's Content-Security-Policy allows no script but
the site's own files.
"""

from __future__ import annotations

import datetime as dt
import html
import math
import re
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import plotly.graph_objects as go
from django.utils import timezone

from evidence.models import CaptureGap, GapReason, LockIncident
from runs.checkpoint_rows import CheckpointRow
from runs.holds import hold_wait_words, hold_waiting_words
from runs.models import (
    Action,
    ActionState,
    CheckpointOutcome,
    DecisionChoice,
    OperatorDecision,
    Receipt,
    Run,
    RunStatus,
)
from runs.timeline import EventKind
from runs.words import (
    APPROVAL_WAIT,
    cut_words,
    human_duration,
    plain,
    unowned_words,
    wait_words,
    waiting_words,
)

# Colours and legend names of action attempts, by the state each is in now:
# how it ended, or what settled it since (an unknown delivery an operator
# confirmed is completed).  A read refused is a definite answer with no
# content: not drawn as a success.
ATTEMPTS = {
    "completed": ("#2e9d4e", "action completed"),
    "refused": ("#c2407e", "read refused: a definite answer, nothing read"),
    "dispatched": ("#3b7dd8", "action in flight, no receipt yet"),
    "failed": ("#d9473b", "action failed: known not to have happened"),
    "unknown": ("#e0a21b", "action outcome unknown"),
    "interrupted": ("#9aa5b1", "attempt cut short: lease lost or given back"),
}
# What an operator's decision on an attempt whose outcome was unknown says
# of it; a resend under the same identity leaves the first one unknown.
SETTLES = {
    DecisionChoice.CONFIRMED_HAPPENED: "completed",
    DecisionChoice.CONFIRMED_NOT_HAPPENED: "failed",
    DecisionChoice.WRITTEN: "completed",
    DecisionChoice.NOT_WRITTEN: "failed",
}
# A checkpoint's marker by its outcome: a colour and a symbol of its own
# for each, so that committed and committed-settled-by-evidence differ.
CHECKPOINT_MARKERS = {
    CheckpointOutcome.COMMITTED: ("#2e9d4e", "diamond"),
    CheckpointOutcome.SETTLED_COMMITTED: ("#138a8a", "star-diamond"),
    CheckpointOutcome.FAILED_BEFORE_WRITE: ("#d9473b", "triangle-down"),
    CheckpointOutcome.SETTLED_NOT_WRITTEN: ("#8f2d25", "square-x"),
    CheckpointOutcome.UNKNOWN: ("#e0a21b", "hourglass"),
}
# Lease changes, drawn as vertical lines: (label, colour).
LEASE_CHANGES = {
    EventKind.LEASE_ACQUIRED: ("lease taken", "#3b7dd8"),
    EventKind.LEASE_RELEASED: ("lease given back", "#5b6570"),
    EventKind.LEASE_LOST: ("lease lost", "#d9473b"),
    EventKind.RESUMED: ("resumed", "#3b7dd8"),
    EventKind.RUN_REQUEUED: ("back in the queue", "#5b6570"),
}
STARTS = {EventKind.ACTION_DISPATCHED, EventKind.ACTION_REDISPATCHED}
ENDS = {
    EventKind.ACTION_COMPLETED: "completed",
    EventKind.ACTION_FAILED: "failed",
    EventKind.ACTION_UNKNOWN: "unknown",
}
# After these, no attempt of the run's current owner is still in flight.
INTERRUPTIONS = {
    EventKind.LEASE_LOST,
    EventKind.LEASE_RELEASED,
    EventKind.RUN_REQUEUED,
    EventKind.NEEDS_OPERATOR,
    EventKind.RUN_FAILED,
    EventKind.RUN_CANCELLED,
}
# What ends a wait for an operator: the run back in the queue (an item
# decided), taken again, or ended (abandoned, cancelled).
WAIT_ENDS = {
    EventKind.RUN_REQUEUED,
    EventKind.LEASE_ACQUIRED,
    EventKind.RUN_COMPLETED,
    EventKind.RUN_FAILED,
    EventKind.RUN_CANCELLED,
}
# Spans where nothing ran: (fill, edge, legend name), drawn on a lane of their own.
IDLE = {
    "operator": ("rgba(138, 92, 209, 0.3)", "#8a5cd1", "waiting for an operator"),
    "owner": ("rgba(91, 101, 112, 0.2)", "#5b6570", "nobody ran it: no lease held"),
    "held": ("rgba(224, 162, 27, 0.3)", "#c98a0c", "held: waiting for a hold to be released"),
}
IDLE_LANE = "waits"
# A claim takes a free executor well under a second: a shorter span without
# an owner is the queue doing its job, not worth a bar.
UNOWNED_SHOWN = dt.timedelta(seconds=1)
# A span where nothing ran is cut (drawn at a fixed width, its real length
# said on it) when it is longer than CUT_AFTER and longer than CUT_SHARE of
# the rest of the chart: a ten-minute wait for an operator after a minute of
# work would leave every action a sliver.  Each cut takes CUT_WIDTH of the
# plotted width, all of them together at most CUTS_WIDTH.
CUT_AFTER = dt.timedelta(seconds=0.5)
CUT_SHARE = 0.25
CUT_WIDTH = 0.12
CUTS_WIDTH = 0.3
# A bar is drawn at least this fraction of the plotted width wide: an action
# of a few milliseconds among longer ones stays visible (its hover says how
# long it really took).
MIN_BAR_FRACTION = 1 / 250
# About this many ticks on the time axis.
TICKS = 8
# Tick steps, in seconds: 1-2-5 below a minute, then whole minutes and hours.
TICK_STEPS = [
    *(m * 10.0**e for e in range(-3, 2) for m in (1, 2, 5)),
    60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400,
]  # fmt: skip
# Labels of vertical lines go at up to this many heights; a label is about
# this fraction of the chart's width wide.
LABEL_LEVELS = 4
LABEL_WIDTH_FRACTION = 0.12
LAYOUT = {
    "margin": {"l": 110, "r": 20, "t": 10, "b": 40},
    "plot_bgcolor": "#fff",
    "paper_bgcolor": "#fff",
    "font": {"size": 12},
    "hoverlabel": {"align": "left"},
}


def inert(text: str) -> str:
    """Text from runs, logs and other sessions as Plotly is to show it:
    Plotly reads tags in its labels and hovers (<a href>, <b>, <br>), and
    shows the entities &lt; &gt; &amp; as their characters."""
    return html.escape(text, quote=False)


@dataclass
class Attempt:
    """One dispatch of an action, from its boundary to how it ended; its
    state now (`now`, a key of ATTEMPTS) and what happened to it, in words."""

    action: Action
    number: int
    start: dt.datetime
    end: dt.datetime
    how: str  # how it ended, a key of ATTEMPTS
    now: str = ""
    history: list[str] = field(default_factory=list)


@dataclass
class Mark:
    """A moment drawn as a vertical line with a label."""

    at: dt.datetime
    label: str
    colour: str
    hover: str = ""


@dataclass
class Idle:
    """A span where nothing of the run ran: it waited for an operator
    (`why` "operator"), at a held boundary ("held"), or nobody held its lease
    ("owner")."""

    why: str  # a key of IDLE
    start: dt.datetime
    end: dt.datetime | None  # None: it still waits
    label: str


@dataclass(frozen=True)
class Cut:
    """A span of time drawn narrower than it was."""

    start: dt.datetime
    end: dt.datetime
    at: float  # where it starts on the plotted axis
    width: float  # how wide it is drawn there

    @property
    def length(self) -> dt.timedelta:
        return self.end - self.start


@dataclass
class Axis:
    """The time axis, in seconds from `origin`, with long idle spans cut:
    moments inside a cut are spread evenly over its drawn width."""

    origin: dt.datetime
    last: dt.datetime
    cuts: list[Cut]

    def x(self, moment: dt.datetime) -> float:
        shift = 0.0
        for cut in self.cuts:
            if moment <= cut.start:
                break
            if moment < cut.end:
                return cut.at + cut.width * ((moment - cut.start) / cut.length)
            shift += cut.length.total_seconds() - cut.width
        return (moment - self.origin).total_seconds() - shift

    @property
    def width(self) -> float:
        return self.x(self.last)

    def till(self, end: dt.datetime | None) -> float:
        """Where a span ends; one still open (a wait) runs on past the last
        moment drawn, over CUT_WIDTH of the plotted width."""
        if end is not None:
            return self.x(end)
        return max(self.width, 0.001) / (1 - CUT_WIDTH)

    def kept(self) -> list[tuple[dt.datetime, dt.datetime]]:
        """The spans drawn at their real scale, in order."""
        starts = [self.origin, *(cut.end for cut in self.cuts)]
        ends = [*(cut.start for cut in self.cuts), self.last]
        return list(zip(starts, ends, strict=True))


def timeline(
    run: Run,
    actions: Sequence[Action],
    checkpoints: Sequence[CheckpointRow],
    redact: Callable[[str], str] = str,
) -> dict[str, Any] | None:
    """Each attempt of an action as a bar from its dispatch to how it ended,
    coloured by its state now (its history in its hover); the spans where
    the run waited for an operator, or nobody ran it, as labelled bars on a
    lane of their own, cut short when long (the cut says how long); checkpoints
    (one marker per number, its final outcome) and capture gaps on lanes of
    their own; lease changes, answer revisions and phase changes as labelled
    vertical lines.  None when there is nothing to draw (a run nobody took)."""
    now = timezone.now()
    events = list(
        run.events.filter(
            kind__in=[
                *STARTS,
                *ENDS,
                *INTERRUPTIONS,
                *LEASE_CHANGES,
                *WAIT_ENDS,
                EventKind.PHASE_CHANGED,
                EventKind.DECISION,
            ]
        )
        .order_by("created_at", "id")
        .values("kind", "action_id", "created_at", "message", "data")
    )
    last_seen = run.finished_at or max((e["created_at"] for e in events), default=None)
    until = now if run.is_active or last_seen is None else last_seen
    decisions = {d.pk: d for d in run.decisions.order_by("created_at", "id")}
    attempts, outcomes = _attempts(actions, events, until)
    _settle(attempts, list(decisions.values()), _refused(actions))
    idle = _idle(run, events, decisions)
    gaps = list(CaptureGap.objects.filter(run=run).order_by("id"))
    marks = [
        Mark(e["created_at"], _lease_label(e), LEASE_CHANGES[e["kind"]][1], inert(e["message"]))
        for e in events
        if e["kind"] in LEASE_CHANGES
    ]
    marks += [
        Mark(r.committed_at, f"rev {r.number}", "#2e9d4e", "answer revision published")
        for r in run.revisions.order_by("number")
    ]
    marks += [
        Mark(e["created_at"], "finalizing", "#e0a21b", inert(e["message"]))
        for e in events
        if e["kind"] == EventKind.PHASE_CHANGED
    ]
    marks += [
        Mark(e["created_at"], "decision", "#8a5cd1", inert(e["message"]))
        for e in events
        if e["kind"] == EventKind.DECISION
    ]
    points = [m.at for m in marks] + [c.at for c in checkpoints] + [g.created_at for g in gaps]
    points += [at for late in outcomes.values() for _, at, _ in late]
    points += [moment for span in idle for moment in (span.start, span.end) if moment]
    if not attempts and not points:
        return None
    axis = _axis([(a.start, a.end) for a in attempts], points)
    shortest = axis.width * MIN_BAR_FRACTION

    def hover(text: str, limit: int) -> str:
        return inert(redact(text)[:limit])

    figure = go.Figure()
    for why, (fill, edge, name) in IDLE.items():
        spans = [s for s in idle if s.why == why]
        if not spans:
            continue
        figure.add_trace(
            go.Bar(
                name=name,
                orientation="h",
                y=[IDLE_LANE] * len(spans),
                base=[axis.x(s.start) for s in spans],
                x=[axis.till(s.end) - axis.x(s.start) for s in spans],
                marker={"color": fill, "line": {"color": edge, "width": 1}},
                customdata=[
                    [inert(s.label), _clock(s.start), _clock(s.end) if s.end else "now"]
                    for s in spans
                ],
                hovertemplate="%{customdata[0]}<br>%{customdata[1]} to %{customdata[2]}"
                "<extra></extra>",
            )
        )
    for how, (colour, name) in ATTEMPTS.items():
        bars = [a for a in attempts if a.now == how]
        if not bars:
            continue
        figure.add_trace(
            go.Bar(
                name=name,
                orientation="h",
                y=[inert(a.action.step_key) for a in bars],
                base=[axis.x(a.start) for a in bars],
                x=[max(axis.x(a.end) - axis.x(a.start), shortest) for a in bars],
                marker={"color": colour, "pattern": {"shape": "/" if how == "interrupted" else ""}},
                customdata=[
                    [
                        a.action.epoch,
                        a.action.input_digest[:12],
                        hover(a.action.error or "", 200),
                        a.number,
                        human_duration((a.end - a.start).total_seconds()),
                        "<br>".join(hover(line, 300) for line in a.history),
                    ]
                    for a in bars
                ],
                hovertemplate=(
                    "%{y}<br>attempt %{customdata[3]}, took %{customdata[4]}"
                    "<br>%{customdata[5]}<br>input %{customdata[1]}…<br>%{customdata[2]}"
                    "<extra>" + name + "</extra>"
                ),
            )
        )
    for how, late in sorted(outcomes.items()):
        colour, name = ATTEMPTS[how]
        figure.add_trace(
            go.Scatter(
                name=f"{name} (said after a pause)",
                mode="markers",
                x=[axis.x(at) for _, at, _ in late],
                y=[inert(action.step_key) for action, _, _ in late],
                marker={"color": colour, "size": 11, "symbol": "circle-x"},
                customdata=[[hover(message, 200), _clock(at)] for _, at, message in late],
                hovertemplate="%{y} at %{customdata[1]}<br>%{customdata[0]}<extra>"
                + name
                + "</extra>",
            )
        )
    for outcome, (colour, symbol) in CHECKPOINT_MARKERS.items():
        saved = [c for c in checkpoints if c.outcome == outcome]
        if not saved:
            continue
        name = f"checkpoint {plain(CheckpointOutcome, outcome)}"
        figure.add_trace(
            go.Scatter(
                name=name,
                mode="markers",
                x=[axis.x(c.at) for c in saved],
                y=["checkpoints"] * len(saved),
                marker={"color": colour, "size": 11, "symbol": symbol},
                customdata=[
                    [c.number, c.xid or "—", hover(c.summary, 300), _clock(c.at)] for c in saved
                ],
                hovertemplate=(
                    "checkpoint %{customdata[0]} at %{customdata[3]}<br>xid %{customdata[1]}"
                    "<br>%{customdata[2]}<extra>" + name + "</extra>"
                ),
            )
        )
    if gaps:
        figure.add_trace(
            go.Scatter(
                name="capture gap",
                mode="markers",
                x=[axis.x(g.created_at) for g in gaps],
                y=["capture gaps"] * len(gaps),
                marker={"color": "#8a5cd1", "size": 10, "symbol": "x"},
                customdata=[
                    [
                        ", ".join(filter(None, [plain(GapReason, g.reason), g.saved_later])),
                        hover(g.detail, 200),
                        _clock(g.created_at),
                    ]
                    for g in gaps
                ],
                hovertemplate="%{customdata[0]} at %{customdata[2]}<br>%{customdata[1]}"
                "<extra>capture gap</extra>",
            )
        )
    for span in idle:
        _idle_label(figure, span, axis)
    for cut in axis.cuts:
        _cut(figure, cut)
    for mark, level in _levels(marks, axis):
        _vertical(figure, mark, axis.x(mark.at), level)
    lanes = [IDLE_LANE] if idle else []
    lanes += [inert(a.step_key) for a in actions] + ["checkpoints", "capture gaps"]
    ticks = _ticks(axis)
    figure.update_layout(
        **{**LAYOUT, "margin": {**LAYOUT["margin"], "t": 16 * LABEL_LEVELS + 14, "b": 50}},
        height=max(240, 26 * len(lanes) + 130),
        barmode="overlay",
        xaxis={
            # Its range left to plotly: a reader's zoom then stays as the
            # run page redraws the chart (uirevision keeps what the reader
            # changed only where the figure's own value did not change).
            "type": "linear",
            "tickmode": "array",
            "tickvals": [x for x, _ in ticks],
            "ticktext": [text for _, text in ticks],
            "zeroline": False,
            "title": {"text": _dates(axis), "font": {"size": 11}},
        },
        yaxis={
            "categoryorder": "array",
            "categoryarray": list(reversed(lanes)),
            "automargin": True,
        },
        # Always, even for one trace; on the right, clear of the time axis
        # and its date.
        showlegend=True,
        legend={"orientation": "v", "x": 1.01, "xanchor": "left", "y": 1, "yanchor": "top"},
        # The run page redraws this chart as the run goes on: the reader's
        # zoom and pan stay.
        uirevision=f"run-{run.pk}",
    )
    return figure.to_dict()


def _attempts(
    actions: Sequence[Action], events: list[dict[str, Any]], until: dt.datetime
) -> tuple[list[Attempt], dict[str, list[tuple[Action, dt.datetime, str]]]]:
    """The attempts of each action, from the timeline's events: an attempt
    starts at a dispatch and ends at the action's outcome, or where its
    owner stopped (lease lost or given back, the run paused or ended).  An
    action whose dispatch events were lost gets one attempt from its row.
    Also the outcomes said after the attempt they are about was cut short
    (an effect found without receipt on resume is marked unknown then)."""
    starts: dict[int, list[dt.datetime]] = {}
    ends: dict[int, list[tuple[dt.datetime, str, str]]] = {}
    interruptions = []
    for e in events:
        if e["kind"] in STARTS and e["action_id"]:
            starts.setdefault(e["action_id"], []).append(e["created_at"])
        elif e["kind"] in ENDS and e["action_id"]:
            ends.setdefault(e["action_id"], []).append(
                (e["created_at"], ENDS[e["kind"]], e["message"])
            )
        elif e["kind"] in INTERRUPTIONS:
            interruptions.append(e["created_at"])
    attempts: list[Attempt] = []
    late: dict[str, list[tuple[Action, dt.datetime, str]]] = {}
    for action in actions:
        begun = starts.get(action.pk) or [action.dispatched_at]
        unused = list(ends.get(action.pk, []))
        for number, start in enumerate(begun, 1):
            following = begun[number] if number < len(begun) else None
            before_next = [
                end
                for end in unused
                if end[0] >= start and (following is None or end[0] < following)
            ]
            cut = next((t for t in interruptions if t >= start), None)
            if following is not None and cut is not None and cut > following:
                cut = None
            if before_next and (cut is None or before_next[0][0] <= cut):
                ended = before_next[0]
                unused.remove(ended)
                end, how = ended[0], ended[1]
            elif cut is not None:
                end, how = cut, "interrupted"
            elif following is not None:
                end, how = following, "interrupted"
            elif action.finished_at is not None and action.finished_at >= start:
                end, how = action.finished_at, action.state
            else:
                end, how = max(until, start), action.state
            if how not in ATTEMPTS:
                how = "dispatched"
            attempts.append(Attempt(action, number, start, end, how))
        for at, how, message in unused:
            late.setdefault(how, []).append((action, at, message))
    return attempts, late


def _refused(actions: Sequence[Action]) -> set[int]:
    """The actions whose receipt holds a refusal (a read of a file that is
    not text, say): completed, with a definite answer and nothing read."""
    return set(
        Receipt.objects.filter(
            action_id__in=[a.pk for a in actions], result__has_key="refused"
        ).values_list("action_id", flat=True)
    )


def _settle(attempts: list[Attempt], decisions: list[OperatorDecision], refused: set[int]) -> None:
    """Each attempt's state now and its history: how it ended, and the
    decision taken on it since (a delivery whose answer was lost, confirmed
    by an operator, is completed now).  The last attempt of an action is in
    its action's state when that was settled otherwise (by evidence)."""
    for i, attempt in enumerate(attempts):
        action = attempt.action
        following = next((a for a in attempts[i + 1 :] if a.action is action), None)
        attempt.history = [f"dispatched at {_clock(attempt.start)}"]
        if attempt.how != "dispatched":
            attempt.history.append(f"{ATTEMPTS[attempt.how][1]} at {_clock(attempt.end)}")
        attempt.now = attempt.how
        for decision in decisions:
            if decision.action_id != action.pk or decision.created_at < attempt.start:
                continue
            if following is not None and decision.created_at >= following.start:
                continue
            said = f"{decision.get_choice_display()}, by {decision.decided_by} at "
            said += _clock(decision.created_at)
            if decision.reference:
                said += f" (reference {decision.reference})"
            attempt.history.append(said)
            if attempt.how == "unknown":
                attempt.now = SETTLES.get(decision.choice, attempt.now)
        settled = action.state in (ActionState.COMPLETED, ActionState.FAILED)
        if following is None and attempt.now in ("unknown", "dispatched") and settled:
            attempt.now = action.state
        if attempt.now == "completed" and action.pk in refused:
            attempt.now = "refused"
        if attempt.now != attempt.how:
            attempt.history.append(f"now: {ATTEMPTS[attempt.now][1]}")


def _idle(
    run: Run, events: list[dict[str, Any]], decisions: dict[int, OperatorDecision]
) -> list[Idle]:
    """The spans where nothing of the run ran: from its wait for an
    operator to what ended it (a decision, the run's end), or open (it
    still waits), and from its owner's stop (lease lost, given back, the
    run put back in the queue) to the next owner, when that took long.  No
    span ends at the clock's now: a bundle's report of an unchanged run is
    the same bytes whenever it is exported (evidence/bundle_report.py)."""
    spans: list[Idle] = []
    waiting: dt.datetime | None = None
    ender = ""
    held = ""  # the wait is at a held boundary: why, as its run says it
    # What else the run waits for, as its wait's event says it (an
    # approval's begins APPROVAL_WAIT).
    waiting_for = ""
    unowned: tuple[dt.datetime, str] | None = None
    for e in events:
        kind, at = e["kind"], e["created_at"]
        if waiting is not None:
            if kind == EventKind.DECISION:
                ender = _ender(decisions.get((e["data"] or {}).get("decision")), e["message"])
            elif kind in WAIT_ENDS:
                if kind == EventKind.RUN_CANCELLED and not ender:
                    ender = f"the cancel asked by {run.cancel_requested_by or '(not recorded)'}"
                if released_by := (e["data"] or {}).get("released_by"):
                    ender = f"the release of {released_by}"
                spans.append(_waited(waiting, at, ender, held, waiting_for))
                waiting = None
                if kind == EventKind.RUN_REQUEUED:
                    unowned = (at, "back in the queue")
            continue
        if kind == EventKind.NEEDS_OPERATOR:
            waiting, ender, unowned = at, "", None
            held = (e["data"] or {}).get("held", "")
            approval = (e["message"] or "").startswith(APPROVAL_WAIT)
            waiting_for = APPROVAL_WAIT if approval else "waiting for an operator"
        elif kind == EventKind.LEASE_ACQUIRED and unowned is not None:
            since, why = unowned
            if at - since >= UNOWNED_SHOWN:
                epoch = (e["data"] or {}).get("epoch")
                taken = f"until epoch {epoch} took it" if epoch else "until an executor took it"
                said = unowned_words((at - since).total_seconds(), why, taken)
                spans.append(Idle("owner", since, at, said))
            unowned = None
        elif kind in (EventKind.LEASE_LOST, EventKind.LEASE_RELEASED, EventKind.RUN_REQUEUED):
            unowned = unowned or (at, plain(EventKind, kind))
    if waiting is not None and run.status == RunStatus.NEEDS_OPERATOR:
        since = _clock(waiting, millis=False)
        if held:
            spans.append(Idle("held", waiting, None, hold_waiting_words(held, since)))
        else:
            spans.append(Idle("operator", waiting, None, waiting_words(since, waiting_for)))
    elif waiting is not None:  # ended, its end's event not (yet) written
        end = max(run.finished_at or waiting, waiting)
        spans.append(_waited(waiting, end, ender, held, waiting_for))
    return spans


def _waited(start: dt.datetime, end: dt.datetime, ender: str, held: str, waiting_for: str) -> Idle:
    """A wait that ended: at a held boundary (`held`), or `waiting_for` an
    operator or an approval."""
    seconds = (end - start).total_seconds()
    if held:
        return Idle("held", start, end, hold_wait_words(held, human_duration(seconds), ender))
    return Idle("operator", start, end, wait_words(seconds, ender, waiting_for))


def _ender(decision: OperatorDecision | None, message: str) -> str:
    """What a decision that ended a wait is called on its span."""
    if decision is None:  # its row is not readable: the event says who
        return f"a decision ({message})"
    if decision.user_id is None:
        return f"the evidence ({decision.decided_by})"
    return f"the decision of {decision.decided_by} ({decision.get_choice_display()})"


def _axis(busy: list[tuple[dt.datetime, dt.datetime]], points: list[dt.datetime]) -> Axis:
    """The time axis: the spans between what was drawn (attempts, marks,
    markers, the ends of idle spans) are idle; the longest are cut, per
    CUT_AFTER and CUT_SHARE, largest first, each drawn CUT_WIDTH wide."""
    blocks = sorted(busy + [(p, p) for p in points])
    origin, reach = blocks[0]
    idle = []
    for start, end in blocks[1:]:
        if start > reach:
            idle.append((start - reach, reach, start))
        reach = max(reach, end)
    span = reach - origin
    cut: list[tuple[dt.datetime, dt.datetime]] = []
    cut_length = dt.timedelta(0)
    for length, start, end in sorted(idle, reverse=True):
        if length <= CUT_AFTER or length <= CUT_SHARE * (span - cut_length - length):
            break
        cut.append((start, end))
        cut_length += length
    kept = max((span - cut_length).total_seconds(), 0.001)
    share = min(CUT_WIDTH, CUTS_WIDTH / len(cut)) if cut else 0.0
    width = share * kept / (1 - len(cut) * share)
    axis = Axis(origin, reach, [])
    for start, end in sorted(cut):
        axis.cuts.append(Cut(start, end, axis.x(start), width))
    return axis


def _ticks(axis: Axis) -> list[tuple[float, str]]:
    """Clock times along the axis, about TICKS of them, at a round step,
    on the spans drawn at their real scale (none inside a cut)."""
    wanted = axis.width / TICKS
    step = next((s for s in TICK_STEPS if s >= wanted), TICK_STEPS[-1])
    ticks: list[tuple[float, str]] = []
    for start, end in axis.kept():
        first = math.ceil(start.timestamp() / step) * step
        for n in range(int((end.timestamp() - first) // step) + 1):
            moment = dt.datetime.fromtimestamp(first + n * step, tz=dt.UTC)
            x = axis.x(moment)
            # Clear of the tick before it, over a cut's edge.
            if not ticks or x - ticks[-1][0] >= step * 0.6:
                ticks.append((x, _clock(moment, millis=step < 1)))
    return ticks


def _dates(axis: Axis) -> str:
    """The day (or days) the axis' clock times are on, and their time zone."""
    first, last = timezone.localtime(axis.origin), timezone.localtime(axis.last)
    days = first.strftime("%Y-%m-%d")
    if last.date() != first.date():
        days += f" to {last.strftime('%Y-%m-%d')}"
    return f"{days}, {first.tzname()}"


def _clock(moment: dt.datetime, millis: bool = True) -> str:
    local = timezone.localtime(moment)
    return local.strftime("%H:%M:%S.%f")[:-3] if millis else local.strftime("%H:%M:%S")


def _levels(marks: list[Mark], axis: Axis) -> list[tuple[Mark, int]]:
    """The height each mark's label goes at: the lowest whose last label is
    far enough to the left not to overlap, else the one used longest ago."""
    apart = axis.width * LABEL_WIDTH_FRACTION
    last: list[float | None] = [None] * LABEL_LEVELS
    placed = []
    for mark in sorted(marks, key=lambda m: m.at):
        x = axis.x(mark.at)
        free = [i for i, at in enumerate(last) if at is None or x - at >= apart]
        level = free[0] if free else min(range(LABEL_LEVELS), key=lambda i: last[i] or x)
        last[level] = x
        placed.append((mark, level))
    return placed


def _lease_label(event: dict[str, Any]) -> str:
    label = LEASE_CHANGES[event["kind"]][0]
    epoch = (event["data"] or {}).get("epoch")
    return f"{label}, epoch {epoch}" if epoch is not None else label


def _idle_label(figure: go.Figure, span: Idle, axis: Axis) -> None:
    """A span's words on its lane, over its bar; where the bar is near an
    end of the axis, running inwards from its edge, so they stay in view."""
    start, end = axis.x(span.start), axis.till(span.end)
    middle = (start + end) / 2
    x, anchor = middle, "center"
    if middle < axis.width * 0.3:
        x, anchor = start, "left"
    elif middle > axis.width * 0.7:
        x, anchor = end, "right"
    figure.add_annotation(
        x=x,
        y=IDLE_LANE,
        text=inert(span.label),
        xanchor=anchor,
        showarrow=False,
        font={"size": 11, "color": "#3d2a66" if span.why == "operator" else "#3c434a"},
        bgcolor="rgba(255, 255, 255, 0.8)",
    )


def _cut(figure: go.Figure, cut: Cut) -> None:
    """Where time was cut: a shaded band over the whole plot, and on the
    time axis how much of it is not drawn."""
    figure.add_vrect(
        x0=cut.at, x1=cut.at + cut.width, fillcolor="#eef0f3", line_width=0, layer="below"
    )
    figure.add_annotation(
        x=cut.at + cut.width / 2,
        y=0,
        yref="paper",
        text=inert(cut_words(cut.length.total_seconds())),
        hovertext=f"{_clock(cut.start)} to {_clock(cut.end)}: nothing ran, drawn shorter",
        showarrow=False,
        font={"size": 11, "color": "#5b6570"},
        bgcolor="#fff",
    )


# The lock graph is laid out in data units drawn at a fixed scale, so that a
# label's size in pixels is known in data units: each label sits on its own
# arrow, where it covers no other arrow, no process and no other label, and
# the figure is sized to fit.  Waits that share no process (independent
# waits) are drawn apart, each set in a band of its own.
GRAPH_SCALE = 160  # pixels per unit; a band's processes sit on a circle of radius 1 or more
GRAPH_FONT = 11
CHAR_EM = 0.62  # a character's width, in ems: generous for the sans-serif font
LINE_EM = 1.35
GRAPH_PAD = 4  # pixels around a label's text
GRAPH_MARGIN = 12  # pixels around the drawing
GRAPH_LABEL_CHARS = 30  # a label's lines are wrapped at this many characters
NODE_MARKER = 13  # pixels: the radius of a process's marker
# Units between arrows joining the same two processes: at least this, and
# enough for their labels side by side up to the most; beyond it a label
# moves along its arrow instead.
PARALLEL_GAP = (0.14, 0.4)
LABEL_GAP = 0.04  # units between labels side by side
ARROW_SHOWN = 18 / GRAPH_SCALE  # units of an arrow left in view at each end of its label
BAND_GAP = 0.3  # units between the bands of independent waits
# Where along its arrow a label is tried, from the middle out; a band whose
# labels find no free place grows (its circle's radius times GROWTH).
LABEL_ALONG = (0.5, 0.4, 0.6, 0.3, 0.7, 0.2, 0.8)
GROWTH = 1.35
GROWTH_TRIES = 8
DATABASE_SUFFIX = re.compile(r" of database \d+$")
CYCLE_COLOUR, WAIT_COLOUR = "#d9473b", "#5b6570"

Point = tuple[float, float]


@dataclass(frozen=True)
class Box:
    """A rectangle in the graph's data units."""

    x0: float
    y0: float
    x1: float
    y1: float

    @classmethod
    def around(cls, x: float, y: float, width: float, height: float) -> Box:
        return cls(x - width / 2, y - height / 2, x + width / 2, y + height / 2)

    def overlaps(self, other: Box) -> bool:
        return (
            self.x0 < other.x1 and other.x0 < self.x1 and self.y0 < other.y1 and other.y0 < self.y1
        )

    def crosses(self, a: Point, b: Point) -> bool:
        """Whether the segment a-b passes through the box (Liang-Barsky)."""
        (ax, ay), (bx, by) = a, b
        dx, dy = bx - ax, by - ay
        low, high = 0.0, 1.0
        for p, q in (
            (-dx, ax - self.x0),
            (dx, self.x1 - ax),
            (-dy, ay - self.y0),
            (dy, self.y1 - ay),
        ):
            if p == 0:
                if q < 0:
                    return False
                continue
            t = q / p
            if p < 0:
                low = max(low, t)
            else:
                high = min(high, t)
            if low > high:
                return False
        return True

    def moved(self, dx: float, dy: float) -> Box:
        return Box(self.x0 + dx, self.y0 + dy, self.x1 + dx, self.y1 + dy)


def text_size(text: str, font: float = GRAPH_FONT) -> tuple[float, float]:
    """A label's width and height in data units, with its padding."""
    lines = text.split("<br>")
    width = max(len(html.unescape(line)) for line in lines) * CHAR_EM * font + 2 * GRAPH_PAD
    height = len(lines) * LINE_EM * font + 2 * GRAPH_PAD
    return width / GRAPH_SCALE, height / GRAPH_SCALE


@dataclass
class Band:
    """One set of waits that share processes, laid out on its own: where
    each process is and where its name goes, each wait's arrow (tail,
    head) and its label's centre, and every box drawn."""

    place: dict[int, Point]
    sides: dict[int, str]
    arrows: list[tuple[Point, Point]]
    labels: list[Point]
    boxes: list[Box]

    def moved(self, dx: float, dy: float) -> Band:
        def at(point: Point) -> Point:
            return point[0] + dx, point[1] + dy

        return Band(
            {pid: at(point) for pid, point in self.place.items()},
            self.sides,
            [(at(tail), at(head)) for tail, head in self.arrows],
            [at(label) for label in self.labels],
            [box.moved(dx, dy) for box in self.boxes],
        )


def lock_graph(incident: LockIncident) -> dict[str, Any]:
    """The waits-for graph: an arrow from each waiter to its blocker, its
    label (the lock, and who holds it) on it; waits that share processes
    drawn together, processes on a circle (in the order the cycle goes,
    arrows between the same two processes side by side), each named outside
    it; independent waits in bands of their own, one under the other, so
    that no arrow of one crosses another's.  The cycle's arrows in red; the
    process PostgreSQL ended to break a deadlock (`victim_pid`) marked and
    named.  An imported report's lead-up waits are not edges of its graph."""
    waits = list(incident.waits.filter(lead_up=False).order_by("id"))
    victim = incident.victim_pid
    names: dict[int, str] = {}
    for wait in waits:
        names.setdefault(
            wait.waiter_pid, _node_label(wait.waiter_role, wait.waiter_pid, wait.waiter_run_id)
        )
        names.setdefault(
            wait.blocker_pid, _node_label(wait.blocker_role, wait.blocker_pid, wait.blocker_run_id)
        )
    if victim in names:
        names[victim] += "<br>ended by PostgreSQL"
    cycle = list(incident.cycle or [])
    cycle_edges = set(zip(cycle, cycle[1:] + cycle[:1], strict=True)) if cycle else set()
    texts = [_edge_label(wait) for wait in waits]
    place: dict[int, Point] = {}
    sides: dict[int, str] = {}
    drawn: dict[int, tuple[Point, Point, Point]] = {}
    boxes: list[Box] = []
    top = 0.0
    for pids in wait_groups(waits, cycle):
        members = [i for i, wait in enumerate(waits) if wait.waiter_pid in pids]
        band = _lay_out(pids, [waits[i] for i in members], names, [texts[i] for i in members])
        # Under the bands before it, centred on the same line.
        left, right = min(b.x0 for b in band.boxes), max(b.x1 for b in band.boxes)
        band = band.moved(-(left + right) / 2, top - max(b.y1 for b in band.boxes))
        top = min(b.y0 for b in band.boxes) - BAND_GAP
        place.update(band.place)
        sides.update(band.sides)
        boxes.extend(band.boxes)
        for i, arrow, label in zip(members, band.arrows, band.labels, strict=True):
            drawn[i] = (*arrow, label)
    figure = go.Figure()
    for i, wait in enumerate(waits):
        tail, head, centre = drawn[i]
        colour = CYCLE_COLOUR if (wait.waiter_pid, wait.blocker_pid) in cycle_edges else WAIT_COLOUR
        # The same name on a wait's arrow and its label: which label is whose.
        name = f"wait {wait.pk}"
        figure.add_annotation(
            name=name, x=head[0], y=head[1], ax=tail[0], ay=tail[1],
            xref="x", yref="y", axref="x", ayref="y",
            showarrow=True, arrowhead=3, arrowcolor=colour, text="",
            arrowwidth=2.5 if colour == CYCLE_COLOUR else 1.5,
        )  # fmt: skip
        figure.add_annotation(
            name=name, x=centre[0], y=centre[1], xref="x", yref="y", showarrow=False,
            text=texts[i], xanchor="center", yanchor="middle", align="center",
            borderpad=GRAPH_PAD - 1, bgcolor="rgba(255,255,255,0.92)",
            bordercolor=colour, borderwidth=1, font={"size": GRAPH_FONT, "color": colour},
            hovertext=f"{wait.waiter_pid} waits for {inert(wait.mode)} on "
            f"{inert(wait.locked or wait.lock_type)}, held by {wait.blocker_pid}",
        )  # fmt: skip
    pids = list(place)
    figure.add_trace(
        go.Scatter(
            mode="markers+text",
            x=[place[p][0] for p in pids],
            y=[place[p][1] for p in pids],
            customdata=pids,
            text=[names[p] for p in pids],
            textposition=[sides[p] for p in pids],
            textfont={"size": GRAPH_FONT},
            marker={
                "size": 2 * NODE_MARKER,
                "color": [CYCLE_COLOUR if p in cycle else "#3b7dd8" for p in pids],
                "symbol": ["circle-x" if p == victim else "circle" for p in pids],
                "line": {"width": [2 if p == victim else 0 for p in pids], "color": "#1f2328"},
            },
            hovertext=[_queries(waits, p) for p in pids],
            hoverinfo="text",
            showlegend=False,
        )
    )
    bounds = boxes or [Box(-1, -1, 1, 1)]
    x = [min(b.x0 for b in bounds) - 0.05, max(b.x1 for b in bounds) + 0.05]
    y = [min(b.y0 for b in bounds) - 0.05, max(b.y1 for b in bounds) + 0.05]
    margin = {"l": GRAPH_MARGIN, "r": GRAPH_MARGIN, "t": GRAPH_MARGIN, "b": GRAPH_MARGIN}
    figure.update_layout(
        **{**LAYOUT, "margin": margin},
        width=round((x[1] - x[0]) * GRAPH_SCALE) + 2 * GRAPH_MARGIN,
        height=round((y[1] - y[0]) * GRAPH_SCALE) + 2 * GRAPH_MARGIN,
        xaxis={"visible": False, "range": x, "constrain": "domain"},
        yaxis={"visible": False, "range": y, "scaleanchor": "x", "constrain": "domain"},
    )
    return figure.to_dict()


def wait_groups(waits: Sequence[Any], cycle: Sequence[int]) -> list[list[int]]:
    """The processes of each set of waits that share a process (the
    connected components of the waits-for graph, the cycle's first), each
    in the order its circle places them: a walk from process to process
    along the waits that takes a process's other waits before going on
    round the cycle, so that neither the cycle's arrows nor a chain's cross."""
    neighbours: dict[int, set[int]] = {}
    for wait in waits:
        neighbours.setdefault(wait.waiter_pid, set()).add(wait.blocker_pid)
        neighbours.setdefault(wait.blocker_pid, set()).add(wait.waiter_pid)
    round_cycle = {pid: i for i, pid in enumerate(cycle)}

    def taken_after(pid: int) -> Callable[[int], tuple[int, int]]:
        # Off the cycle first, then the cycle's processes in its order from pid.
        here = round_cycle.get(pid, 0)
        return lambda other: (
            (1, (round_cycle[other] - here) % len(cycle)) if other in round_cycle else (0, other)
        )

    seen: set[int] = set()
    groups = []
    for start in [*cycle[:1], *(wait.waiter_pid for wait in waits)]:
        if start in seen or start not in neighbours:
            continue
        group, stack = [], [start]
        while stack:
            pid = stack.pop()
            if pid in seen:
                continue
            seen.add(pid)
            group.append(pid)
            stack.extend(sorted(neighbours[pid] - seen, key=taken_after(pid), reverse=True))
        groups.append(group)
    return groups


def _lay_out(pids: list[int], waits: list[Any], names: dict[int, str], texts: list[str]) -> Band:
    """One band: its processes on a circle, in `pids`' order, and each
    label on its arrow where it covers no other arrow, no process, no name
    and no other label; where one finds no such place the circle grows."""
    radius = 1.0
    for _ in range(GROWTH_TRIES):
        band, fits = _on_circle(pids, waits, names, texts, radius)
        if fits:
            break
        radius *= GROWTH
    return band


def _on_circle(
    pids: list[int], waits: list[Any], names: dict[int, str], texts: list[str], radius: float
) -> tuple[Band, bool]:
    place = {
        pid: (
            radius * math.cos(math.pi - 2 * math.pi * i / len(pids)),
            radius * math.sin(math.pi - 2 * math.pi * i / len(pids)),
        )
        for i, pid in enumerate(pids)
    }
    sides = {pid: _outside(place[pid]) for pid in pids}
    boxes = [box for pid in pids for box in _node_boxes(place[pid], names[pid], sides[pid])]
    sizes = [text_size(text) for text in texts]
    arrows = [_arrow(wait, waits, sizes, place) for wait in waits]
    fits, labels = True, []
    for wait, (tail, head), size in zip(waits, arrows, sizes, strict=True):
        pair = {wait.waiter_pid, wait.blocker_pid}
        # Its own pair's other arrows run beside it: a label may cover them.
        others = [
            arrow
            for other, arrow in zip(waits, arrows, strict=True)
            if {other.waiter_pid, other.blocker_pid} != pair
        ]
        centre = _label_place(tail, head, size, others, boxes)
        if centre is None:
            fits, centre = False, ((tail[0] + head[0]) / 2, (tail[1] + head[1]) / 2)
        labels.append(centre)
        boxes.append(Box.around(*centre, *size))
    return Band(place, sides, arrows, labels, boxes), fits


def _arrow(
    wait: Any, waits: list[Any], sizes: list[tuple[float, float]], place: dict[int, Point]
) -> tuple[Point, Point]:
    """(tail, head) of a wait's arrow: from the waiter to the blocker,
    short of both; arrows joining the same two processes (either way) are
    spread apart, far enough for their labels side by side where that is
    not too far from the processes they join."""
    pair = sorted((wait.waiter_pid, wait.blocker_pid))
    joined = [i for i, w in enumerate(waits) if sorted((w.waiter_pid, w.blocker_pid)) == pair]
    (px, py), (qx, qy) = place[pair[0]], place[pair[1]]
    length = math.hypot(qx - px, qy - py) or 1.0
    nx, ny = -(qy - py) / length, (qx - px) / length  # square to the pair's own line
    width = max(sizes[i][0] for i in joined)
    height = max(sizes[i][1] for i in joined)
    # Labels at the same place along two such arrows are clear of each other
    # when their centres are a box's width apart across, or its height.
    apart = min(width / abs(nx) if nx else math.inf, height / abs(ny) if ny else math.inf)
    gap = min(max(apart + LABEL_GAP, PARALLEL_GAP[0]), PARALLEL_GAP[1])
    offset = (joined.index(waits.index(wait)) - (len(joined) - 1) / 2) * gap
    (ax, ay), (bx, by) = place[wait.waiter_pid], place[wait.blocker_pid]
    ux, uy = (bx - ax) / length, (by - ay) / length
    short = (NODE_MARKER + 8) / GRAPH_SCALE
    tail = (ax + nx * offset + ux * short, ay + ny * offset + uy * short)
    head = (bx + nx * offset - ux * short, by + ny * offset - uy * short)
    return tail, head


def _label_place(
    tail: Point,
    head: Point,
    size: tuple[float, float],
    arrows: list[tuple[Point, Point]],
    taken: list[Box],
) -> Point | None:
    """The centre of an arrow's label, on the arrow, as near its middle as
    a place leaves some of the arrow in view at both ends and covers no
    other arrow and nothing `taken`; None where there is none."""
    width, height = size
    (ax, ay), (bx, by) = tail, head
    length = math.hypot(bx - ax, by - ay) or 1.0
    ux, uy = (bx - ax) / length, (by - ay) / length
    # How far the label reaches along its arrow either side of its centre.
    reach = abs(ux) * width / 2 + abs(uy) * height / 2 + ARROW_SHOWN
    for along in LABEL_ALONG:
        if min(along, 1 - along) * length < reach:
            continue
        x, y = ax + (bx - ax) * along, ay + (by - ay) * along
        box = Box.around(x, y, width, height)
        if not any(box.crosses(a, b) for a, b in arrows) and not any(
            box.overlaps(other) for other in taken
        ):
            return x, y
    return None


def _outside(centre: Point) -> str:
    """Where a process's name goes: outside the circle, where no arrow is."""
    x, y = centre
    if abs(y) > abs(x):
        return "top center" if y > 0 else "bottom center"
    return "middle right" if x > 0 else "middle left"


def _node_boxes(centre: Point, label: str, position: str) -> list[Box]:
    """Where a process is drawn: its marker, and its name beside it."""
    x, y = centre
    radius = (NODE_MARKER + GRAPH_PAD) / GRAPH_SCALE
    width, height = text_size(label)
    if position.startswith("top"):
        name = Box(x - width / 2, y + radius, x + width / 2, y + radius + height)
    elif position.startswith("bottom"):
        name = Box(x - width / 2, y - radius - height, x + width / 2, y - radius)
    elif position.endswith("right"):
        name = Box(x + radius, y - height / 2, x + radius + width, y + height / 2)
    else:
        name = Box(x - radius - width, y - height / 2, x - radius, y + height / 2)
    return [Box(x - radius, y - radius, x + radius, y + radius), name]


def _edge_label(wait: Any) -> str:
    """The lock and what it is on (without the database, which the hover
    and the table below give), wrapped; who holds it (a transaction's lock
    is its own process's); how long the wait was seen."""
    locked = DATABASE_SUFFIX.sub("", wait.locked) or wait.lock_type
    lines = textwrap.wrap(f"{wait.mode} on {locked}", GRAPH_LABEL_CHARS)
    holder = f"process {wait.blocker_pid}" + (
        f" · run {wait.blocker_run_id}" if wait.blocker_run_id else ""
    )
    lines.append(f"held by {holder}")
    if wait.waited_ms:
        lines.append(f"seen {human_duration(wait.waited_ms / 1000)}")
    return "<br>".join(inert(line) for line in lines if line)


def gaps_over_time(gaps: Iterable[tuple[str, str, int]]) -> dict[str, Any]:
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
    return figure.to_dict()


def _vertical(figure: go.Figure, mark: Mark, x: float, level: int) -> None:
    """A vertical line at `mark` (at `x` on the axis), its label above the
    plot at one of LABEL_LEVELS heights, so that labels of close moments do
    not overlap; its hover says when."""
    figure.add_vline(x=x, line={"color": mark.colour, "dash": "dot", "width": 1})
    figure.add_annotation(
        x=x,
        y=1,
        yref="paper",
        yanchor="bottom",
        yshift=2 + 16 * level,
        text=mark.label,
        hovertext=f"{_clock(mark.at)}: {mark.hover or mark.label}",
        showarrow=False,
        font={"size": 10, "color": mark.colour},
    )


def _node_label(role: str, pid: int, run_id: int | None) -> str:
    return inert(f"{role or 'process'} {pid}" + (f" · run {run_id}" if run_id else ""))


def _queries(waits: list, pid: int) -> str:
    for wait in waits:
        if wait.waiter_pid == pid and wait.waiter_query:
            return inert(wait.waiter_query[:300])
        if wait.blocker_pid == pid and wait.blocker_query:
            return inert(wait.blocker_query[:300])
    return f"process {pid}"

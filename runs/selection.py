"""Which runs a runs-list filter selects: the runs list's query string
(agent, status, unknown, gaps, drills, q, label, time, from, to) read into
a `RunFilter`, and the
filter applied to runs.  The runs list shows what it selects a page at a
time; a bulk job (runs/bulk.py) acts on all of it, from the page or from
`manage.py runs bulk --filter`: the same reading, the same rows."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field, fields

from django.conf import settings
from django.core.exceptions import BadRequest
from django.http import QueryDict
from django.utils.http import urlencode

from runs import finding, query_string
from runs.models import Run, RunQuerySet, RunStatus

# The status filter's extra value: completed runs whose answer leaves work
# out (Run.objects.completed_with_gaps()), listed after completed.
GAPS_FILTER = "completed_with_gaps"
STATUS_VALUES = list(RunStatus.values)
STATUS_VALUES.insert(STATUS_VALUES.index(RunStatus.COMPLETED) + 1, GAPS_FILTER)
# What the runs list's query string may hold besides its filters: where a
# page starts and how it is sorted (a bulk job acts on every page).
PAGING = ("before", "sort")
# The query string's names of the fields that are Python words.
PARAMETERS = {"since": "from", "until": "to"}


@dataclass(frozen=True)
class RunFilter:
    agent: str = ""
    status: str = ""
    unknown: bool = False
    gaps: bool = False
    drills: bool = False
    q: str = ""
    # Labels the runs carry, every one (`label=key=value`, repeatable).
    label: dict[str, str] = field(default_factory=dict)
    # A range of one of the runs' times (finding.TIMES): from `since`, before `until`.
    time: str = "created"
    since: dt.datetime | None = None
    until: dt.datetime | None = None

    def select(self, runs: RunQuerySet) -> RunQuerySet:
        # Drills' runs (runs/drills.py) are selected only when asked for, alone.
        runs = runs.filter(is_drill=self.drills)
        if self.agent:
            runs = runs.filter(agent=self.agent)
        if self.status == GAPS_FILTER:
            runs = runs.completed_with_gaps()
        elif self.status:
            runs = runs.filter(status=self.status)
        if self.unknown:
            runs = runs.with_open_unknowns()
        if self.gaps:
            runs = runs.with_capture_gaps()
        if self.q:
            runs = finding.matching(runs, self.q)
        runs = finding.labelled(runs, self.label)
        return finding.between(runs, self.time, self.since, self.until)

    def query(self) -> str:
        """The filter as the runs list's query string, its defaults left out."""
        given: list[tuple[str, str]] = []
        for each in fields(self):
            value = getattr(self, each.name)
            if value == getattr(RunFilter(), each.name):
                continue
            name = PARAMETERS.get(each.name, each.name)
            if isinstance(value, dict):
                given += [(name, f"{key}={label}") for key, label in value.items()]
            elif isinstance(value, dt.datetime):
                given.append((name, value.isoformat()))
            else:
                given.append((name, "1" if value is True else value))
        return urlencode(given)


def read(query: QueryDict) -> RunFilter:
    """The runs list's filters in `query`; BadRequest, saying what, for a
    value the list cannot use.  Other parameters are left alone, as the
    page leaves them (links carry any)."""
    try:
        labels = finding.parse_labels([value for value in query.getlist("label") if value.strip()])
    except ValueError as error:
        raise BadRequest(str(error)) from None
    return RunFilter(
        agent=_agent(query),
        status=query_string.choice(query, "status", STATUS_VALUES),
        unknown=query_string.flag(query, "unknown"),
        gaps=query_string.flag(query, "gaps"),
        drills=query_string.flag(query, "drills"),
        q=query_string.search(query),
        label=labels,
        time=query_string.choice(query, "time", list(finding.TIMES)) or "created",
        since=query_string.moment(query, "from"),
        until=query_string.moment(query, "to"),
    )


def parse(text: str) -> RunFilter:
    """A filter written out (`status=needs_operator&agent=support`), as a
    bulk job is given one: as the runs list reads it, and a parameter that
    is none of its filters is refused (a misspelt filter would select every
    run)."""
    query = QueryDict(text.strip().lstrip("?"))
    known = {PARAMETERS.get(each.name, each.name) for each in fields(RunFilter)}
    if unknown := sorted(set(query) - known - set(PAGING)):
        raise BadRequest(
            f"{', '.join(map(query_string.quoted, unknown))} is no filter of the runs list: "
            f"it takes {', '.join(sorted(known))}"
        )
    return read(query)


def _agent(query: QueryDict) -> str:
    """The agent: one installed here, or one no longer installed whose runs
    are still here (named as its runs record it)."""
    named = query.get("agent", "").strip()
    if named and named not in settings.RUNDESK_AGENTS and Run.objects.filter(agent=named).exists():
        return named
    return query_string.choice(query, "agent", sorted(settings.RUNDESK_AGENTS))

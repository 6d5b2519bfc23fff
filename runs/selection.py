"""Which runs a runs-list filter selects: the runs list's query string
(agent, status, unknown, gaps, drills, q) read into a `RunFilter`, and the
filter applied to runs.  The runs list shows what it selects a page at a
time; a bulk job (runs/bulk.py) acts on all of it, from the page or from
`manage.py runs bulk --filter`: the same reading, the same rows."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

from django.conf import settings
from django.core.exceptions import BadRequest
from django.http import QueryDict
from django.utils.http import urlencode

from runs import query_string
from runs.models import Run, RunQuerySet, RunStatus

# The status filter's extra value: completed runs whose answer leaves work
# out (Run.objects.completed_with_gaps()), listed after completed.
GAPS_FILTER = "completed_with_gaps"
STATUS_VALUES = list(RunStatus.values)
STATUS_VALUES.insert(STATUS_VALUES.index(RunStatus.COMPLETED) + 1, GAPS_FILTER)
# What the runs list's query string may hold besides its filters: where a
# page starts (a bulk job acts on every page).
PAGING = ("before",)


@dataclass(frozen=True)
class RunFilter:
    agent: str = ""
    status: str = ""
    unknown: bool = False
    gaps: bool = False
    drills: bool = False
    q: str = ""

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
            runs = runs.filter(question__icontains=self.q)
        return runs

    @property
    def narrows(self) -> bool:
        """Whether it selects fewer runs than all of this installation's
        (drills' runs aside)."""
        return self != RunFilter()

    def query(self) -> str:
        """The filter as the runs list's query string, its defaults left out."""
        default = RunFilter()
        return urlencode(
            {
                name: ("1" if value is True else value)
                for name, value in asdict(self).items()
                if value != getattr(default, name)
            }
        )


def read(query: Mapping[str, str]) -> RunFilter:
    """The runs list's filters in `query`; BadRequest, saying what, for a
    value the list cannot use.  Other parameters are left alone, as the
    page leaves them (links carry any)."""
    return RunFilter(
        agent=_agent(query),
        status=query_string.choice(query, "status", STATUS_VALUES),
        unknown=query_string.flag(query, "unknown"),
        gaps=query_string.flag(query, "gaps"),
        drills=query_string.flag(query, "drills"),
        q=query_string.search(query),
    )


def parse(text: str) -> RunFilter:
    """A filter written out (`status=needs_operator&agent=support`), as a
    bulk job is given one: as the runs list reads it, and a parameter that
    is none of its filters is refused (a misspelt filter would select every
    run)."""
    query = QueryDict(text.strip().lstrip("?"))
    known = {field.name for field in fields(RunFilter)}
    if unknown := sorted(set(query) - known - set(PAGING)):
        raise BadRequest(
            f"{', '.join(map(query_string.quoted, unknown))} is no filter of the runs list: "
            f"it takes {', '.join(sorted(known))}"
        )
    return read(query)


def _agent(query: Mapping[str, str]) -> str:
    """The agent: one installed here, or one no longer installed whose runs
    are still here (named as its runs record it)."""
    named = query.get("agent", "").strip()
    if named and named not in settings.RUNDESK_AGENTS and Run.objects.filter(agent=named).exists():
        return named
    return query_string.choice(query, "agent", sorted(settings.RUNDESK_AGENTS))

"""Finding runs: labels given at submission, a text search over questions
and inputs, a time range, and the runs list's sorts with keyset pagination.

Every filter here is served by an index of its own (finding_indexes, in the
Run model's Meta), so a page costs the same at a thousand runs or a
million: the search by a GIN index of the words it reads, labels
by a GIN index of the label object, each sort by a B-tree in its order.
A page after the first starts after the last row of the one before (its
cursor), never at an offset.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from typing import Any

from django.contrib.postgres.indexes import GinIndex
from django.contrib.postgres.search import SearchQuery, SearchVectorField
from django.db import models
from django.db.models import F, Func, Q


class _Searchable(Func):
    """What the search reads: a run's title (its question) and the strings
    of its input (not its keys, which every run has), as words
    (to_tsvector with the 'simple' configuration: no stemming, no stop
    words, any language).  Core PostgreSQL only: the embedded server
    (pgserver) has no pg_trgm."""

    template = "(to_tsvector('simple'::regconfig, %(expressions)s, '[\"string\"]'::jsonb))"
    arg_joiner = ") || jsonb_to_tsvector('simple'::regconfig, "
    output_field = SearchVectorField()


SEARCHABLE = _Searchable(F("question"), F("input"))
# The words of a search: each a prefix of a word of the run's.
SEARCH_WORDS = re.compile(r"\w+")

# A label: a short key and a value, as `submit_run --label key=value` gives it.
LABEL_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-/]{0,62}")
LABEL_VALUE_MAX = 200
LABELS_MAX = 20


def finding_indexes() -> list[models.Index]:
    return [
        # The runs list's search (?q=): SEARCHABLE @@ to_tsquery(...).
        GinIndex(SEARCHABLE, name="run_search_idx"),
        # ?label=key=value: labels @> '{"key": "value"}'.
        GinIndex(fields=["labels"], opclasses=["jsonb_path_ops"], name="run_labels_idx"),
        *(index for time in ("started", "finished") for index in _sort_indexes(time)),
    ]


def _sort_indexes(time: str) -> list[models.Index]:
    """The sorts by start or by end (SORTS), both directions: the runs that
    have the time in its order (the end's is also the summaries' cursor
    over finished runs, runs/summaries.py), then those without it yet,
    newest first."""
    column = f"{time}_at"
    return [
        models.Index(
            fields=[column, "id"],
            condition=Q(**{f"{column}__isnull": False}),
            name=f"run_{time}_idx",
        ),
        models.Index(
            fields=["-created_at", "-id"],
            condition=Q(**{f"{column}__isnull": True}),
            name=f"run_un{time}_idx",
        ),
    ]


def parse_label(given: str) -> tuple[str, str]:
    """`key=value` as a label; ValueError saying what is wrong."""
    key, equals, value = given.partition("=")
    key, value = key.strip(), value.strip()
    if not equals or not key:
        raise ValueError(f"label {given!r} is not key=value")
    if not LABEL_KEY.fullmatch(key):
        raise ValueError(
            f"label key {key!r}: letters, digits and _ . - / only, at most 63, "
            "starting with a letter or digit"
        )
    if not value or len(value) > LABEL_VALUE_MAX or "\x00" in value:
        raise ValueError(f"label {key}: its value must be 1 to {LABEL_VALUE_MAX} characters")
    return key, value


def parse_labels(given: list[str]) -> dict[str, str]:
    """Several `key=value` labels; a key given twice is refused."""
    labels: dict[str, str] = {}
    for one in given:
        key, value = parse_label(one)
        if key in labels and labels[key] != value:
            raise ValueError(f"label {key} is given twice, with different values")
        labels[key] = value
    if len(labels) > LABELS_MAX:
        raise ValueError(f"{len(labels)} labels: at most {LABELS_MAX}")
    return labels


def matching(rows: models.QuerySet, text: str) -> models.QuerySet:
    """Runs whose question or input has a word starting with each word of
    `text`, in any case ("fund" finds "funds", "Northwind" finds
    "northwind-clean-energy.md").  Served by run_search_idx.  A text with
    no word (punctuation only) finds nothing."""
    words = SEARCH_WORDS.findall(text)
    if not words:
        return rows.none()
    # Each word quoted as a tsquery lexeme, a prefix (:*): no character of
    # the text is read as tsquery syntax.
    query = " & ".join("'" + word.replace("'", "''") + "':*" for word in words)
    return rows.alias(searchable=SEARCHABLE).filter(
        searchable=SearchQuery(query, config="simple", search_type="raw")
    )


def labelled(rows: models.QuerySet, labels: dict[str, str]) -> models.QuerySet:
    """Runs that carry every one of `labels`."""
    return rows.filter(labels__contains=labels) if labels else rows


# The times a range filters on (?time=), by the column that holds them.
TIMES = {"created": "created_at", "started": "started_at", "finished": "finished_at"}


def between(
    rows: models.QuerySet, time: str, since: dt.datetime | None, until: dt.datetime | None
) -> models.QuerySet:
    """Runs whose `time` (TIMES) is at or after `since` and before `until`."""
    column = TIMES[time]
    if since is not None:
        rows = rows.filter(**{f"{column}__gte": since})
    if until is not None:
        rows = rows.filter(**{f"{column}__lt": until})
    return rows


# -- sorts and their pages ------------------------------------------------------------


@dataclass(frozen=True)
class Sort:
    """An order of the runs list: its keys, each a column and whether it is
    descending, then the id in the last key's direction (ties).  A sort by
    a column a run may not have yet (a start, an end) lists the runs that
    have it first, then the others newest first (`nullable`)."""

    name: str  # as the query string says it (?sort=)
    words: str
    keys: tuple[tuple[str, bool], ...]
    nullable: bool = False

    def order(self) -> list[str]:
        last = self.keys[-1][1]
        return [("-" if desc else "") + column for column, desc in self.keys] + [
            "-id" if last else "id"
        ]


NEWEST = Sort("-created", "newest first", (("created_at", True),))
# The second part of a nullable sort: the runs without its column.
_REST = NEWEST
SORTS = {
    sort.name: sort
    for sort in [
        NEWEST,
        Sort("created", "oldest first", (("created_at", False),)),
        Sort("-started", "started, latest first", (("started_at", True),), nullable=True),
        Sort("started", "started, earliest first", (("started_at", False),), nullable=True),
        Sort("-finished", "ended, latest first", (("finished_at", True),), nullable=True),
        Sort("finished", "ended, earliest first", (("finished_at", False),), nullable=True),
        # run_status_listing_idx's order.
        Sort("status", "by status, newest first", (("status", False), ("created_at", True))),
    ]
}


# The columns the sorts read (their keys), for a page's query.
SORT_COLUMNS = ("created_at", "started_at", "finished_at", "status")


def in_page(columns: models.QuerySet, page: list[Any]) -> list[Any]:
    """The rows of `page` as `columns` reads them (a list's columns),
    in the page's order: worked out for those rows alone."""
    found = columns.in_bulk([row.pk for row in page])
    return [found[row.pk] for row in page if row.pk in found]


def cursor_of(row: Any, sort: Sort) -> str:
    """Where a page in `sort`'s order stops: the next starts after `row`.
    A nullable sort's row without the column is in the second part: its
    cursor starts with an empty value and goes on with _REST's keys."""
    if sort.nullable and getattr(row, sort.keys[0][0]) is None:
        return "|" + _values(row, _REST)
    return _values(row, sort)


def _values(row: Any, sort: Sort) -> str:
    parts = []
    for column, _ in sort.keys:
        value = getattr(row, column)
        parts.append(value.isoformat() if isinstance(value, dt.datetime) else str(value))
    return "|".join([*parts, str(row.pk)])


def _read(parts: list[str], sort: Sort) -> list[Any]:
    """The key values and id a cursor names; ValueError when it is not one
    of `sort`'s."""
    if len(parts) != len(sort.keys) + 1:
        raise ValueError("wrong number of parts")
    values: list[Any] = []
    for (column, _), part in zip(sort.keys, parts, strict=False):
        if column.endswith("_at"):
            moment = dt.datetime.fromisoformat(part)
            if moment.tzinfo is None:
                moment = moment.replace(tzinfo=dt.UTC)
            values.append(moment.astimezone(dt.UTC))
        else:
            values.append(part)
    values.append(int(parts[-1]))
    return values


def _after(rows: models.QuerySet, sort: Sort, values: list[Any]) -> models.QuerySet:
    """The rows after `values` in `sort`'s order (lexicographic).  The
    first filter bounds the first key, which the sort's index serves as
    its range; the second sorts out the ties."""
    keys = [*sort.keys, ("id", sort.keys[-1][1])]

    def beyond(column: str, desc: bool, value: Any) -> Q:
        return Q(**{f"{column}__{'lt' if desc else 'gt'}": value})

    later = Q(pk__in=[])
    for j, (column, desc) in enumerate(keys):
        same = Q(**{column: value for (column, _), value in zip(keys[:j], values, strict=False)})
        later |= same & beyond(column, desc, values[j])
    first, desc = keys[0]
    return rows.filter(**{f"{first}__{'lte' if desc else 'gte'}": values[0]}).filter(later)


def page(rows: models.QuerySet, sort: Sort, cursor: str, size: int) -> tuple[list[Any], str]:
    """A page of `rows` in `sort`'s order after `cursor` (cursor_of; "" for
    the first page), and the cursor of the next page ("" when this is the
    last); ValueError when the cursor is not one of this sort's."""
    parts = cursor.split("|") if cursor else []
    try:
        if sort.nullable and parts and parts[0] == "":
            rest_after = _read(parts[1:], _REST)
            return _page_of(_rest_rows(rows, sort), _REST, rest_after, size, sort)
        after = _read(parts, sort) if parts else None
    except (ValueError, OverflowError):
        raise ValueError(f"not a page cursor: {cursor!r} (sort {sort.name})") from None
    column = sort.keys[0][0]
    present = rows.filter(**{f"{column}__isnull": False}) if sort.nullable else rows
    found, following = _page_of(present, sort, after, size, sort)
    if not sort.nullable or following:
        return found, following
    # The runs with the column come first; the page goes on with those without.
    rest = _rest_rows(rows, sort)
    if len(found) == size:
        return found, cursor_of(found[-1], sort) if rest.exists() else ""
    more, following = _page_of(rest, _REST, None, size - len(found), sort)
    return found + more, following


def _rest_rows(rows: models.QuerySet, sort: Sort) -> models.QuerySet:
    return rows.filter(**{f"{sort.keys[0][0]}__isnull": True})


def _page_of(
    rows: models.QuerySet, order: Sort, after: list[Any] | None, size: int, sort: Sort
) -> tuple[list[Any], str]:
    if after is not None:
        rows = _after(rows, order, after)
    found = list(rows.order_by(*order.order())[: size + 1])
    if len(found) <= size:
        return found, ""
    return found[:size], cursor_of(found[size - 1], sort)

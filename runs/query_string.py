"""Reading a query string's parameters as a person would mean them where
that is harmless (a status written in capitals, `true` for a ticked box),
and refusing, saying what was not understood, where it is not.  The list
pages read their parameters through these (dashboard/params.py), and so do
the selections of a bulk job (runs/selection.py), from a page or from the
command line: one reading, one set of refusals."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence

from django.core.exceptions import BadRequest

# The longest search a list page takes, in characters; the search box says
# it (maxlength), so a browser never sends more.  At 9 bytes a character
# percent-encoded (a 3-byte UTF-8 character: %E6%97%A5), it keeps the
# request line far inside gunicorn's limit (dashboard/gunicorn.py).
SEARCH_MAX = 200
# How much of a refused value a refusal quotes.
QUOTED = 60
YES = ("1", "true", "yes", "on")
NO = ("0", "false", "no", "off")


def choice(query: Mapping[str, str], name: str, choices: Sequence[str]) -> str:
    """The parameter `name` as one of `choices` (in any case), "" when
    absent or empty; BadRequest when it is none of them."""
    value = query.get(name, "").strip()
    if not value:
        return ""
    for known in choices:
        if known.casefold() == value.casefold():
            return known
    raise BadRequest(f"{name}={quoted(value)} is not one of: {', '.join(choices)}")


def flag(query: Mapping[str, str], name: str) -> bool:
    """A ticked box's parameter: 1 (or true, yes, on, in any case) or 0
    (false, no, off) or absent."""
    value = query.get(name, "").strip()
    if value.casefold() in YES:
        return True
    if not value or value.casefold() in NO:
        return False
    raise BadRequest(
        f"{name}={quoted(value)} is neither 1 (or true, yes, on) nor 0 (or false, no, off)"
    )


def search(query: Mapping[str, str], name: str = "q") -> str:
    """A search's text, no longer than SEARCH_MAX characters."""
    value = query.get(name, "").strip()
    if len(value) > SEARCH_MAX:
        raise BadRequest(
            f"the search ({name}) is {len(value)} characters long: "
            f"at most {SEARCH_MAX} are searched"
        )
    return value


def quoted(value: str) -> str:
    """`value` as a refusal quotes it: its start, where it is long."""
    return repr(value if len(value) <= QUOTED else f"{value[:QUOTED]}…")


def moment(query: Mapping[str, str], name: str) -> dt.datetime | None:
    """An instant: an ISO date or date and time (a browser's
    datetime-local), in UTC unless it names its offset; None when absent."""
    value = query.get(name, "").strip()
    if not value:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        raise BadRequest(
            f"{name}={quoted(value)} is not a date or a time (e.g. 2026-12-06 or 2026-12-06T14:30)"
        ) from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)

"""The query parameters the list pages take (filters, a search, a page
cursor), read as a person would mean them where that is harmless (a status
written in capitals, `true` for a ticked box), and refused, saying what was
not understood, where it is not: a page never shows rows that quietly
ignored a filter (security.rejects_bad_input answers the refusal in the
site's layout).  A parameter no page takes is left alone, as links carry
any.  The reading itself is runs/query_string.py's (the bulk
selections read the runs list's query string through it too)."""

from __future__ import annotations

from collections.abc import Sequence

from django.http import HttpRequest

from runs import query_string
from runs.query_string import SEARCH_MAX, quoted

__all__ = ["SEARCH_MAX", "choice", "flag", "quoted", "search"]


def choice(request: HttpRequest, name: str, choices: Sequence[str]) -> str:
    """The query parameter `name` as one of `choices` (in any case), ""
    when absent or empty; BadRequest when it is none of them."""
    return query_string.choice(request.GET, name, choices)


def flag(request: HttpRequest, name: str) -> bool:
    """A ticked box's parameter: 1 (or true, yes, on, in any case) or 0
    (false, no, off) or absent."""
    return query_string.flag(request.GET, name)


def search(request: HttpRequest, name: str = "q") -> str:
    """A search's text, no longer than SEARCH_MAX characters."""
    return query_string.search(request.GET, name)

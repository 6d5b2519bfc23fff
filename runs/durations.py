"""Durations as people write them on a command line or in a setting:
`90d`, `12h`, `30m`, `2w`, `45s`, or ISO 8601 (`P30D`, `PT12H`).

Below Django's models, so that settings.py can read one
(RUNDESK_PURGE_AFTER) before any app is loaded."""

from __future__ import annotations

import datetime as dt
import re

from django.utils.dateparse import parse_duration

_SHORT = re.compile(r"(\d+)\s*([smhdw])")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse(text: str) -> dt.timedelta:
    """The duration `text` says, longer than zero; ValueError saying what a
    duration looks like when it is not one (or is zero or negative)."""
    written = text.strip().lower()
    if match := _SHORT.fullmatch(written):
        amount, unit = match.groups()
        try:
            duration = dt.timedelta(**{_UNITS[unit]: int(amount)})
        except OverflowError:
            raise ValueError(f"{text!r} is longer than any date can be") from None
    else:
        duration = parse_duration(text.strip()) if written.startswith("p") else None
        if duration is None:
            raise ValueError(
                f"{text!r} is not a duration: write a number and a unit (45s, 30m, 12h, 90d, "
                "2w) or ISO 8601 (P90D)"
            )
    if duration <= dt.timedelta(0):
        raise ValueError(f"{text!r}: a duration must be longer than zero")
    return duration

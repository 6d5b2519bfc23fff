"""The server's messages in English and in every language of the generated
catalog (evidence/pglog_catalog.py), compiled once: what a line of a log
says, whatever `lc_messages` the server had."""

from __future__ import annotations

import re
from functools import cache

from evidence import pglog_catalog, pglog_po

MESSAGES = {message.name: message for message in pglog_po.MESSAGES}
# A letter no ASCII text holds, in a form of the catalog (its regexes are
# ASCII but for the translation's own letters).
NOT_ASCII = re.compile(r"[^\x00-\x7f]")
ASCII_LETTER = re.compile(r"[A-Za-z]")
# What of a regex is syntax, not the message's words.
SYNTAX = re.compile(r"\(\?P<\w+>|\\.|\[(?:\\.|[^\]])*\]|\{\d*,?\d*\}")


def _forms(name: str) -> list[str]:
    """The regexes of message `name`, in every language of the catalog.  A
    server whose database is SQL_ASCII writes each letter of a translation
    that ASCII does not hold as "?" (glibc's gettext in the C locale:
    "d?tect?"): in a form of three ASCII letters or more to each other one
    (French, German, Spanish...), each such letter matches itself or "?".
    Another is not widened: a word of "?" alone could be any word of its
    length (Korean, Japanese; a Russian server's log is transliterated
    instead, "OSHIBKA": not read either)."""
    forms = []
    for regexes in pglog_catalog.MESSAGES.get(name, {}).values():
        for regex in regexes:
            others = len(NOT_ASCII.findall(regex))
            if others and 3 * others <= len(ASCII_LETTER.findall(SYNTAX.sub("", regex))):
                regex = NOT_ASCII.sub(lambda letter: f"[{letter[0]}?]", regex)
            forms.append(regex)
    return forms


@cache
def _patterns(name: str) -> tuple[re.Pattern[str], ...]:
    return tuple(re.compile(regex) for regex in _forms(name))


def find(name: str, text: str) -> re.Match[str] | None:
    """The leftmost place where `text` says message `name`, in any language."""
    found = [match for pattern in _patterns(name) if (match := pattern.search(text))]
    return min(found, key=lambda match: match.start(), default=None)


def starts(name: str, text: str) -> re.Match[str] | None:
    """`text` begins with message `name`, in any language."""
    return next((m for pattern in _patterns(name) if (m := pattern.match(text))), None)


def whole(name: str, text: str) -> re.Match[str] | None:
    """`text` is message `name`, in any language."""
    return next((m for pattern in _patterns(name) if (m := pattern.fullmatch(text))), None)


def find_all(name: str, text: str) -> list[re.Match[str]]:
    """Every place `text` says message `name`, left to right, in any language."""
    found = sorted(
        (match for pattern in _patterns(name) for match in pattern.finditer(text)),
        key=lambda match: match.start(),
    )
    kept: list[re.Match[str]] = []
    for match in found:
        if not kept or match.start() >= kept[-1].end():
            kept.append(match)
    return kept


def names(prefix: str) -> list[str]:
    """The messages whose name starts with `prefix` ("lock:", "lock_wait:")."""
    return [name for name in MESSAGES if name.startswith(prefix)]


def english(name: str, match: re.Match[str]) -> str:
    """What the message `match` read says, in English: one vocabulary for
    logs of every language.  Its arguments are numbers (a lock's)."""
    message = MESSAGES[name]
    return message.msgid % tuple(int(match[arg]) for arg in message.args)


def describe_lock(text: str) -> tuple[str, str] | None:
    """What a lock is on, as DescribeLockTag() wrote it in any language:
    ("tuple", "tuple (0,7) of relation 16402 of database 16384")."""
    for name in names("lock:"):
        if match := whole(name, text.strip()):
            return name.removeprefix("lock:"), english(name, match)
    return None


@cache
def label_pattern() -> re.Pattern[str]:
    """A severity ("ERROR:  ", "FEHLER:  ") or a field label ("DETAIL:  ",
    "TIPP:  ") where a log line's prefix ends, in any language; the group
    that matched is named for it (s_ERROR, l_DETAIL)."""
    groups = []
    for name in names("severity:") + names("label:"):
        kind, word = name.split(":")
        forms = sorted(set(_forms(name)), key=len, reverse=True)
        colon = r":\s+" if kind == "severity" else r"(?:\s+|$)"
        groups.append(f"(?P<{kind[0]}_{word}>(?:{'|'.join(forms)}){colon})")
    return re.compile(rf"(?<!\w)(?:{'|'.join(groups)})")

"""PostgreSQL's message catalogs, read into the table evidence/pglog_catalog.py
holds.

A server with a non-English `lc_messages` writes its log in that language:
the severities (FEHLER, ERREUR, ОШИБКА), the labels of a report's fields
(DETAIL, TIPP, ZUSAMMENHANG) and the messages themselves ("Verklemmung
(Deadlock) entdeckt", "Prozess %d wartet auf %s-Sperre auf %s; blockiert von
Prozess %d.").  Lock modes (ShareLock) are never translated.  The
translations come from the server's own catalogs, src/backend/po/<lang>.po:
`manage.py pglog_catalog` reads them and writes one regular expression per
message and language, each placeholder a named group (named for what it is:
`waiter`, `mode`, `lock`...), so that a translation that reorders its
arguments (`%2$s ... %1$d`) is read like any other.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Message:
    """A message of the server, by the name the report reader knows it by."""

    name: str
    msgid: str
    # What each placeholder stands for, in the msgid's order.
    args: tuple[str, ...] = ()
    plural: str = ""


SEVERITIES = ("DEBUG", "LOG", "INFO", "NOTICE", "WARNING", "ERROR", "FATAL", "PANIC")
# The fields of a report, as utils/error/elog.c labels them in a log line.
LABELS = ("DETAIL:  ", "HINT:  ", "QUERY:  ", "CONTEXT:  ", "LOCATION:  %s:%d\n", "STATEMENT:  ")
LOCK_WAIT = ("%s on %s after %ld.%03d ms", ("pid", "mode", "lock", "ms", "ms_fraction"))

MESSAGES: list[Message] = [
    # utils/error/elog.c
    *(Message(f"severity:{word}", word) for word in SEVERITIES),
    *(Message(f"label:{label.split(':')[0]}", label) for label in LABELS),
    # storage/lmgr/deadlock.c
    Message("deadlock", "deadlock detected"),
    Message(
        "waits",
        "Process %d waits for %s on %s; blocked by process %d.",
        ("waiter", "mode", "lock", "blocker"),
    ),
    Message("process_query", "Process %d: %s", ("pid", "query")),
    # storage/lmgr/lmgr.c, DescribeLockTag(): what a lock is on
    Message("lock:relation", "relation %u of database %u", ("relation", "database")),
    Message(
        "lock:extension",
        "extension of relation %u of database %u",
        ("relation", "database"),
    ),
    Message("lock:frozen ids", "pg_database.datfrozenxid of database %u", ("database",)),
    Message(
        "lock:page",
        "page %u of relation %u of database %u",
        ("page", "relation", "database"),
    ),
    Message(
        "lock:tuple",
        "tuple (%u,%u) of relation %u of database %u",
        ("page", "item", "relation", "database"),
    ),
    Message("lock:transaction", "transaction %u", ("xid",)),
    Message("lock:virtual transaction", "virtual transaction %d/%u", ("backend", "local_xid")),
    Message(
        "lock:speculative token",
        "speculative token %u of transaction %u",
        ("token", "xid"),
    ),
    Message(
        "lock:object",
        "object %u of class %u of database %u",
        ("object", "class", "database"),
    ),
    Message("lock:user lock", "user lock [%u,%u,%u]", ("key1", "key2", "key3")),
    Message(
        "lock:advisory",
        "advisory lock [%u,%u,%u,%u]",
        ("database", "key1", "key2", "kind"),
    ),
    Message(
        "lock:remote transaction",
        "remote transaction %u of subscription %u of database %u",
        ("xid", "subscription", "database"),
    ),
    Message("lock:unrecognized", "unrecognized locktag type %d", ("type",)),
    # storage/lmgr/proc.c: log_lock_waits
    Message(
        "lock_wait:still waiting",
        f"process %d still waiting for {LOCK_WAIT[0]}",
        LOCK_WAIT[1],
    ),
    Message(
        "lock_wait:detected deadlock",
        f"process %d detected deadlock while waiting for {LOCK_WAIT[0]}",
        LOCK_WAIT[1],
    ),
    Message(
        "lock_wait:avoided deadlock",
        "process %d avoided deadlock for %s on %s by rearranging queue order after %ld.%03d ms",
        LOCK_WAIT[1],
    ),
    Message("lock_wait:acquired", f"process %d acquired {LOCK_WAIT[0]}", LOCK_WAIT[1]),
    Message("lock_wait:failed", f"process %d failed to acquire {LOCK_WAIT[0]}", LOCK_WAIT[1]),
    Message(
        "holders",
        "Process holding the lock: %s. Wait queue: %s.",
        ("holders", "queue"),
        plural="Processes holding the lock: %s. Wait queue: %s.",
    ),
]

# What an argument looks like when its conversion says less: a lock mode is
# a word (never translated), what a lock is on is a short phrase (bounded,
# so that a crafted line costs no more than a few times its length), a list
# of pids is digits and commas, the query at the end of a line is the rest.
ARG_PATTERNS = {
    "mode": r"[A-Za-z]+",
    "lock": r".{1,300}?",
    "query": r".*",
    "holders": r"\d+(?:,\s*\d+)*",
    "queue": r"\d*(?:,\s*\d+)*",
}
CONVERSIONS = {"d": r"-?\d+", "i": r"-?\d+", "u": r"\d+", "x": r"[0-9a-fA-F]+", "c": r"."}
PLACEHOLDER = re.compile(
    r"%(?:(?P<position>\d+)\$)?[-+ #0]*\d*(?:\.\d+)?(?:hh|h|ll|l|L|z|j|t)?(?P<conversion>[a-zA-Z%])"
)


class CatalogError(ValueError):
    """A .po file, or a message in it, that cannot be read."""


def printf_regex(template: str, args: tuple[str, ...]) -> str:
    """A regular expression matching what printf() makes of `template`,
    each placeholder a group named by `args` (`%2$s` is args[1]).  A run of
    whitespace matches any run of whitespace; a string argument matches as
    little as it can, unless it ends the template."""
    parts: list[str] = []
    position = 0
    end = 0
    for match in PLACEHOLDER.finditer(template):
        parts.extend(_literal(template[end : match.start()]))
        end = match.end()
        conversion = match["conversion"]
        if conversion == "%":
            parts.append("%")
            continue
        position = int(match["position"]) if match["position"] else position + 1
        if position > len(args):
            raise CatalogError(f"{template!r} has more placeholders than {args}")
        name = args[position - 1]
        last = end == len(template.rstrip())
        pattern = ARG_PATTERNS.get(name) or CONVERSIONS.get(conversion)
        if pattern is None:  # %s, %m: text
            pattern = r".*" if last else r".+?"
        parts.append(f"(?P<{name}>{pattern})")
    parts.extend(_literal(template[end:]))
    return "".join(parts)


def _literal(text: str) -> list[str]:
    return [r"\s+" if chunk.isspace() else re.escape(chunk) for chunk in re.split(r"(\s+)", text)]


def message_regex(message: Message, text: str) -> str:
    """The regex of one form of `message` (its msgid or a translation)."""
    if message.name.startswith(("severity:", "label:")):
        # Only the word is matched: a label's own spacing varies with the
        # client that prints it, and LOCATION's arguments are not read.
        return "".join(_literal(text.split("%")[0].strip()))
    return printf_regex(text.rstrip("\n"), message.args)


# -- .po files ------------------------------------------------------------------------


@dataclass
class Catalog:
    """One language's translations: msgid -> its msgstr forms."""

    language: str
    header: dict[str, str] = field(default_factory=dict)
    translations: dict[str, list[str]] = field(default_factory=dict)


PO_KEYWORD = re.compile(r"^(msgctxt|msgid_plural|msgid|msgstr(?:\[\d+\])?)\s+(\".*\")\s*$")


def read_po(language: str, text: str) -> Catalog:
    """The translated, not fuzzy, entries of a .po file."""
    catalog = Catalog(language)
    for entry in _entries(text):
        if "fuzzy" in entry.get("#,", ""):
            continue
        msgid = entry.get("msgid")
        forms = [entry[key] for key in sorted(entry) if key.startswith("msgstr") and entry[key]]
        if msgid is None or not forms or "msgctxt" in entry:
            continue
        if msgid == "":
            catalog.header = dict(
                line.split(": ", 1) for line in forms[0].splitlines() if ": " in line
            )
        else:
            catalog.translations[msgid] = forms
    return catalog


def _entries(text: str) -> Iterable[dict[str, str]]:
    """Each entry of a .po file: its keywords' strings, joined and unescaped,
    and its flags ("#,")."""
    entry: dict[str, str] = {}
    keyword = ""
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped:
            if entry:
                yield entry
            entry, keyword = {}, ""
        elif stripped.startswith("#,"):
            entry["#,"] = entry.get("#,", "") + stripped[2:]
        elif stripped.startswith("#"):
            continue
        elif match := PO_KEYWORD.match(stripped):
            if match[1] in entry and match[1] != keyword:
                yield entry
                entry = {}
            keyword = match[1]
            entry[keyword] = entry.get(keyword, "") + _po_string(match[2], number)
        elif stripped.startswith('"') and keyword:
            entry[keyword] += _po_string(stripped, number)
        else:
            raise CatalogError(f"line {number} is not .po syntax: {stripped[:80]!r}")
    if entry:
        yield entry


def _po_string(quoted: str, number: int) -> str:
    try:
        value = ast.literal_eval(quoted)
    except (ValueError, SyntaxError):
        raise CatalogError(f"line {number} has a malformed string: {quoted[:80]!r}") from None
    if not isinstance(value, str):
        raise CatalogError(f"line {number} is not a string: {quoted[:80]!r}")
    return value


# -- the table ------------------------------------------------------------------------


def build_table(catalogs: list[Catalog]) -> dict[str, dict[str, list[str]]]:
    """message name -> language -> its regexes (English from the msgid)."""
    table: dict[str, dict[str, list[str]]] = {}
    for message in MESSAGES:
        english = [message.msgid, *([message.plural] if message.plural else [])]
        forms = {"en": [message_regex(message, text) for text in english]}
        for catalog in catalogs:
            translated = catalog.translations.get(message.msgid, [])
            regexes = [message_regex(message, text) for text in translated]
            unique = [r for i, r in enumerate(regexes) if r not in regexes[:i]]
            if unique and unique != forms["en"]:
                forms[catalog.language] = unique
        table[message.name] = forms
    return table


def module_text(catalogs: list[Catalog], origin: str) -> str:
    """The source of evidence/pglog_catalog.py."""
    lines = [
        # Long regexes; letters of other alphabets that look like Latin ones.
        "# ruff: noqa: E501, RUF001",
        '"""PostgreSQL\'s messages, as regular expressions, in English and in the',
        "languages of the catalogs below: what a deadlock report and the lock-wait",
        "messages before it look like in a server log of any of them.",
        "",
        "Generated by `python manage.py pglog_catalog` (evidence/pglog_po.py) from",
        f"{origin}.",
        'Do not edit: generate it again."""',
        "",
        "ORIGIN = " + _quoted(origin),
        "# language -> the catalog's Project-Id-Version and PO-Revision-Date",
        "CATALOGS: dict[str, str] = {",
    ]
    for catalog in catalogs:
        version = ", ".join(
            catalog.header[key]
            for key in ("Project-Id-Version", "PO-Revision-Date")
            if key in catalog.header
        )
        lines.append(f"    {_quoted(catalog.language)}: {_quoted(version)},")
    lines += [
        "}",
        "# message -> language -> its forms",
        "MESSAGES: dict[str, dict[str, list[str]]] = {",
    ]
    for name, forms in build_table(catalogs).items():
        lines.append(f"    {_quoted(name)}: {{")
        for language, regexes in forms.items():
            lines.append(f"        {_quoted(language)}: [")
            lines.extend(f"            {_quoted(regex)}," for regex in regexes)
            lines.append("        ],")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _quoted(text: str) -> str:
    """A Python string literal of `text`, quoted as ruff format quotes it."""
    literal = json.dumps(text, ensure_ascii=False)
    if '"' in text and "'" not in text:
        return "'" + literal[1:-1].replace('\\"', '"') + "'"
    return literal

"""Log formats, read into one stream of entries.

An entry is one message of a log or one field of it (the DETAIL, the HINT,
the CONTEXT, the STATEMENT), with the time, pid and application name the
log gives for it.  What the reader of deadlock reports (evidence/pglog.py)
does with them does not depend on where they came from:

- `stderr`: lines, each message's first line after a `log_line_prefix` of
  any shape (or none); its further lines indented by a tab.  Lines a log
  shipper prefixed again (syslog's `[3-2] #011`, journald, docker) are read
  too.  The same reader reads what clients print of the server's error:
  psycopg, SQLAlchemy, JDBC, node-postgres, pgx, Postgrex, the pg gem quote
  it on lines of their own, after a stack-trace or logger prefix, inside
  quotes with `\\n` escapes, or in an application's JSON log lines.
- `csvlog`: one CSV record per message, the fields in its columns.
- `jsonlog` (PostgreSQL 15+): one JSON object per message.
"""

from __future__ import annotations

import codecs
import collections
import csv
import datetime as dt
import functools
import gzip
import io
import itertools
import json
import re
import zlib
import zoneinfo
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from evidence import pglog_messages as messages
from evidence.locks import APPLICATION_NAME

FORMATS = ("auto", "stderr", "csvlog", "jsonlog")
MESSAGE = "MESSAGE"
# Lines longer than this are not searched for report lines (a crafted line
# must not cost more than reading it).
MAX_LINE = 10_000
# A compressed log is read up to this size once decompressed.
MAX_DECOMPRESSED = 256 * 1024 * 1024
GZIP_MAGIC = b"\x1f\x8b"
# What an editor, or a Windows tool, may put before a log's first line.
BOM = "\ufeff"
# A log read from the middle starts inside a record of at most this many
# characters (a csvlog record's longest field, a whole query).
CUT_HEAD = 4 * 1024 * 1024
# Nested quoting is unwrapped this many times at most.
MAX_DEPTH = 3
# A csvlog field holds a whole query (track_activity_query_size is at most 1 MB).
csv.field_size_limit(max(csv.field_size_limit(), CUT_HEAD))


class LogFormatError(ValueError):
    """The input is not in the format it was said, or found, to be in."""


@dataclass(frozen=True)
class LogEntry:
    label: str  # MESSAGE, or the field: DETAIL, HINT, QUERY, CONTEXT, LOCATION, STATEMENT
    text: str
    severity: str = ""  # of a message: ERROR, LOG... ("" when the input does not say)
    time: dt.datetime | None = None
    # Why a time the input gives for the record could not be read.
    time_problem: str = ""
    pid: int | None = None
    application: str = ""
    line: int = 0  # where the record starts in the input
    sqlstate: str = ""  # of a message, where the input says (csvlog, jsonlog, verbose stderr)


def decode(
    raw: bytes, encoding: str = "utf-8", *, limit: int = MAX_DECOMPRESSED
) -> tuple[str, str]:
    """A log's bytes as text (gzip-compressed bytes, as logrotate leaves
    them, decompressed first, up to `limit` bytes: a small file can hold a
    huge one), and a warning when some are not `encoding`: each such
    byte, and NUL (PostgreSQL text cannot hold one), is U+FFFD."""
    if raw[:2] == GZIP_MAGIC:
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(raw)) as compressed:
                raw = compressed.read(limit + 1)
        except (OSError, EOFError, zlib.error) as error:
            raise LogFormatError(f"gzip-compressed, but not readable: {error}") from None
        if len(raw) > limit:
            raise LogFormatError(f"more than {limit} bytes once decompressed")
    encoding = log_encoding(encoding)
    try:
        text, warning = raw.decode(encoding), ""
    except UnicodeDecodeError as error:
        text = raw.decode(encoding, errors="replace")
        warning = (
            f"some bytes are not {encoding} (the first at byte {error.start}) and were read as "
            "U+FFFD: a server writes its log in its database's encoding; name it (import_pg_log "
            "--encoding, the import form's Encoding)"
        )
    return text.replace("\x00", "\ufffd"), warning


# The encodings a server writes its log in (a database's encoding, as
# `SHOW server_encoding` names it), as Python names them.  SQL_ASCII holds
# whatever clients sent: most often UTF-8.  (EUC_TW and MULE_INTERNAL have
# no Python codec.)
SERVER_ENCODINGS = {
    "UTF8": "utf-8", "SQL_ASCII": "utf-8", "LATIN1": "iso8859-1", "LATIN2": "iso8859-2",
    "LATIN3": "iso8859-3", "LATIN4": "iso8859-4", "LATIN5": "iso8859-9", "LATIN6": "iso8859-10",
    "LATIN7": "iso8859-13", "LATIN8": "iso8859-14", "LATIN9": "iso8859-15",
    "LATIN10": "iso8859-16", "ISO_8859_5": "iso8859-5", "ISO_8859_6": "iso8859-6",
    "ISO_8859_7": "iso8859-7", "ISO_8859_8": "iso8859-8", "WIN866": "cp866", "WIN874": "cp874",
    "WIN1250": "cp1250", "WIN1251": "cp1251", "WIN1252": "cp1252", "WIN1253": "cp1253",
    "WIN1254": "cp1254", "WIN1255": "cp1255", "WIN1256": "cp1256", "WIN1257": "cp1257",
    "WIN1258": "cp1258", "KOI8R": "koi8-r", "KOI8U": "koi8-u", "EUC_JP": "euc_jp",
    "EUC_CN": "gb2312", "EUC_KR": "euc_kr", "EUC_JIS_2004": "euc_jis_2004",
    "GB18030": "gb18030",
}  # fmt: skip


def log_encoding(name: str) -> str:
    """The Python codec of a server encoding named as PostgreSQL names it
    (WIN1251) or as Python does (cp1251); no other codec (a log is text
    one of them wrote)."""
    key = name.strip().upper().replace("-", "_")
    if codec := SERVER_ENCODINGS.get(key) or SERVER_ENCODINGS.get(key.replace("_", "")):
        return codec
    try:
        codec = codecs.lookup(name.strip()).name
    except (LookupError, ValueError):
        codec = ""
    if codec and codec in SERVER_ENCODINGS.values():
        return codec
    raise LogFormatError(
        f"{name[:100]!r} is not an encoding a PostgreSQL server writes its log in: "
        f"one of {', '.join(SERVER_ENCODINGS)}, or its Python name (latin-1, cp1251, euc-jp)"
    )


def log_timezone(name: str) -> dt.tzinfo | None:
    """The server's log_timezone named `name` (None: not given)."""
    if not name.strip():
        return None
    try:
        return zoneinfo.ZoneInfo(name.strip())
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise LogFormatError(
            f"log_timezone {name[:100]!r} is not a time zone this server knows "
            "(a name such as Europe/Berlin)"
        ) from None


def lines(text: str) -> list[str]:
    """The lines of a log: ended by a newline (CR LF too) only.  Python's
    own line ends (U+2028, form feed...) may be inside a query."""
    return [line.removesuffix("\r") for line in text.removesuffix("\n").split("\n")] if text else []


def read(text: str, format: str = "auto", zone: dt.tzinfo | None = None) -> Iterator[LogEntry]:
    """The records of `text`, read as `format` (auto: as its content says).
    `zone`: the server's log_timezone, for the times a log writes with an
    abbreviation that names several zones (CST, IST, PST), or with none."""
    text = text.removeprefix(BOM)
    if format == "auto":
        format = detect(text)
    if format == "csvlog":
        return _csv_records(text, zone)
    if format == "jsonlog":
        return _json_records(text, zone)
    if format == "stderr":
        return _TextReader(zone).read(text)
    raise LogFormatError(f"unknown format {format!r}: one of {', '.join(FORMATS)}")


def detect(text: str) -> str:
    """csvlog or jsonlog when the log's first record is one of theirs, else
    stderr (which also reads what applications print).  A log read from
    the middle (`tail -c`, a collector that cuts at a size) starts inside a
    record: then the record after it says."""
    text = text.removeprefix(BOM)
    first, second, *_ = [*_first_lines(text, 2), "", ""]
    entry = _json_line(first)
    # The rest of an entry: no JSON, but its end.
    cut = entry is None and first.rstrip().endswith("}")
    if _is_server_entry(entry) or (cut and _is_server_entry(_json_line(second))):
        return "jsonlog"
    return "csvlog" if _csv_start(text) is not None else "stderr"


def _first_lines(text: str, count: int) -> list[str]:
    """The first `count` lines of `text` that are not blank, whole."""
    found: list[str] = []
    start = 0
    while len(found) < count and start < len(text):
        end = text.find("\n", start)
        end = len(text) if end < 0 else end
        line = text[start:end].removesuffix("\r")
        if line.strip():
            found.append(line)
        start = end + 1
    return found


def _json_line(line: str) -> object:
    """The JSON object `line` holds; None when it holds none."""
    if not line.lstrip().startswith("{"):
        return None
    try:
        return json.loads(line)
    except (ValueError, RecursionError):  # nested deeper than the parser goes
        return None


# -- csvlog and jsonlog ----------------------------------------------------------------

# csvlog's columns (PostgreSQL 13: 24, 14+: 26), named as jsonlog names them.
CSV_COLUMNS = [
    "timestamp",
    "user",
    "dbname",
    "pid",
    "remote_host",
    "session_id",
    "line_num",
    "ps",
    "session_start",
    "vxid",
    "txid",
    "error_severity",
    "state_code",
    "message",
    "detail",
    "hint",
    "internal_query",
    "internal_position",
    "context",
    "statement",
    "cursor_position",
    "location",
    "application_name",
    "backend_type",
    "leader_pid",
    "query_id",
]
CSV_MIN_FIELDS = 23
CSV_START = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:\.\d+)?(?: [^,]*)?,")
# A server entry's fields, and the key an application's JSON gives each.
FIELDS = {
    MESSAGE: ("message", "msg"),
    "DETAIL": ("detail",),
    "HINT": ("hint",),
    "QUERY": ("internal_query", "internalQuery"),
    "CONTEXT": ("context", "where"),
    "STATEMENT": ("statement", "query"),
}
TIME_KEYS = ("timestamp", "time", "ts", "@timestamp", "log_time")


def _csv_records(text: str, zone: dt.tzinfo | None) -> Iterator[LogEntry]:
    """The records of a csvlog.  A short or broken last record is one the
    server is still writing (a log read while in use) when the input ends
    inside it -- within a quoted field's lines, or with no newline after it:
    left out; so is the rest of a record the input starts inside of (a log
    read from the middle).  Any other short record is refused."""
    offset, skipped = _csv_start(text) or (0, 0)
    text = text[offset:]
    lines_read = sum(1 for _ in io.StringIO(text, newline=""))  # as csv counts them
    reader = csv.reader(io.StringIO(text, newline=""))
    ended = 0  # the line the record before ended on
    try:
        for row in reader:
            start = reader.line_num
            if row and len(row) < CSV_MIN_FIELDS:
                if start == lines_read and _cut_short(text, ended):
                    return
                raise LogFormatError(
                    f"csvlog record ending on line {skipped + start} has {len(row)} fields; "
                    f"csvlog records have {CSV_MIN_FIELDS} to {len(CSV_COLUMNS)}"
                )
            if row:
                entry = dict(zip(CSV_COLUMNS, row, strict=False))
                yield from _entry_records(entry, skipped + start, zone)
            ended = start
    except csv.Error as error:
        if reader.line_num == lines_read:
            return
        raise LogFormatError(f"csvlog line {skipped + reader.line_num}: {error}") from None


def _csv_start(text: str) -> tuple[int, int] | None:
    """(where, after how many lines) the first csvlog record starts: on the
    first line; or, when the input starts inside a record, on the first
    line after it that looks like the start of one.  None: no csvlog
    record starts there."""
    offset = 0
    for skipped, line in enumerate(io.StringIO(text[:CUT_HEAD], newline="")):
        if CSV_START.match(line):
            try:
                row = next(csv.reader(io.StringIO(text[offset:], newline="")), [])
            except csv.Error:
                row = []
            if len(row) >= CSV_MIN_FIELDS and _severity(row[11]):
                return offset, skipped
            if skipped:
                return None
        offset += len(line)
    return None


def _cut_short(text: str, ended: int) -> bool:
    """Whether the input ends inside the csvlog record that starts after
    line `ended`: with no newline, or within a quoted field."""
    if not text.endswith("\n"):
        return True
    tail = itertools.islice(io.StringIO(text, newline=""), ended, None)
    return sum(line.count('"') for line in tail) % 2 == 1


def _json_records(text: str, zone: dt.tzinfo | None) -> Iterator[LogEntry]:
    """The records of a jsonlog; an unfinished last line is left out, as
    in a csvlog, and so is a first line the input starts inside of."""
    entries = lines(text)
    for number, line in enumerate(entries, start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError) as error:
            if number == len(entries) and not text.endswith("\n"):
                return
            if number == 1 and detect(text) == "jsonlog":
                continue  # the rest of an entry the input starts inside of
            raise LogFormatError(f"jsonlog line {number} is not JSON: {error}") from None
        if not _is_server_entry(entry):
            raise LogFormatError(
                f"jsonlog line {number} is not a server log entry (no error_severity or message)"
            )
        yield from _entry_records(entry, number, zone)


def _is_server_entry(entry: object) -> bool:
    return isinstance(entry, dict) and "error_severity" in entry and "message" in entry


def _entry_records(
    entry: dict[str, Any],
    line: int,
    zone: dt.tzinfo | None,
    time: tuple[dt.datetime | None, str] = (None, ""),
) -> Iterator[LogEntry]:
    """The records of one message given as named fields: a csvlog or
    jsonlog entry, or an error object in an application's log."""
    stamp = next((entry[key] for key in TIME_KEYS if entry.get(key) not in (None, "")), None)
    when, problem = read_time(stamp, zone) if stamp is not None else time
    pid = entry.get("pid")
    common = {
        "time": when,
        "time_problem": problem,
        # An application's own pid is not a server process.
        "pid": int(pid) if _is_server_entry(entry) and str(pid).isdigit() else None,
        "application": str(entry.get("application_name") or ""),
        "line": line,
    }
    severity = _severity(str(entry.get("error_severity") or entry.get("severity") or ""))
    # A server entry's state_code; a client's error object's code (node-postgres).
    code = str(entry.get("state_code") or entry.get("code") or "")
    sqlstate = code if SQLSTATE_CODE.fullmatch(code) else ""
    for label, keys in FIELDS.items():
        value = next((entry[key] for key in keys if isinstance(entry.get(key), str)), "")
        if value:
            message = label == MESSAGE
            yield LogEntry(
                label,
                value,
                severity if message else "",
                **common,
                sqlstate=sqlstate if message else "",
            )


def _severity(word: str) -> str:
    match = messages.label_pattern().fullmatch(f"{word.strip()}:  ")
    return match.lastgroup[2:] if match and match.lastgroup.startswith("s_") else ""


# -- stderr and application output ----------------------------------------------------

# A client's name for a field, at the start of its line: JDBC's "  Detail:",
# node-postgres's "  detail: '...'", Postgrex's "    hint:", SQLAlchemy's "[SQL: ".
CLIENT_FIELDS = {
    "detail": "DETAIL",
    "hint": "HINT",
    "where": "CONTEXT",
    "context": "CONTEXT",
    "statement": "STATEMENT",
    "internalquery": "QUERY",
    "sql": "STATEMENT",
}
# The other fields of a client's error, read so that they end the one before.
OTHER_FIELDS = [
    "position",
    "internalposition",
    "location",
    "serversqlstate",
    "routine",
    "file",
    "line",
    "schema",
    "table",
    "column",
    "datatype",
    "constraint",
    "length",
    "severity",
    "code",
    "name",
]
CLIENT_LABEL = re.compile(r"^\s*\[?(?P<key>[A-Za-z][A-Za-z_ ]{0,20}?):\s")
# A frame of a stack trace: Java's and node's `at ...`, Python's `File "..."`,
# Ruby's `from ...:12:in`, Elixir's `(app 1.2.3) lib/...`, Java's `... 5 more`.
STACK_FRAME = re.compile(
    r"^\s+(?:at\s+(?:async\s+)?(?:[\w$.<>\[\]]+\s?\(.*\)|\S+:\d+:\d+)"
    r"|File\s\"[^\"]+\",\sline\s\d+|from\s\S+:\d+:in\s|\(\S+\s[\d.]+\)\s"
    r"|\.\.\.\s\d+\s(?:more|common))"
    r"|^Traceback \(most recent call last\)|^goroutine \d+"
)
# A line of only quotes and punctuation: the rest of a quoted field.
LEFTOVER = re.compile(r"^[\s'\"`+,;:()\[\]{}]*$")
ESCAPED_NEWLINE = re.compile(r"\\n")
SHIPPER_TAB = re.compile(r"\t|#011")
# Lines after a message's last one that may still bring it a shipped line.
SHIPPED_WINDOW = 1000
DIGITS = re.compile(r"\d+")
SQLSTATE = re.compile(r"^(?P<code>[0-9A-Z]{5}):\s+")
# %e in log_line_prefix: a whole word of five digits and capitals with at
# least one of each (40P01, P0001, XX000), of one of PostgreSQL's classes
# (its first two), so that a user or host named SVC01 is none.  One of
# digits alone (23505) may as well be a pid, so it is not taken for one.
SQLSTATE_CLASSES = (
    "00|01|02|03|08|09|0A|0B|0F|0L|0P|0Z|20|21|22|23|24|25|26|27|28|2B|2D|2F|34|38|39|3B|3D"
    "|3F|40|42|44|53|54|55|57|58|72|F0|HV|P0|XX"
)
PREFIX_SQLSTATE = re.compile(
    rf"(?<![\w.:/-])(?=[0-9A-Z]*[A-Z])(?=[0-9A-Z]*[0-9])(?:{SQLSTATE_CLASSES})[0-9A-Z]{{3}}"
    r"(?![\w.:/-])"
)
SQLSTATE_CODE = re.compile(r"[0-9A-Z]{5}")
QUOTED_VALUE = re.compile(
    r"""(?<![\w"'])["':]?(?P<key>[A-Za-z_]+)["']?\s*(?::|=>?)\s*"""
    r"""(?P<quote>["'])(?P<value>(?:\\.|(?!(?P=quote))[^\\])*)(?P=quote)"""
)


@dataclass
class _Pending:
    """The record being read: its first line's facts and its lines."""

    label: str
    severity: str
    prefix: str
    line: int
    lines: list[str] = field(default_factory=list)
    time: dt.datetime | None = None
    time_problem: str = ""
    pid: int | None = None
    sqlstate: str = ""
    last: int = 0  # the input line its last line came from

    @functools.cached_property
    def shape(self) -> str:
        """Its prefix with every number 0: what a shipper's prefix of its
        further lines looks like."""
        return DIGITS.sub("0", self.prefix)

    def entry(self) -> LogEntry:
        text = "\n".join(self.lines).strip("\n")
        return LogEntry(
            self.label,
            text,
            self.severity,
            self.time,
            self.time_problem,
            self.pid,
            _application(self.prefix),
            self.line,
            self.sqlstate,
        )


class _TextReader:
    """Reads lines into records.  A server writes each message whole, but a
    log shipper sends each line on its own, and other processes' lines may
    come between them: until SHIPPED_WINDOW lines later, or until its
    process starts another, a message a prefix names the process of takes
    a shipped line of that process.  Records are yielded in the order
    their messages start."""

    def __init__(self, zone: dt.tzinfo | None) -> None:
        self.zone = zone
        self.pending: _Pending | None = None  # the message read last
        # The messages not yielded yet, and by process the one it may continue.
        self.unyielded: collections.deque[_Pending] = collections.deque()
        self.open: dict[int, _Pending] = {}

    def read(self, text: str) -> Iterator[LogEntry]:
        for number, line in enumerate(lines(text), start=1):
            yield from self._line(line, number, depth=0, time=(None, ""))
        yield from self._flush()

    def _line(
        self, line: str, number: int, depth: int, time: tuple[dt.datetime | None, str]
    ) -> Iterator[LogEntry]:
        if depth < MAX_DEPTH and _quotes_a_report(line) and not self._as_written(line):
            if line.lstrip().startswith("{"):
                try:
                    entry = json.loads(line)
                except (ValueError, RecursionError):
                    entry = None
                if isinstance(entry, dict):
                    yield from self._flush()
                    yield from self._object(entry, number, depth, time)
                    return
            pairs = _quoted_values(line) if len(line) <= MAX_LINE else {}
            if "detail" in pairs and any(key in pairs for key in FIELDS[MESSAGE]):
                yield from self._flush()
                yield from _entry_records(
                    pairs, number, self.zone, self._time(line) if _has_time(line) else time
                )
                return
            if ESCAPED_NEWLINE.search(line):
                for piece in lines(_unquote(line)):
                    yield from self._line(piece, number, depth + 1, time)
                return
        yield from self._text_line(line, number, time)

    def _as_written(self, line: str) -> bool:
        """Whether `line` is the server's own text, which quotes nothing: a
        further line of the message being read, or a STATEMENT (only a
        server's log has one).  A `\\n` and quotes in it are a query's
        (E'a\\nb'): read as a client's quoting, its query was cut at the
        literal's end and the report's lines after it lost."""
        if self._further(line) is not None:
            return True
        found = messages.label_pattern().search(line, 0, MAX_LINE)
        quoted = _quoted_report(line)
        return (
            found is not None
            and found.lastgroup == "l_STATEMENT"
            and (quoted is None or found.start() <= quoted)
        )

    def _further(self, line: str) -> tuple[_Pending, str] | None:
        """(the message, the rest of `line`) where `line` is a further line
        of a message being read, as the server writes them: after a tab
        (not a stack frame's), continuing the message read last; or after a
        log shipper's prefix shaped like the message's first line's, then a
        tab (`... postgres[4102]: [3-2] #011`), continuing the message of
        the process it names (the one read last where it names none)."""
        if self.pending is not None and line[:1] == "\t" and not STACK_FRAME.match(line):
            return self.pending, line[1:]
        if not (tab := SHIPPER_TAB.search(line)) or not (head := line[: tab.start()]):
            return None
        pid = _pid(head)
        message = self.pending if pid is None else self.open.get(pid)
        shipped = DIGITS.sub("0", head)
        # A head the message's own prefix follows with a tab is the first
        # field of a log_line_prefix with tabs ('%m\t[%p]\t'), not a shipper's.
        if (
            message
            and message.shape.startswith(shipped)
            and not SHIPPER_TAB.match(message.shape, len(shipped))
        ):
            return message, line[tab.end() :]
        return None

    def _object(
        self, entry: dict[str, Any], number: int, depth: int, time: tuple[dt.datetime | None, str]
    ) -> Iterator[LogEntry]:
        """A JSON line: a server's jsonlog entry; or an application's log
        line, whose error object (node-postgres, Postgrex: message, detail,
        hint, where) or, failing that, whose strings hold a report."""
        if _is_server_entry(entry):
            yield from _entry_records(entry, number, self.zone)
            return
        stamp = next((entry[key] for key in TIME_KEYS if entry.get(key) not in (None, "")), None)
        time = self._time(stamp) if stamp is not None else time
        if error := _error_object(entry):
            yield from _entry_records(error, number, self.zone, time)
            return
        for value in _strings(entry):
            if _quotes_a_report(value):
                for piece in lines(value):
                    yield from self._line(piece, number, depth + 1, time)
                yield from self._flush()

    def _text_line(
        self, line: str, number: int, time: tuple[dt.datetime | None, str]
    ) -> Iterator[LogEntry]:
        if (further := self._further(line)) is not None:
            # The server indents a message's further lines by a tab: what
            # they say (a query's "ERROR:  " or "deadlock detected") is text,
            # after a log shipper's prefix too.
            message, rest = further
            message.lines.append(rest)
            message.last = number
            return
        start = _start(line)
        if start is not None:
            yield from self._flush(number)
            prefix, label, severity, text, sqlstate = start
            when, problem = self._time(prefix) if _has_time(prefix) else time
            pid = _pid(prefix)
            self.pending = _Pending(
                label, severity, prefix, number, [text], when, problem, pid, sqlstate, number
            )
            self.unyielded.append(self.pending)
            if pid is not None:
                self.open[pid] = self.pending
            return
        pending = self.pending
        if pending is None:
            return
        if (rest := _continuation(line, pending.shape)) is not None:
            pending.lines.append(rest)
        elif LEFTOVER.match(line):
            pending.lines.append("")
        else:
            yield from self._flush(number)

    def _time(self, value: object) -> tuple[dt.datetime | None, str]:
        return read_time(value, self.zone)

    def _flush(self, number: int | None = None) -> Iterator[LogEntry]:
        """Ends the message read last, and yields the messages no line
        after line `number` can continue (None: every message)."""
        self.pending = None
        while self.unyielded:
            first = self.unyielded[0]
            still_open = first.pid is not None and self.open.get(first.pid) is first
            if still_open and number is not None and number - first.last <= SHIPPED_WINDOW:
                return
            self.unyielded.popleft()
            if still_open:
                del self.open[first.pid]
            yield first.entry()


def _start(line: str) -> tuple[str, str, str, str, str] | None:
    """(prefix, label, severity, text, sqlstate) when `line` starts a message or a
    field: after a log_line_prefix, a severity or a label; or a client's
    field name at its start; or a deadlock report a client quotes."""
    # Where a prefix ends is in its first MAX_LINE characters; the rest is text.
    found = messages.label_pattern().search(line, 0, MAX_LINE)
    quoted = _quoted_report(line)
    if found and (quoted is None or found.start() <= quoted):
        kind, word = found.lastgroup[0], found.lastgroup[2:]
        text = line[found.end() :]
        if kind == "s":  # log_error_verbosity=verbose puts the SQLSTATE first
            code = SQLSTATE.match(text)
            prefix = line[: found.start()]
            return (
                prefix,
                MESSAGE,
                word,
                text[code.end() :] if code else text,
                code["code"] if code else _prefix_sqlstate(prefix),
            )
        return line[: found.start()], word, "", text, ""
    if quoted is not None:
        return line[:quoted], MESSAGE, "", line[quoted:], ""
    if (client := CLIENT_LABEL.match(line)) and not STACK_FRAME.match(line):
        key = client["key"].replace(" ", "").replace("_", "").lower()
        if key in CLIENT_FIELDS or key in OTHER_FIELDS:
            text = line[client.end() :]
            return "", CLIENT_FIELDS.get(key, "OTHER"), "", text.removesuffix("]"), ""
    return None


def _prefix_sqlstate(prefix: str) -> str:
    """The SQLSTATE a log_line_prefix's %e gives, where one is told from
    the prefix's other words ("" otherwise)."""
    codes = PREFIX_SQLSTATE.findall(prefix)
    return codes[-1] if codes else ""


def _error_object(value: object) -> dict[str, Any] | None:
    """The first object in `value` that is an error with a detail."""
    if isinstance(value, dict):
        if isinstance(value.get("detail"), str) and any(
            isinstance(value.get(key), str) for key in FIELDS[MESSAGE]
        ):
            return value
        value = list(value.values())
    if isinstance(value, list):
        return next((found for item in value if (found := _error_object(item))), None)
    return None


def _strings(value: object) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict | list):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _strings(item)


def _quoted_report(line: str) -> int | None:
    """Where a deadlock report a client quotes starts in `line`: the message
    after a class name, a parenthesis or a quote, not inside a sentence."""
    if len(line) > MAX_LINE or not (found := messages.find("deadlock", line)):
        return None
    before = line[: found.start()].rstrip()
    return None if before and before[-1].isalnum() else found.start()


def _continuation(line: str, shape: str) -> str | None:
    """The rest of the message when `line` continues it: indented (the
    server indents a message's further lines by a tab) but not a stack
    frame; or a report's line a client wrote unindented; or only a log
    shipper's prefix, shaped like the message's (`_Pending.shape`): an
    empty line; with text, `_TextReader._further`."""
    if line[:1].isspace():
        return None if STACK_FRAME.match(line) else line[1:] if line[0] == "\t" else line
    if len(line) <= MAX_LINE and any(
        messages.starts(name, line) for name in ("waits", "process_query", "holders")
    ):
        return line
    if shape and line.strip() and shape.startswith(DIGITS.sub("0", line)):
        return ""
    return None


def _quotes_a_report(text: str) -> bool:
    return len(text) <= 100 * MAX_LINE and bool(
        messages.find("deadlock", text) or messages.find("waits", text)
    )


def _quoted_values(line: str) -> dict[str, str]:
    """`key: "value"` pairs of an error object printed on one line (Elixir's
    inspect, node's util.inspect, a JSON fragment), values unescaped."""
    return {m["key"]: _unescape(m["value"]) for m in QUOTED_VALUE.finditer(line)}


QUOTED_LITERAL = re.compile(r"""(?P<quote>["'])(?P<body>(?:\\.|(?!(?P=quote))[^\\])*)(?P=quote)""")


def _unquote(line: str) -> str:
    """A line with a report inside a quoted string (a repr, a JSON string in
    text): what comes before the string, then the string unescaped, without
    its quotes and what follows them; or the whole line unescaped."""
    for literal in QUOTED_LITERAL.finditer(line):
        body = literal["body"]
        if ESCAPED_NEWLINE.search(body) and _quotes_a_report(body):
            return line[: literal.start()] + _unescape(body)
    return _unescape(line)


UNESCAPES = {"n": "\n", "r": "", "t": "\t", '"': '"', "'": "'", "\\": "\\", "/": "/"}


def _unescape(text: str) -> str:
    r"""`\n`, `\t`, `\"`, `\\` and `\uXXXX` as what they stand for."""

    def one(match: re.Match[str]) -> str:
        escaped = match[1]
        if escaped.startswith("u"):
            return chr(int(escaped[1:], 16))
        return UNESCAPES.get(escaped, match[0])

    return re.sub(r"\\(u[0-9a-fA-F]{4}|.)", one, text)


# -- what a prefix says ----------------------------------------------------------------

ISO_TIME = re.compile(
    r"(?<!\d)(?P<date>\d{4}-\d{2}-\d{2})[ T](?P<clock>\d{2}:\d{2}:\d{2})(?P<fraction>[.,]\d+)?"
    r"(?:\s?(?P<offset>Z|[+-]\d{2}(?::?\d{2})?)(?![\w:])|\s(?P<zone>[A-Za-z]+(?:/[\w+-]+)*))?"
)
# %n: seconds and milliseconds (a bare 10-digit number may be a %x xid).
EPOCH_TIME = re.compile(r"(?<![\d.])(?P<seconds>\d{10})\.(?P<fraction>\d{1,6})(?![\d.])")
PID_IN_PREFIX = re.compile(
    r"\[(?P<bracket>\d+)(?:-\d+)?\]|\bpid[=:]\s*(?P<named>\d+)"
    r"|(?<![\w.])[0-9a-f]{8}\.(?P<session>[0-9a-f]{1,8})(?![\w.])"
)
# A Rundesk connection's application name where log_line_prefix has %a:
# a whole word, after %d: or %u@ too.
RUNDESK_APPLICATION = re.compile(rf"(?<![\w.-]){APPLICATION_NAME}(?![\w:.-])")
# Zone abbreviations that name one offset (minutes east of UTC).  CST, CDT,
# IST and PST name several (PST: Los Angeles and Manila; CDT: Chicago and
# Havana): a time in them is unknown unless the server's log_timezone is
# given.
ZONES = {
    "UTC": 0, "UT": 0, "GMT": 0, "Z": 0, "WET": 0, "WEST": 60, "BST": 60, "CET": 60,
    "CEST": 120, "MET": 60, "MEST": 120, "EET": 120, "EEST": 180, "MSK": 180, "SAST": 120,
    "EST": -300, "EDT": -240, "MST": -420, "MDT": -360,
    "PDT": -420, "AKST": -540, "AKDT": -480, "HST": -600, "JST": 540, "KST": 540,
    "HKT": 480, "AWST": 480, "ACST": 570, "ACDT": 630, "AEST": 600, "AEDT": 660,
    "NZST": 720, "NZDT": 780, "WIB": 420, "PKT": 300,
}  # fmt: skip
# Words that follow a time in application logs and are not zones.
LEVELS = {"TRACE", "DEBUG", "INFO", "NOTICE", "WARN", "WARNING", "ERROR", "FATAL", "PANIC"}


def _has_time(prefix: str) -> bool:
    return bool(ISO_TIME.search(prefix) or EPOCH_TIME.search(prefix))


def read_time(value: object, zone: dt.tzinfo | None = None) -> tuple[dt.datetime | None, str]:
    """(the time, "") or (None, why it cannot be read) from what a log gives:
    a prefix with %t/%m ("2026-11-29 10:00:01.456 UTC", zone names or
    offsets), %n (epoch seconds), or a JSON number (seconds or milliseconds).
    `zone` (the server's log_timezone) reads a time written with its own
    abbreviation, or with none."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = value / 1000 if value > 10**11 else value
        return dt.datetime.fromtimestamp(seconds, dt.UTC), ""
    text = str(value)
    if match := ISO_TIME.search(text):
        return _iso_time(match, zone)
    if match := EPOCH_TIME.search(text):
        return dt.datetime.fromtimestamp(float(match[0]), dt.UTC), ""
    return None, ""


def _iso_time(match: re.Match[str], zone: dt.tzinfo | None) -> tuple[dt.datetime | None, str]:
    fraction = (match["fraction"] or ".0")[1:7].ljust(6, "0")
    try:
        local = dt.datetime.fromisoformat(f"{match['date']}T{match['clock']}.{fraction}")
    except ValueError:
        return None, f"the time {match[0]!r} is not a date and time"
    written = match[0].strip()
    if match["offset"]:
        offset = match["offset"].replace(":", "")
        if offset == "Z":
            return local.replace(tzinfo=dt.UTC), ""
        minutes = int(offset[1:3]) * 60 + int(offset[3:5] or 0)
        fixed = dt.timezone(dt.timedelta(minutes=-minutes if offset[0] == "-" else minutes))
        return local.replace(tzinfo=fixed), ""
    name = "" if (match["zone"] or "").upper() in LEVELS else match["zone"] or ""
    if zone is not None:
        # The hour a clock goes back comes twice: its name says which.
        readings = [local.replace(tzinfo=zone, fold=fold) for fold in (0, 1)]
        named = [moment for moment in readings if name in (moment.tzname(), str(zone))]
        if not name or named:
            return (named or readings)[0], ""
    if name.upper() in ZONES:
        return local.replace(tzinfo=dt.timezone(dt.timedelta(minutes=ZONES[name.upper()]))), ""
    if "/" in name:
        try:
            return local.replace(tzinfo=zoneinfo.ZoneInfo(name)), ""
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            return None, f"the time {written!r} names a zone this server does not know"
    # Either can be read with the server's log_timezone (import_pg_log --log-timezone).
    if name.isalpha() and name.isupper() and len(name) <= 5:
        return None, f"the time {written!r} is in zone {name}, whose offset is not known here"
    end = match.end("fraction") if match["fraction"] else match.end("clock")
    return None, f"the time {match.string[match.start() : end]!r} gives no time zone"


def _application(prefix: str) -> str:
    """The application name a stderr prefix gives (%a), where it is a
    Rundesk connection's.  Another's is not told from the prefix's other
    words (the user, the database, the host) without the server's
    log_line_prefix: the process's query names its role instead."""
    match = RUNDESK_APPLICATION.search(prefix)
    return match[0] if match else ""


def _pid(prefix: str) -> int | None:
    """The reporting backend's pid, where log_line_prefix gives it (%p, or
    the %c session id, whose second half is the pid in hex)."""
    if not (match := PID_IN_PREFIX.search(prefix)):
        return None
    if match["session"]:
        return int(match["session"], 16)
    return int(match["bracket"] or match["named"])

"""Deadlock reports in PostgreSQL server logs and in application output.

A server reports a deadlock as an ERROR "deadlock detected" whose DETAIL
says, for each process, what it waits for and who blocks it, then (in the
server's log only) each process's query:

    ... ERROR:  deadlock detected
    ... DETAIL:  Process 101 waits for ShareLock on transaction 7001; blocked by process 102.
            Process 102 waits for ShareLock on transaction 7000; blocked by process 101.
            Process 101: UPDATE ...
            Process 102: UPDATE ...
    ... HINT:  See server log for query details.
    ... CONTEXT:  while updating tuple (0,1) in relation "evidence_modelcall"
    ... STATEMENT:  UPDATE ...

Only the server's report is one: where the log says a message's severity
and SQLSTATE (csvlog, jsonlog, log_error_verbosity=verbose), an ERROR of
40P01; a function's RAISE of the same words (a WARNING, an error P0001)
is not.

With `log_lock_waits`, the processes' waits were logged before it
("process 101 still waiting for ShareLock on transaction 7001 after
1000.123 ms", DETAIL "Process holding the lock: 102. Wait queue: 101.").

evidence/pglog_formats.py reads any log format (and what clients print)
into records; this module finds the reports among them, in any language of
the catalog, with the waits that led to each, and says what it could not
read of each one rather than leave it out or guess.  `record()` stores a
report as a lock incident.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from django.db import DataError, connection, transaction
from django.utils import timezone

from evidence import locks
from evidence import pglog_messages as messages
from evidence.locks import Edge, Graph, Process, role_of
from evidence.models import IncidentSource, LockIncident, LockWait
from evidence.pglog_formats import (
    FORMATS,
    MAX_LINE,
    MESSAGE,
    LogEntry,
    LogFormatError,
    decode,
    log_timezone,
    read,
)
from runs.models import canonical_json, text_digest

# The SQLSTATE of the server's deadlock report (errcodes.h: ERRCODE_T_R_DEADLOCK_DETECTED).
DEADLOCK_DETECTED = "40P01"

__all__ = [
    "FORMATS",
    "LogFormatError",
    "LoggedWait",
    "Report",
    "decode",
    "import_log",
    "log_timezone",
    "parse",
    "record",
    "store",
]

# Words a client wraps around the lines of a report (node's `'...' +`).
QUOTING = "'\"`+,; "
# How much of a line the list of what was not read quotes.
QUOTED = 120
# The log_lock_waits messages of a wait that goes on (the others end it).
WAITING = {
    "lock_wait:still waiting",
    "lock_wait:detected deadlock",
    "lock_wait:avoided deadlock",
}
# The severities of a message that may end a lock wait the server logs no
# end for (a lock or statement timeout, a cancel: ERROR; a terminated
# backend: FATAL; a crash: PANIC), and "" where the log does not say.
MAY_END_WAIT = ("", "ERROR", "FATAL", "PANIC")
# The lock mode that conflicts with every mode (lock.c's conflict table), as
# the server writes it (it does not translate lock modes): each process
# holding a lock waited for in it blocks the wait.
CONFLICTS_WITH_ALL = "AccessExclusiveLock"
# LockWait.waited_ms is an int4.
MAX_WAITED_MS = 2**31 - 1


@dataclass
class LoggedWait:
    """A lock wait the server logged before a report (log_lock_waits)."""

    waiter: int
    mode: str
    lock_type: str
    locked: str
    waited_ms: int
    time: dt.datetime | None
    holders: list[int] = field(default_factory=list)
    line: int = 0
    # The line of a message naming no process that may have ended it (0: none).
    doubted_at: int = 0

    def as_json(self) -> dict[str, object]:
        return {
            "waiter": self.waiter,
            "holders": self.holders,
            "lock": self.mode,
            "on": self.locked,
            "waited_ms": self.waited_ms,
            "time": self.time.isoformat() if self.time else None,
        }


# What a report's digest is made of (Report.as_json's keys).
REPORT_IDENTITY = ("time", "reporter", "processes", "edges", "statement", "context")


@dataclass
class Report:
    """One "deadlock detected" report: its wait-for graph, what it could not
    read, and the waits the log had before it."""

    graph: Graph = field(default_factory=Graph)
    reporter: int | None = None
    time: dt.datetime | None = None
    statement: str = ""
    context: str = ""
    line: int = 0
    # What the report had that could not be read, one sentence each.
    unread: list[str] = field(default_factory=list)
    lead_up: list[LoggedWait] = field(default_factory=list)
    # The records the report is read from, and the logged waits before it.
    records: list[LogEntry] = field(default_factory=list, repr=False)
    earlier: list[LoggedWait] = field(default_factory=list, repr=False)

    @property
    def victim(self) -> int | None:
        """The process PostgreSQL ended to break the deadlock: the one that
        found it reports it (DeadLockReport) and its transaction is the one
        rolled back, so the report is logged under its pid.  None where the
        log names no process, or one not in the report."""
        if self.reporter in self.graph.processes:
            return self.reporter
        return None

    @property
    def digest(self) -> str:
        """What tells this report from every other, for an import that meets
        it again (a log uploaded twice, or one that overlaps the last): its
        time, reporter, processes, edges and statement, not where its file
        has it.  "" when the log gives no time: the same report then may be
        the same deadlock happening again."""
        if self.time is None:
            return ""
        said = self.as_json()
        return text_digest(canonical_json({key: said[key] for key in REPORT_IDENTITY}))

    def as_json(self) -> dict[str, object]:
        return {
            "processes": [{"pid": p.pid, "query": p.query} for p in self.graph.processes.values()],
            "edges": [
                {"waiter": e.waiter, "blocker": e.blocker, "lock": e.mode, "on": e.locked}
                for e in self.graph.edges
            ],
            "cycle": self.graph.cycle(),
            "reporter": self.reporter,
            "time": self.time.isoformat() if self.time else None,
            "statement": self.statement,
            "context": self.context,
            "line": self.line,
            "unread": self.unread,
            "lead_up": [wait.as_json() for wait in self.lead_up],
        }


def parse(text: str, format: str = "auto", zone: dt.tzinfo | None = None) -> list[Report]:
    """Every deadlock report in `text`, in the order the log has them (its
    times read in `zone`, the server's log_timezone, where they need one).
    LogFormatError when `text` is not in `format`."""
    reports: list[Report] = []
    # Per process (None where the log names none): the message its next
    # DETAIL, HINT... belongs to, and the waits it has logged and not ended.
    latest: dict[int | None, Report | LoggedWait | None] = {}
    waiting: dict[int, LoggedWait] = {}
    # Where lines name no process (log_line_prefix without %p), a message
    # that may end a wait may be any process's: the waits so logged since the
    # last such message.
    unnamed: list[LoggedWait] = []
    # Per process, the application name the log gives it (csvlog, jsonlog;
    # stderr where %a names a Rundesk connection).
    applications: dict[int, str] = {}
    for item in read(text, format, zone):
        key = item.pid
        if key is not None and item.application:
            applications[key] = item.application
        if item.label != MESSAGE:
            owner = latest.get(key)
            if isinstance(owner, Report):
                owner.records.append(item)
            elif isinstance(owner, LoggedWait) and item.label == "DETAIL":
                owner.holders = _holders(item.text)
            continue
        if logged := _logged_wait(item):
            name, wait = logged
            if name in WAITING:
                waiting[wait.waiter] = wait
                latest[key] = wait
                if key is None:
                    unnamed.append(wait)
            else:  # acquired, or failed: that wait is over
                waiting.pop(wait.waiter, None)
                latest[key] = None
            continue
        if _reports_deadlock(item):
            report = Report(reporter=item.pid, time=item.time, line=item.line, records=[item])
            report.earlier = list(waiting.values())
            if item.time_problem:
                report.unread.append(item.time_problem)
            reports.append(report)
            latest[key] = report
        else:
            latest[key] = None
            if key is None and item.severity in MAY_END_WAIT:
                for wait in unnamed:
                    wait.doubted_at = item.line
                unnamed.clear()
        # A process that logs anything else waits no more: its statement went
        # on, or ended (a lock or statement timeout, a cancel, this deadlock),
        # which the server logs no wait message for.
        if key is not None:
            waiting.pop(key, None)
    for report in reports:
        _interpret(report, applications)
    reports = _distinct(reports)
    used: set[int] = set()
    for report in reports:
        taken = [
            wait
            for wait in report.earlier
            if wait.waiter in report.graph.processes and id(wait) not in used
        ]
        used.update(id(wait) for wait in taken)
        for wait in taken:
            said = f"process {wait.waiter}'s lock wait (line {wait.line})"
            # Doubted by a message before the report (records come in their lines' order).
            if 0 < (ended := wait.doubted_at) < report.line:
                report.unread.append(
                    f"{said} may have ended at line {ended}, whose message names no process "
                    "(log_line_prefix has no %p): whether it still waited at the report cannot "
                    "be told, so it is not stored"
                )
                continue
            report.lead_up.append(wait)
            holders = set(wait.holders) - {wait.waiter}
            if not holders:
                report.unread.append(f"{said} names no process holding the lock: it is not stored")
            # The server lists every process holding the lock, in any mode.
            elif len(holders) > 1 and wait.mode != CONFLICTS_WITH_ALL:
                report.unread.append(
                    f"{said} names {len(holders)} processes holding the lock in modes the log "
                    "does not give: not each of them need have blocked it"
                )
    return reports


def _reports_deadlock(item: LogEntry) -> bool:
    """A message saying "deadlock detected" is the server's report where
    the log says it is an ERROR of SQLSTATE 40P01, or does not say (a
    client's output): a WARNING, or an error a function raised with that
    text (RAISE, SQLSTATE P0001), is not one."""
    return (
        item.severity in ("", "ERROR")
        and item.sqlstate in ("", DEADLOCK_DETECTED)
        and messages.starts("deadlock", item.text.lstrip()) is not None
    )


def _logged_wait(item: LogEntry) -> tuple[str, LoggedWait] | None:
    text = item.text.lstrip()
    for name in messages.names("lock_wait:"):
        if match := messages.starts(name, text):
            lock_type, locked = messages.describe_lock(match["lock"]) or _as_written(match["lock"])
            wait = LoggedWait(
                waiter=int(match["pid"]),
                mode=match["mode"],
                lock_type=lock_type,
                locked=locked,
                waited_ms=int(match["ms"]),
                time=item.time,
                line=item.line,
            )
            return name, wait
    return None


def _holders(detail: str) -> list[int]:
    match = messages.find("holders", detail)
    return [int(pid) for pid in re.findall(r"\d+", match["holders"])] if match else []


def _as_written(lock: str) -> tuple[str, str]:
    """A lock PostgreSQL does not describe so: (its first word, as written)."""
    return lock.split(" ", 1)[0], lock.strip()


# -- one report --------------------------------------------------------------------------


def _interpret(report: Report, applications: dict[int, str]) -> None:
    """Reads the report's processes, edges and queries from its records, and
    says what it could not read."""
    unread = report.unread
    graph = report.graph
    details = 0
    for item in report.records:
        queried: Process | None = None  # the process whose query the next lines continue
        if item.label == "STATEMENT":
            report.statement = _unquoted(item.text)
        elif item.label == "CONTEXT":
            report.context = _unquoted(item.text)
        if item.label not in (MESSAGE, "DETAIL", "HINT"):
            continue
        details += item.label == "DETAIL"
        for raw, line in _lines(item):
            if len(line) > MAX_LINE and not messages.starts("process_query", line):
                unread.append(f"a line of {len(line)} characters was not read")
                queried = None
            # A query's line is its text, whatever it says (a quoted wait):
            # its first line too, and those that continue it, as the server
            # writes every wait before the first query.  The line as written
            # first: what a client's quoting is stripped of (`'`, `;`) may
            # end a query (`SET note = 'x';`).
            elif match := (
                messages.starts("process_query", raw.lstrip())
                or messages.starts("process_query", line)
            ):
                queried = graph.processes.setdefault(int(match["pid"]), Process(int(match["pid"])))
                queried.query = match["query"].strip()
            elif queried is None and (edges := messages.find_all("waits", line)):
                for match in edges:
                    _edge(report, match)
            elif queried is not None:
                queried.query += "\n" + raw  # a query over several lines
            elif item.label == "DETAIL":
                unread.append(f"DETAIL line not read: {line[:QUOTED]!r}")
    for process in graph.processes.values():
        # The application name, where the log gives one, names the role and run.
        process.role, process.run_id = role_of(applications.get(process.pid, ""), process.query)
    _reporter(report)
    unread.extend(_missing(report, details))


def _unquoted(text: str) -> str:
    """A field as the server wrote it, without the quotes (and the comma
    after them) a client printed around it: `'while updating ...',`."""
    text = text.strip()
    inner = text.removesuffix(",")
    if len(inner) > 1 and inner[0] in "'\"`" and inner[-1] == inner[0]:
        return inner[1:-1]
    return text


def _distinct(reports: list[Report]) -> list[Report]:
    """The reports, each once: a client that chains exceptions (SQLAlchemy,
    Hibernate then the servlet) prints the same report twice; what the
    second has and the first lacks (its statement) is kept.  A server's
    reports, which name their reporter, are each a deadlock of their own."""
    kept: list[Report] = []
    # The reports a client may have printed again, by their edges, then
    # their time: each is compared with those of its edges and time, and
    # of no time, only (a log of thousands of reports took minutes).
    alike: dict[tuple[Edge, ...], dict[dt.datetime | None, list[Report]]] = {}
    order: dict[int, int] = {}  # id(report) -> its place in `kept`
    for report in reports:
        printed = report.reporter is None and bool(report.graph.edges)
        by_time = alike.setdefault(tuple(report.graph.edges), {}) if printed else {}
        if report.time is None:
            candidates = [k for times in by_time.values() for k in times]
        else:
            candidates = by_time.get(report.time, []) + by_time.get(None, [])
        matching = (k for k in candidates if _same_deadlock(k, report))
        same = min(matching, key=lambda k: order[id(k)], default=None)
        if same is None:
            order[id(report)] = len(kept)
            kept.append(report)
            by_time.setdefault(report.time, []).append(report)
            continue
        same.statement = same.statement or report.statement
        same.context = same.context or report.context
        same.unread += [line for line in report.unread if line not in same.unread]
    return kept


def _same_deadlock(first: Report, second: Report) -> bool:
    times = first.time is None or second.time is None or first.time == second.time
    return (
        first.reporter is None
        and second.reporter is None
        and bool(first.graph.edges)
        and first.graph.edges == second.graph.edges
        and times
    )


def _lines(item: LogEntry) -> Iterable[tuple[str, str]]:
    """The lines of a record that can hold report lines (of a message, not
    the message itself, nor a client's words before it), as written and
    without the quoting a client wraps around them."""
    lines = item.text.split("\n")
    if item.label == MESSAGE:
        first = lines[0] if lines else ""
        found = messages.find("deadlock", first)
        lines = [first[found.end() :] if found else "", *lines[1:]]
    for line in lines:
        if stripped := line.strip().strip(QUOTING):
            yield line.rstrip(), stripped


def _edge(report: Report, match: re.Match[str]) -> None:
    waiter, blocker = int(match["waiter"]), int(match["blocker"])
    if waiter == blocker:
        report.unread.append(f"process {waiter}'s waits-for line names itself: left out")
        return
    described = messages.describe_lock(match["lock"])
    if described is None:
        report.unread.append(
            f"process {waiter} waits on {match['lock'][:QUOTED]!r}, which is not a lock "
            "PostgreSQL describes: kept as written"
        )
    lock_type, locked = described or _as_written(match["lock"])
    for pid in (waiter, blocker):
        report.graph.processes.setdefault(pid, Process(pid))
    report.graph.edges.append(Edge(waiter, blocker, match["mode"], lock_type, locked))


def _reporter(report: Report) -> None:
    """A reporter the log line names is one of the report's processes."""
    reporter = report.reporter
    if reporter is not None and report.graph.processes and reporter not in report.graph.processes:
        report.unread.append(f"the log line names process {reporter}, which is not in the report")


def _missing(report: Report, details: int) -> Iterable[str]:
    graph = report.graph
    if not graph.edges:
        yield (
            "no waits-for line found: the input does not say which processes waited for what"
            if details
            else "the report has no DETAIL: which processes waited for what is not in the input"
        )
        return
    waiters = {edge.waiter for edge in graph.edges}
    for pid in graph.processes:
        if pid not in waiters:
            yield f"process {pid}'s waits-for line not found"
    if not graph.cycle():
        yield "the waits-for lines do not close a cycle"
    queries = [p.pid for p in graph.processes.values() if p.query]
    if not queries:
        yield (
            "no process's query is in the input (PostgreSQL sends clients the report "
            "without them; the server log has them)"
        )
    else:
        yield from (
            f"process {pid}'s query not found" for pid in graph.processes if pid not in queries
        )


# -- storing -----------------------------------------------------------------------------


def import_log(
    text: str, origin: str, format: str = "auto", zone: dt.tzinfo | None = None
) -> list[tuple[Report, LockIncident]]:
    """Every report of `text` stored as an incident, all or none: input
    that is not in `format` (LogFormatError) or a failed write stores none."""
    return store(parse(text, format, zone), origin)


def store(reports: list[Report], origin: str) -> list[tuple[Report, LockIncident]]:
    """`reports` stored as incidents, all or none, but those imported
    before (Report.digest): the ones stored."""
    digests = [report.digest for report in reports]
    with transaction.atomic():
        with connection.cursor() as cursor:
            # One import at a time looks at what was imported before (two
            # uploads of one log at once stored it twice).
            cursor.execute("SELECT pg_advisory_xact_lock(hashtext('rundesk: log import'))")
        seen = set(
            LockIncident.objects.filter(
                source=IncidentSource.LOG, report_digest__in=set(digests) - {""}
            ).values_list("report_digest", flat=True)
        )
        stored = []
        for report, digest in zip(reports, digests, strict=True):
            if digest and digest in seen:
                continue
            seen.add(digest)
            try:
                with transaction.atomic():
                    stored.append((report, record(report, origin, digest)))
            except (DataError, OverflowError) as error:
                # A number or a time no column holds (a pid past 2^31, the
                # year 1): no such server wrote it.  All or none: none.
                raise LogFormatError(
                    f"the report at line {report.line} holds a value no incident can: "
                    f"{str(error).strip()}"
                ) from None
        return stored


def imported_before(count: int) -> str:
    """What an import says of the reports it did not store again."""
    return (
        f"{count} had been imported before (the same report, at the same time): not stored again."
    )


def record(report: Report, origin: str, digest: str) -> LockIncident:
    """Stores a report as an incident: its edges, then the waits logged
    before it, each at the time the log gives (the import's time, marked
    unknown, where it gives none), and what could not be read."""
    now = timezone.now()
    when = report.time or now
    graph = Graph(dict(report.graph.processes), list(report.graph.edges))
    cycle = graph.cycle()
    summary = f"deadlock of {len(graph.processes)} processes from {origin}" + (
        f"; reported by {report.reporter}" if report.reporter else ""
    )
    logged = [
        (wait, Edge(wait.waiter, holder, wait.mode, wait.lock_type, wait.locked))
        for wait in report.lead_up
        for holder in wait.holders
        if holder != wait.waiter
    ]
    for _, edge in logged:
        graph.processes.setdefault(edge.blocker, Process(edge.blocker))
    # locks' own helpers, so that an imported wait is stored as a sampled one is.
    runs = locks._known_runs(graph)
    with transaction.atomic():
        incident = LockIncident.objects.create(
            source=IncidentSource.LOG,
            started_at=when,
            time_known=report.time is not None,
            processes=len(report.graph.processes),
            has_cycle=bool(cycle),
            cycle=cycle,
            summary=summary,
            unread=report.unread,
            report_digest=digest,
            victim_pid=report.victim,
        )
        waits = [
            locks._wait(incident, graph, edge, runs, when, when) for edge in report.graph.edges
        ]
        for wait, edge in logged:
            seen = wait.time or now
            waited = dt.timedelta(milliseconds=min(wait.waited_ms, MAX_WAITED_MS))
            row = locks._wait(incident, graph, edge, runs, seen - waited, seen)
            row.lead_up = True
            waits.append(row)
        LockWait.objects.bulk_create(waits)
    return incident

"""Deadlock reports in PostgreSQL server logs and in application output.

A server log (any log_line_prefix, stderr format) reports a deadlock as an
ERROR "deadlock detected" followed by a DETAIL whose lines say, for each
process, what it waits for and who blocks it, then each process's query:

    ... ERROR:  deadlock detected
    ... DETAIL:  Process 101 waits for ShareLock on transaction 7001; blocked by process 102.
            Process 102 waits for ShareLock on transaction 7000; blocked by process 101.
            Process 101: UPDATE ...
            Process 102: UPDATE ...
    ... HINT:  See server log for query details.
    ... CONTEXT:  while updating tuple (0,1) in relation "evidence_modelcall"
    ... STATEMENT:  UPDATE ...

Application output quotes the same text (a psycopg DeadlockDetected
traceback, say) without prefixes.  `parse()` finds every report in either,
ignoring everything around them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from evidence.locks import Edge, Graph, Process, role_of

REPORT = re.compile(r"deadlock detected")
LEVEL = re.compile(
    r"\b(DEBUG\d?|INFO|NOTICE|WARNING|ERROR|LOG|FATAL|PANIC|DETAIL|HINT|QUERY|CONTEXT|"
    r"LOCATION|STATEMENT):\s"
)
# The levels that continue a report; any other level starts something else.
CONTINUES = {"DETAIL", "HINT", "QUERY", "CONTEXT", "LOCATION", "STATEMENT"}
WAITS = re.compile(r"Process (\d+) waits for (\w+) on ([^;]*); blocked by process (\d+)")
# Longer lines are not part of a deadlock report (and are not searched).
MAX_LINE = 10_000
QUERY_OF = re.compile(r"Process (\d+): (.*)$")
PID_IN_PREFIX = re.compile(r"\[(\d+)\]|\bpid[=:]\s*(\d+)")


@dataclass
class Report:
    """One "deadlock detected" report: its wait-for graph and the lines it
    came from."""

    graph: Graph = field(default_factory=Graph)
    reporter: int | None = None
    statement: str = ""
    context: str = ""
    lines: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, object]:
        return {
            "processes": [{"pid": p.pid, "query": p.query} for p in self.graph.processes.values()],
            "edges": [
                {"waiter": e.waiter, "blocker": e.blocker, "lock": e.mode, "on": e.locked}
                for e in self.graph.edges
            ],
            "cycle": self.graph.cycle(),
            "reporter": self.reporter,
            "statement": self.statement,
            "context": self.context,
        }


def parse(text: str) -> list[Report]:
    reports: list[Report] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        match = REPORT.search(lines[i])
        if not match:
            i += 1
            continue
        report = Report(reporter=_reporter(lines[i][: match.start()]), lines=[lines[i]])
        i += 1
        while i < len(lines) and not REPORT.search(lines[i]):
            level = LEVEL.search(lines[i])
            if level and level[1] not in CONTINUES:
                break
            if lines[i].startswith("Traceback (most recent call last)"):
                break
            _read(report, lines[i], level)
            report.lines.append(lines[i])
            i += 1
        if report.graph.edges:
            reports.append(report)
    return reports


def _reporter(prefix: str) -> int | None:
    """The reporting backend's pid, where log_line_prefix gives it (%p)."""
    level = LEVEL.search(prefix + " ")
    head = prefix[: level.start()] if level else prefix
    for match in PID_IN_PREFIX.finditer(head):
        pid = next(group for group in match.groups() if group)
        return int(pid)
    return None


def _read(report: Report, line: str, level: re.Match[str] | None) -> None:
    body = line[level.end() :] if level else line
    if level and level[1] == "STATEMENT":
        report.statement = body.strip()
        return
    if level and level[1] == "CONTEXT":
        report.context = body.strip()
        return
    if len(body) > MAX_LINE:
        return
    if waits := WAITS.search(body):
        waiter, mode, locked, blocker = int(waits[1]), waits[2], waits[3], int(waits[4])
        if waiter == blocker:
            return  # not a wait-for edge: a process never waits for itself
        for pid in (waiter, blocker):
            report.graph.processes.setdefault(pid, Process(pid))
        report.graph.edges.append(Edge(waiter, blocker, mode, _lock_type(locked), locked))
    elif query := QUERY_OF.search(body):
        process = report.graph.processes.setdefault(int(query[1]), Process(int(query[1])))
        process.query = query[2].strip()
        process.role, _ = role_of("", process.query)


LOCK_TYPES = ("virtual transaction", "transaction", "tuple", "advisory lock", "page", "relation")


def _lock_type(locked: str) -> str:
    """What kind of lock the DETAIL names: `tuple (0,5) of relation ...` -> tuple."""
    for kind in LOCK_TYPES:
        if locked.startswith(kind):
            return kind.removesuffix(" lock")
    return locked.split(" ", 1)[0]

"""Who waits for whom among Rundesk's connections.

Every Rundesk connection names itself in `application_name`
(`rundesk:<role>[:run-<id>]`), so a wait-for graph can say which role and
which run each process serves.  The sampler (a thread of the executor, while
runs are active) first takes a cheap look at pg_stat_activity for sessions
waiting on a lock, and only for those asks pg_blocking_pids(), which takes
the lock manager's locks and is never polled hot.  Waits seen in
consecutive samples form one incident; incidents from the sampler, from
`reproduce_contention` and from imported server logs are stored alike, with
their cycle if they hold one.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from evidence.models import IncidentSource, LockIncident, LockWait
from evidence.records import bounded
from runs.models import Run
from runs.sql import name_connection
from runs.words import human_duration

logger = logging.getLogger(__name__)

# A Rundesk connection's application name (runs/sql.py application_name).
APPLICATION_NAME = r"rundesk:(?P<role>[a-z_-]+)(?::run-(?P<run>\d+))?"
APPLICATION = re.compile("^" + APPLICATION_NAME)


@dataclass
class Process:
    pid: int
    role: str = ""
    run_id: int | None = None
    query: str = ""


@dataclass(frozen=True)
class Edge:
    """`waiter` waits for a lock of `mode` on `locked`, which `blocker` holds."""

    waiter: int
    blocker: int
    mode: str = ""
    lock_type: str = ""
    locked: str = ""


@dataclass
class Graph:
    processes: dict[int, Process] = field(default_factory=dict)
    edges: list[Edge] = field(default_factory=list)

    def cycle(self) -> list[int]:
        """The pids of a wait-for cycle, in wait-for order, or []."""
        following: dict[int, list[int]] = {}
        for edge in self.edges:
            following.setdefault(edge.waiter, []).append(edge.blocker)
        visiting: set[int] = set()
        done: set[int] = set()
        path: list[int] = []

        def visit(pid: int) -> list[int]:
            visiting.add(pid)
            path.append(pid)
            for blocker in following.get(pid, []):
                if blocker in visiting:
                    return path[path.index(blocker) :]
                if blocker not in done and (found := visit(blocker)):
                    return found
            visiting.discard(pid)
            done.add(pid)
            path.pop()
            return []

        for pid in sorted(following):
            if pid not in done and (found := visit(pid)):
                return found
        return []


# What a statement is part of, when its connection's role says less.
STATEMENT_ROLES = [
    ("runs_answerrevision", "publication"),
    ("runs_checkpoint", "checkpoint"),
    ("runs_receipt", "receipt"),
    ("evidence_evidencecopy", "capture"),
    ("UPDATE evidence_source", "source refresh"),
]


def describe_application(name: str) -> tuple[str, int | None]:
    """`rundesk:capture:run-42` -> ("capture", 42); others keep their name."""
    match = APPLICATION.match(name or "")
    if not match:
        return name or "", None
    return match["role"], int(match["run"]) if match["run"] else None


def role_of(application_name: str, query: str) -> tuple[str, int | None]:
    """The role a process plays in a wait: its connection's role, made
    precise by its statement (an executor publishing is "publication") --
    for Rundesk's connections, and those a log names no application for.
    A stranger keeps its own name (psql taking runs_receipt is psql)."""
    role, run_id = describe_application(application_name)
    ours = not application_name or APPLICATION.match(application_name)
    if ours and role != "capture":
        for marker, statement_role in STATEMENT_ROLES:
            if marker in (query or ""):
                return statement_role, run_id
    return role, run_id


# -- sampling ---------------------------------------------------------------------

WAITING = """
    SELECT pid FROM pg_stat_activity
    WHERE wait_event_type = 'Lock' AND application_name LIKE 'rundesk:%'
      AND datname = current_database() AND pid <> pg_backend_pid()
"""

# For the waiting sessions only: who blocks them, and on what.
BLOCKERS = """
    SELECT w.pid, w.application_name, w.query, blocker.pid,
           -- pid 0: a prepared transaction (PREPARE TRANSACTION), no session's.
           CASE WHEN blocker.pid = 0 THEN 'prepared transaction' ELSE b.application_name END,
           CASE WHEN blocker.pid = 0 THEN (
               SELECT string_agg(format('%%s (owner %%s, prepared %%s)', gid, owner, prepared),
                                 '; ' ORDER BY prepared)
               FROM pg_prepared_xacts WHERE database = current_database())
           ELSE b.query END,
           l.locktype, l.mode,
           -- As the server's own messages name them (DescribeLockTag).
           concat_ws(' ', l.relation::regclass::text,
               CASE WHEN l.transactionid IS NOT NULL THEN 'transaction ' || l.transactionid END,
               CASE WHEN l.tuple IS NOT NULL THEN 'tuple (' || l.page || ',' || l.tuple || ')' END,
               CASE WHEN l.locktype = 'page' THEN 'page ' || l.page END,
               CASE WHEN l.locktype = 'virtualxid' THEN 'virtual transaction ' || l.virtualxid END,
               CASE WHEN l.locktype = 'object' THEN
                   format('object %%s of class %%s of database %%s', l.objid, l.classid, l.database)
               END,
               CASE WHEN l.locktype = 'advisory' THEN format('advisory lock [%%s,%%s,%%s,%%s]',
                   l.database, l.classid, l.objid, l.objsubid) END)
    FROM pg_stat_activity w
    CROSS JOIN LATERAL (SELECT DISTINCT unnest(pg_blocking_pids(w.pid))) AS blocker(pid)
    LEFT JOIN pg_stat_activity b ON b.pid = blocker.pid
    LEFT JOIN LATERAL (
        SELECT * FROM pg_locks WHERE pid = w.pid AND NOT granted LIMIT 1
    ) l ON true
    WHERE w.pid = ANY(%s)
"""


def sample() -> Graph:
    """One look at who waits for whom among Rundesk's connections."""
    graph = Graph()
    with connection.cursor() as cursor:
        cursor.execute(WAITING)
        waiting = [pid for (pid,) in cursor.fetchall()]
        if not waiting:
            return graph
        cursor.execute(BLOCKERS, [waiting])
        rows = cursor.fetchall()
    for waiter, w_app, w_query, blocker, b_app, b_query, lock_type, mode, locked in rows:
        for pid, app, query in ((waiter, w_app, w_query), (blocker, b_app, b_query)):
            role, run_id = role_of(app, query)
            graph.processes.setdefault(pid, Process(pid, role, run_id, query or ""))
        graph.edges.append(Edge(waiter, blocker, mode or "", lock_type or "", locked or ""))
    return graph


def store(
    source: str,
    graph: Graph,
    *,
    started_at: dt.datetime | None = None,
    ended_at: dt.datetime | None = None,
    summary: str = "",
) -> LockIncident:
    """Stores a wait-for graph as an incident, with its cycle if it has one."""
    cycle = graph.cycle()
    now = timezone.now()
    runs = _known_runs(graph)
    with transaction.atomic():
        incident = LockIncident.objects.create(
            source=source,
            started_at=started_at or now,
            ended_at=ended_at,
            processes=len(graph.processes),
            has_cycle=bool(cycle),
            cycle=cycle,
            summary=summary,
        )
        LockWait.objects.bulk_create(
            _wait(incident, graph, edge, runs, incident.started_at, now) for edge in graph.edges
        )
    return incident


@dataclass(frozen=True)
class Victim:
    """The process PostgreSQL ended to break a deadlock, as the incident
    knows it."""

    pid: int
    role: str
    run_id: int | None


def victim_of(incident: LockIncident) -> Victim | None:
    """The incident's victim (LockIncident.victim_pid), with the role and
    run its wait names; None where no process is known to have been ended."""
    if incident.victim_pid is None:
        return None
    wait = (
        incident.waits.filter(lead_up=False, waiter_pid=incident.victim_pid).order_by("id").first()
    )
    if wait is None:
        return Victim(incident.victim_pid, "", None)
    return Victim(wait.waiter_pid, wait.waiter_role, wait.waiter_run_id)


# The sampler closes an open incident at its next empty sample: an open one
# whose waits were last seen longer ago than this was left by a sampler that
# stopped (its executor killed), not a wait still going.
SAMPLES_MISSED = 5


@dataclass(frozen=True)
class IncidentWords:
    """An incident as the pages say it: always a summary, a start, an end
    (or "still going") and a duration, in human units."""

    summary: str
    started: str
    ended: str
    duration: str
    going: bool


def incident_words(incident: LockIncident, now: dt.datetime) -> IncidentWords:
    """The words for `incident` at `now`, from its waits (prefetch them for
    a list): a summary made from its longest wait where none was stored."""
    waits = [wait for wait in incident.waits.all() if not wait.lead_up]
    longest = max(waits, key=lambda wait: wait.waited_ms, default=None)
    summary = incident.summary or _summary(incident, waits, longest)
    started = (
        timezone.localtime(incident.started_at).strftime("%Y-%m-%d %H:%M:%S %Z")
        if incident.time_known
        else "time unknown"
    )
    if incident.ended_at is not None:
        took = (incident.ended_at - incident.started_at).total_seconds()
        ended = timezone.localtime(incident.ended_at).strftime("%H:%M:%S")
        return IncidentWords(summary, started, ended, human_duration(took), going=False)
    if incident.source == IncidentSource.SAMPLER and not incident.is_imported:
        last = max((wait.last_seen for wait in waits), default=incident.started_at)
        patience = dt.timedelta(seconds=settings.RUNDESK_LOCK_SAMPLE_SECONDS * SAMPLES_MISSED)
        if now - last <= max(patience, dt.timedelta(seconds=5)):
            so_far = human_duration((now - incident.started_at).total_seconds())
            return IncidentWords(summary, started, "still going", f"{so_far} so far", going=True)
        seen = timezone.localtime(last).strftime("%H:%M:%S")
        took = human_duration((last - incident.started_at).total_seconds())
        return IncidentWords(
            summary,
            started,
            f"not known: last seen at {seen}, then the sampler stopped watching",
            f"at least {took}",
            going=False,
        )
    # A server's report, a reproduction: one moment, its waits' lengths as
    # the report gives them.
    waited = (
        f"longest wait {human_duration(longest.waited_ms / 1000)}"
        if longest and longest.waited_ms
        else "not known"
    )
    ended = "when reported: PostgreSQL broke the cycle" if incident.has_cycle else "not recorded"
    return IncidentWords(summary, started, ended, waited, going=False)


def _summary(incident: LockIncident, waits: list[LockWait], longest: LockWait | None) -> str:
    if longest is None:
        return "no wait was read"
    who = f"{longest.waiter_role or 'process'} {longest.waiter_pid}"
    holder = f"{longest.blocker_role or 'process'} {longest.blocker_pid}"
    said = (
        f"{who} waited {human_duration(longest.waited_ms / 1000)} for {longest.mode or 'a lock'}"
        f" on {longest.locked or longest.lock_type or 'an object'}, held by {holder}"
    )
    if incident.has_cycle:
        said = f"deadlock of {incident.processes} processes: {said}"
    if len(waits) > 1:
        said += f"; {len(waits) - 1} more wait{'s' if len(waits) > 2 else ''}"
    return said


def _known_runs(graph: Graph) -> set[int]:
    """The runs named by the processes that still exist (a log may name
    others) among this installation's: an imported run's id here is not the
    id its server's connections gave."""
    named = {p.run_id for p in graph.processes.values() if p.run_id}
    if not named:
        return set()
    return set(Run.objects.local().filter(pk__in=named).values_list("pk", flat=True))


def _wait(
    incident: LockIncident,
    graph: Graph,
    edge: Edge,
    runs: set[int],
    first_seen: dt.datetime,
    last_seen: dt.datetime,
) -> LockWait:
    waiter = graph.processes.get(edge.waiter, Process(edge.waiter))
    blocker = graph.processes.get(edge.blocker, Process(edge.blocker))
    return LockWait(
        incident=incident,
        waiter_pid=waiter.pid,
        waiter_role=waiter.role,
        waiter_run_id=waiter.run_id if waiter.run_id in runs else None,
        waiter_query=waiter.query,
        blocker_pid=blocker.pid,
        blocker_role=blocker.role,
        blocker_run_id=blocker.run_id if blocker.run_id in runs else None,
        blocker_query=blocker.query,
        lock_type=edge.lock_type[:40],
        mode=edge.mode[:40],
        locked=edge.locked[:300],
        first_seen=first_seen,
        last_seen=last_seen,
        waited_ms=int((last_seen - first_seen).total_seconds() * 1000),
    )


class LockSampler:
    """Samples while `active()` says runs are active.  Waits seen in
    consecutive samples belong to one incident; a sample with no waits
    closes it."""

    def __init__(self, active: Callable[[], bool], interval: float | None = None) -> None:
        self.active = active
        self.interval = interval or settings.RUNDESK_LOCK_SAMPLE_SECONDS
        self.incident: LockIncident | None = None
        self.seen: dict[tuple[int, int, str], LockWait] = {}

    def serve(self, stop: threading.Event) -> None:
        try:
            while not stop.wait(self.interval):
                if self.active() or self.incident is not None:
                    try:
                        if connection.connection is None:  # a new connection: name it
                            name_connection("sampler")
                        self.tick()
                    except DatabaseError as error:
                        logger.warning("lock sampler: %s", error)
                        connection.close()
        finally:
            self._close_incident()
            connection.close()

    def _close_incident(self) -> None:
        """The incident open when the sampler stops ends there: nobody
        would end it (when its waits ended is not known after; ended_at
        says when they were last watched).  Best effort, its lock waits
        bounded."""
        if self.incident is None:
            return
        try:
            with bounded():
                LockIncident.objects.filter(pk=self.incident.pk, ended_at__isnull=True).update(
                    ended_at=timezone.now()
                )
        except DatabaseError as error:
            logger.warning("lock sampler: incident %s left open: %s", self.incident.pk, error)
        self.incident, self.seen = None, {}

    def tick(self) -> None:
        """One sample, stored as evidence is (evidence.records.bounded): in
        one transaction whose lock waits are bounded, with SET LOCAL, so that
        on a pooler's shared server connection no other client inherits the
        bound.  A lock on the incident tables held by anyone costs a sample,
        never a stuck sampler (the executor joins it on shutdown).  A sample
        that fails leaves the incident as the last one left it."""
        incident, seen = self.incident, dict(self.seen)
        try:
            with bounded():
                self._record(sample())
        except DatabaseError:
            self.incident, self.seen = incident, seen
            raise

    def _record(self, graph: Graph) -> None:
        now = timezone.now()
        if not graph.edges:
            if self.incident is not None:
                self.incident.ended_at = now
                self.incident.save(update_fields=["ended_at"])
                self.incident, self.seen = None, {}
            return
        if self.incident is None:
            self.incident = LockIncident.objects.create(
                source=IncidentSource.SAMPLER, started_at=now
            )
        runs = _known_runs(graph)
        for edge in graph.edges:
            key = (edge.waiter, edge.blocker, edge.locked)
            wait = self.seen.get(key)
            if wait is None:
                self.seen[key] = _wait(self.incident, graph, edge, runs, now, now)
                self.seen[key].save()
            else:
                wait.last_seen = now
                wait.waited_ms = int((now - wait.first_seen).total_seconds() * 1000)
                wait.save(update_fields=["last_seen", "waited_ms"])
        # A cycle is one sample's: waits seen at different moments may
        # point at each other without ever having been a deadlock.
        if cycle := graph.cycle():
            self.incident.has_cycle, self.incident.cycle = True, cycle
        self.incident.processes = len(
            {w.waiter_pid for w in self.seen.values()} | {w.blocker_pid for w in self.seen.values()}
        )
        self.incident.save(update_fields=["processes", "has_cycle", "cycle"])

"""The benchmarks `manage.py bench` runs, one module each, named for what it
measures, and the statistics they share (`reproduce_contention` uses them
too).

- steps: the commits and WAL syncs of a step of the real agent path, and
  its time against a single-row INSERT + COMMIT; a no-op step alone;
- capture: what handing a copy to a stalled evidence capture costs;
- evidence_locked: a whole run while every evidence table is locked;
- peers: a no-op step through DBOS, LangGraph and Rundesk, side by side;
- throughput: runs/s of executor processes against the commit ceiling, and
  the failover time after an executor dies;
- scale: runs/s of Celery worker processes on a broker;
- bundle: export time and peak memory of investigation bundles;
- pages: server time of the dashboard's pages, small tables against large.
- page_load: cold page-to-chart time of the chart pages in Chromium.
"""

from __future__ import annotations

import ipaddress
import math
import os
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runs import lifecycle
from runs.models import Run
from runs.submission import submit


@dataclass(frozen=True)
class ServerCounts:
    """What the server has counted: the committed transactions of one
    database (pg_stat_database.xact_commit, read-only ones too) and the WAL
    fsyncs of the whole server (pg_stat_wal.wal_sync: the durable commits,
    group commits merged).  A backend hands its counts over when idle, at
    most once a second, or as it exits: each benchmark first makes the
    backends it counts report, in the way its work allows, and says how."""

    commits: int
    wal_syncs: int

    @classmethod
    def read(cls, connection: Any, database: str | None = None) -> ServerCounts:
        """The counts now, read on `connection` (a psycopg connection or
        cursor, in autocommit: each reading is a new stats snapshot), of
        `database` (its own by default)."""
        row = connection.execute(
            "SELECT (SELECT xact_commit FROM pg_stat_database"
            "        WHERE datname = coalesce(%s, current_database())),"
            " (SELECT wal_sync FROM pg_stat_wal)",
            (database,),
        ).fetchone()
        return cls(int(row[0] or 0), int(row[1]))

    def __sub__(self, other: ServerCounts) -> ServerCounts:
        return ServerCounts(self.commits - other.commits, self.wal_syncs - other.wal_syncs)


def process_cpu_seconds(pid: int) -> float | None:
    """The user and system CPU time a process of this machine has used so
    far (Linux's /proc), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ServerCpu:
    """The CPU time (user and system) of the PostgreSQL processes that serve
    one database, by process: its backends (the benchmark's own left out)
    and the server's writers every database shares (WAL writer,
    checkpointer, background writer).  Read from /proc, so only where the
    server runs on this machine.  A backend that ends between two readings
    takes its time with it; one that starts counts from its start."""

    seconds: Mapping[int, float]

    @classmethod
    def read(cls, connection: Any, database: str) -> ServerCpu | None:
        """The times now, asked on `connection` (a psycopg connection in
        autocommit); None when the server is not on this machine."""
        (address,) = connection.execute("SELECT inet_server_addr()").fetchone()
        if address is not None and not ipaddress.ip_address(address).is_loopback:
            return None
        pids = connection.execute(
            "SELECT pid FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
            " AND (datname = %s AND coalesce(application_name, '') NOT LIKE 'rundesk:bench%%'"
            "      OR backend_type IN ('walwriter', 'checkpointer', 'background writer'))",
            (database,),
        ).fetchall()
        seconds = {
            pid: used
            for (pid,) in pids
            if _is_postgres(pid) and (used := process_cpu_seconds(pid)) is not None
        }
        return cls(seconds) if seconds else None

    def since(self, earlier: ServerCpu) -> float:
        """Seconds of CPU used from `earlier` to this reading."""
        return sum(used - earlier.seconds.get(pid, 0.0) for pid, used in self.seconds.items())


def _is_postgres(pid: int) -> bool:
    """Whether the process `pid` of this machine is a PostgreSQL server's
    (a server elsewhere may name a pid that is another program's here)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "postgres"
    except OSError:
        return False


def holding_run(question: str) -> Run:
    """A run that only holds a benchmark's rows (events, copies): ended at
    once, so no executor of the database takes it, nor refuses to start
    (bench --throughput) because it waits to be claimed."""
    run = submit(question=question, documents=["(none)"])
    lifecycle.cancel(run.pk, "a benchmark", "a benchmark's run: never executed", [run.status])
    run.refresh_from_db()
    return run


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile: the smallest sample with at least q of the
    samples at or below it."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def p50(samples: list[float]) -> float:
    return round(statistics.median(samples), 3)

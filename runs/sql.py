"""Direct SQL on Django's own database connection, for the hot paths, and
what the runtime learns about that connection: its name in
pg_stat_activity, its backend (pid and start time), the transaction id a
write announced before its COMMIT (migration 0004), and a write that got no
answer because the connection was lost (CommitUnanswered; runs/outcomes.py
settles it)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from django.conf import settings
from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    OperationalError,
    connection,
    connections,
    transaction,
)

T = TypeVar("T")

ANNOUNCE_PREFIX = "rundesk:xid "
LOCK_NOT_AVAILABLE = "55P03"  # NOWAIT refusal and lock_timeout alike


@dataclass(frozen=True)
class Backend:
    """A server process, told apart from a later one that reuses its pid by
    its start time (server clock, ISO 8601; None: unknown, the pid alone)."""

    pid: int
    started: str | None


class _Session(threading.local):
    cursor: psycopg.Cursor[Any] | None = None
    announced_xid: int | None = None


_session = _Session()
# Connections that pass their notices to _on_notice (a pooled connection
# serves many threads, and is told once).
_heard: weakref.WeakSet[psycopg.Connection[Any]] = weakref.WeakSet()
_per_connection_lock = threading.Lock()
# Each connection's backend, asked once per connection (a pooled one serves
# many threads, one after another).
_backends: weakref.WeakKeyDictionary[psycopg.Connection[Any], Backend] = weakref.WeakKeyDictionary()


def _on_notice(diagnostic: psycopg.errors.Diagnostic) -> None:
    message = diagnostic.message_primary or ""
    if message.startswith(ANNOUNCE_PREFIX):
        _session.announced_xid = int(message.removeprefix(ANNOUNCE_PREFIX))


@contextmanager
def server_cursor() -> Iterator[psycopg.Cursor[Any]]:
    """A server-side-binding cursor on this thread's Django connection (same
    session, same transaction).  Unlike Django's cursors it can prepare a
    statement (`execute(..., prepare=True)`: planned once per connection, not
    once per call) and COPY.  Errors surface as Django's database exceptions.
    The cursor is kept for the connection's life: the executor runs two
    statements per step through it."""
    db, cursor = _kept_cursor()
    with db.wrap_database_errors:
        yield cursor


def fetch_one(sql: str, params: Any) -> tuple[Any, ...] | None:
    """One prepared statement through `server_cursor()`'s cursor, and its
    first row: in one call, for the statements a run sends at every step
    (a context manager's frames around each cost a hundredth of a step)."""
    db, cursor = _kept_cursor()
    with db.wrap_database_errors:
        cursor.execute(sql, params, prepare=True)
        return cursor.fetchone()


def _kept_cursor() -> tuple[Any, psycopg.Cursor[Any]]:
    """This thread's Django connection (connecting if need be) and the
    server-side-binding cursor kept on it."""
    db = connections[DEFAULT_DB_ALIAS]
    db.ensure_connection()
    cursor = _session.cursor
    if cursor is None or cursor.connection is not db.connection or cursor.closed:
        _listen(db.connection)
        cursor = _session.cursor = psycopg.Cursor(db.connection)
    return db, cursor


def _listen(raw: psycopg.Connection[Any]) -> None:
    """Passes the connection's notices (an announced xid) to this module."""
    with _per_connection_lock:
        if raw not in _heard:
            raw.add_notice_handler(_on_notice)
            _heard.add(raw)


def release_connection() -> None:
    """Gives this thread's connection back to the process's pool
    (dashboard/settings.py, RUNDESK_DB_POOL_SIZE), outside a transaction:
    the next statement takes one again.  A run calls it before it waits (a
    tool call, a pause), so that no run holds a connection while it waits.
    Without a pool the connection stays: closing it would cost a new one
    per step."""
    db = connections[DEFAULT_DB_ALIAS]
    if db.connection is not None and db.pool is not None and not db.in_atomic_block:
        db.close()


def application_name(role: str, run_id: int | None = None) -> str:
    """A connection's identity in pg_stat_activity, by the role it serves
    and the run it works for: `rundesk:executor:run-42`, `rundesk:capture`.
    Lock graphs and the sampler read it back (evidence/locks.py)."""
    return f"rundesk:{role}" + (f":run-{run_id}" if run_id is not None else "")


def array_literal(items: Sequence[str | int]) -> str:
    """`items` as a PostgreSQL array literal ('{"a","b"}'), for a parameter
    the statement casts (`%(x)s::text[]`, `::jsonb[]`, `::bigint[]`).
    psycopg adapts a list by looking through its elements for their type
    on every call: a step's write passes nine lists, and that looking cost
    more CPU than the statement's round trip.  One comprehension, no call
    per element: the per-step write makes nine of these."""
    return (
        "{"
        + ",".join(
            ['"' + str(item).replace("\\", "\\\\").replace('"', '\\"') + '"' for item in items]
        )
        + "}"
    )


def commit_asynchronously(cursor: Any, **also: str) -> None:
    """For the rest of this transaction, its COMMIT does not wait for its
    WAL to be flushed: the server flushes it with its other writes within a
    few wal_writer_delay.  For optional writes (the timeline, evidence
    capture) only; a claim sets the same in its own statement
    (lifecycle.ASYNC_COMMIT).  A server crash may lose that last moment's
    rows, never a fact, which commits synchronously.  Local to the
    transaction, so a pooler's server connection never carries it to
    another client; so are the other settings `also` names, set in the
    same round trip.  `cursor` is a `server_cursor()`: the statement is
    prepared."""
    settings = {"synchronous_commit": "off", **also}
    calls = ", ".join("set_config(%s, %s, true)" for _ in settings)
    cursor.execute(
        f"SELECT {calls}", [part for item in settings.items() for part in item], prepare=True
    )


def lock_refused(error: BaseException) -> bool:
    """Whether a database error is a lock not granted (NOWAIT, or a lock
    timeout such as `bounded_lock_waits` sets)."""
    return getattr(error.__cause__, "sqlstate", None) == LOCK_NOT_AVAILABLE


# Errors that say nothing of the statement but that it met its moment: a
# lock or statement timeout, a serialization failure, a deadlock.  It rolled
# back, and the same statement may well succeed again.
TRANSIENT = {LOCK_NOT_AVAILABLE, "57014", "40001", "40P01"}


def transient(error: BaseException) -> bool:
    return getattr(error.__cause__, "sqlstate", None) in TRANSIENT


def violated(error: BaseException) -> str | None:
    """The constraint a database error says was violated, if any."""
    return getattr(getattr(error.__cause__, "diag", None), "constraint_name", None)


def bounded_lock_waits() -> dict[str, str]:
    """For an optional write's transaction (`commit_asynchronously(cursor,
    **bounded_lock_waits())`): a lock not granted within
    RUNDESK_CAPTURE_LOCK_TIMEOUT_MS fails the statement (55P03) instead of
    holding the writer, and the runs waiting on it, behind a stranger."""
    return {"lock_timeout": f"{settings.RUNDESK_CAPTURE_LOCK_TIMEOUT_MS}ms"}


@contextmanager
def waits_bounded(timeout: str) -> Iterator[None]:
    """A transaction in which a lock not granted within `timeout` (e.g.
    "1s") fails the statement (LOCK_NOT_AVAILABLE) instead of waiting for
    as long as whoever holds it.  Local to the transaction (SET LOCAL), so
    a pooler's server connection never carries it on.  Inside a caller's
    transaction it is a savepoint, and the bound it sets holds until that
    transaction ends."""
    with transaction.atomic(), server_cursor() as cursor:
        cursor.execute("SELECT set_config('lock_timeout', %s, true)", [timeout], prepare=True)
        yield


def changes_rows_waits_bounded(sql: str, params: dict[str, Any], timeout: str) -> int:
    """One write statement in a transaction of its own whose lock waits end
    after `timeout` (LOCK_NOT_AVAILABLE), its row count.  It goes with
    `set_config('lock_timeout', ..., true)` in one simple query, which the
    server runs as one implicit transaction, committed at its end as a lone
    statement is (a fault that cuts it in flight cuts it alike), and which
    leaves no setting on the session: a pooled connection, or a
    transaction-mode PgBouncer's server connection, carries none to the
    next client.  Not prepared: a client-side-binding cursor."""
    db = connections[DEFAULT_DB_ALIAS]
    db.ensure_connection()
    _listen(db.connection)
    with db.wrap_database_errors, psycopg.ClientCursor(db.connection) as cursor:
        cursor.execute(
            "SELECT set_config('lock_timeout', %(lock_timeout)s, true); " + sql,
            {**params, "lock_timeout": timeout},
        )
        cursor.nextset()
        return cursor.rowcount


def unless_locked(work: Callable[[], T], timeout: str | None = None) -> T | None:
    """`work()` in a transaction of its own (a savepoint inside a caller's)
    whose lock waits end after `timeout` (None: the caller's bound holds):
    its result, or None when a lock was refused.  The caller's transaction
    goes on either way."""
    try:
        with waits_bounded(timeout) if timeout else transaction.atomic():
            return work()
    except DatabaseError as error:
        if lock_refused(error):
            return None
        raise


def name_connection(role: str, run_id: int | None = None) -> None:
    """Says in pg_stat_activity what this thread's connection serves, so a
    lock graph can name it.  The thread gives it back with `close_named`,
    which restores the process's name."""
    with connections[DEFAULT_DB_ALIAS].cursor() as cursor:
        cursor.execute(
            "SELECT set_config('application_name', %s, false)", [application_name(role, run_id)]
        )


def unnamed(raw: psycopg.Connection[Any]) -> None:
    """A name a thread gave the connection (`name_connection`) goes, so the
    next thread is not taken for another.  The name is the server's
    report, known without a round trip; only a renamed connection costs
    one."""
    if raw.info.parameter_status("application_name") != settings.DATABASES["default"][
        "OPTIONS"
    ].get("application_name"):
        raw.execute("RESET application_name")


def close_named() -> None:
    """Closes this thread's connection, which `name_connection` named: given
    back to the pool, it takes the process's name again first (`unnamed`).
    Only a thread that named its connection calls it: the pool has no
    reset of its own, which would send every connection given back, one
    per step of every run, through one of its worker threads."""
    db = connections[DEFAULT_DB_ALIAS]
    raw = db.connection
    if raw is not None and not raw.closed and not raw.broken and not db.in_atomic_block:
        try:
            unnamed(raw)
        except psycopg.Error:
            raw.close()  # broken after all: the pool discards a closed one
    db.close()


def this_backend() -> Backend:
    """The server process of this thread's connection (connecting if
    needed).  Asked once per connection."""
    db = connections[DEFAULT_DB_ALIAS]
    db.ensure_connection()
    with _per_connection_lock:
        backend = _backends.get(db.connection)
    if backend is None:
        with db.cursor() as cursor:
            cursor.execute(
                "SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()"
            )
            pid, started = cursor.fetchone()
        backend = Backend(pid, started.isoformat())
        with _per_connection_lock:
            _backends[db.connection] = backend
    return backend


def socket_fd() -> int:
    db = connections[DEFAULT_DB_ALIAS]
    db.ensure_connection()
    return db.connection.pgconn.socket


def connection_lost() -> bool:
    """True when this thread's connection is gone (closed or broken): a
    write that was under way got no answer."""
    raw = connections[DEFAULT_DB_ALIAS].connection
    return raw is None or raw.closed or raw.broken


def forget_announced_xid() -> None:
    _session.announced_xid = None


def announced_xid() -> int | None:
    """The transaction id the last write on this thread announced, if any."""
    return _session.announced_xid


class CommitUnanswered(OperationalError):
    """A write was sent and no answer came: it may or may not have committed."""

    def __init__(self, what: str, xid: int | None, backend: Backend | None, error: str) -> None:
        super().__init__(f"{what}: no answer from the database ({error})")
        self.what, self.xid, self.backend, self.error = what, xid, backend, error


@contextmanager
def unanswered_as(what: str) -> Iterator[None]:
    """Turns the loss of the connection during a write into CommitUnanswered
    (with the xid the write announced, if it got that far).  An error the
    database answered with is re-raised as it is."""
    forget_announced_xid()
    backend = this_backend()
    try:
        yield
    except DatabaseError as error:
        if not connection_lost():
            raise
        xid = announced_xid()
        connection.close()
        raise CommitUnanswered(what, xid, backend, str(error).strip()) from error

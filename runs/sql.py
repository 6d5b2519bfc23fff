"""Direct SQL on Django's own database connection, for the hot paths, and
what the runtime learns about that connection: its backend pid, and the
transaction id a write announced before its COMMIT (migration 0004)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from django.db import DEFAULT_DB_ALIAS, connections

ANNOUNCE_PREFIX = "rundesk:xid "


class _Session(threading.local):
    cursor: psycopg.Cursor[Any] | None = None
    announced_xid: int | None = None


_session = _Session()


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
    db = connections[DEFAULT_DB_ALIAS]
    db.ensure_connection()
    cursor = _session.cursor
    if cursor is None or cursor.connection is not db.connection or cursor.closed:
        db.connection.add_notice_handler(_on_notice)
        cursor = _session.cursor = psycopg.Cursor(db.connection)
    with db.wrap_database_errors:
        yield cursor


def name_connection(role: str, run_id: int | None = None) -> None:
    """Says in pg_stat_activity what this thread's connection serves, so a
    lock graph can name it: `rundesk:executor:run-42`."""
    suffix = f":run-{run_id}" if run_id is not None else ""
    with connections[DEFAULT_DB_ALIAS].cursor() as cursor:
        cursor.execute(
            "SELECT set_config('application_name', %s, false)", [f"rundesk:{role}{suffix}"]
        )


def backend_pid() -> int:
    """The server process of this thread's connection (connecting if needed)."""
    db = connections[DEFAULT_DB_ALIAS]
    db.ensure_connection()
    return db.connection.info.backend_pid


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

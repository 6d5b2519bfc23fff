"""Direct SQL on Django's own database connection, for the hot paths."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from django.db import DEFAULT_DB_ALIAS, connections

_cursors = threading.local()


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
    cursor = getattr(_cursors, "cursor", None)
    if cursor is None or cursor.connection is not db.connection or cursor.closed:
        cursor = _cursors.cursor = psycopg.Cursor(db.connection)
    with db.wrap_database_errors:
        yield cursor

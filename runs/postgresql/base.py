"""Django's PostgreSQL backend, with a pooled connection taken again at
the cost of taking it.

A run gives its connection back to the process's pool before every tool
call and takes one again after it (runs.sql.release_connection), so a
connection is taken once per action.  Django's `connect()` treats each
taking as a new connection: it works out the connection parameters (which
a pooled connection does not use), sets autocommit through psycopg's
generator machinery, runs the connection's set-up and sends
`connection_created`.  A connection the pool has served before, through
this backend, had all of that already: it is only taken, and its state
here reset as Django resets it.  That was about a tenth of the executor's
own Python work per action (~90 of ~750 function calls, hollow runs).
Without a pool, or for a connection new to this process, Django's
`connect()` runs as it is."""

from __future__ import annotations

import time
import weakref
from typing import Any

from django.db.backends.postgresql import base
from django.db.backends.signals import connection_created
from django.utils.asyncio import async_unsafe

# Raw connections that went once through Django's whole connect() here: the
# pool keeps them, and their set-up, from one taking to the next.
_set_up: weakref.WeakSet[Any] = weakref.WeakSet()


class DatabaseWrapper(base.DatabaseWrapper):
    @async_unsafe
    def connect(self) -> None:
        pool = self.pool
        if pool is None:
            super().connect()
            return
        # What Django's connect() checks and resets before it connects.
        self.check_settings()
        self.in_atomic_block = False
        self.savepoint_ids = []
        self.atomic_blocks = []
        self.needs_rollback = False
        self.health_check_enabled = self.settings_dict["CONN_HEALTH_CHECKS"]
        max_age = self.settings_dict["CONN_MAX_AGE"]
        self.close_at = None if max_age is None else time.monotonic() + max_age
        self.closed_in_transaction = False
        self.errors_occurred = False
        self.health_check_done = True
        # Taken from the pool: Django's get_new_connection() uses no
        # parameters then.
        self.connection = raw = self.get_new_connection({})
        autocommit = self.settings_dict["AUTOCOMMIT"]
        if raw in _set_up and raw.autocommit == autocommit:
            self.autocommit = autocommit
        else:
            self.set_autocommit(autocommit)
            self.init_connection_state()
            connection_created.send(sender=self.__class__, connection=self)
            _set_up.add(raw)
        self.run_on_commit = []

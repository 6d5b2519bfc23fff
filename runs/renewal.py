"""Lease renewal, per process: one thread, one statement, every lease.

A run's lease (runs/leases.py) lives RUNDESK_LEASE_SECONDS unless renewed.
Every lease this process holds is renewed every third of that time by one
UPDATE on one connection, which says which it renewed: a lease it did not
renew (another owner took the run, or the run ended) has its `lost` event
set, and the run stops at its next protected write, as the fence would
stop it anyway (that write changes 0 rows).  A renewal that fails (the
database did not answer) is logged and tried again at the next beat: a
lease that expires meanwhile is fenced out at its next write.

So a thousand runs in flight cost one statement every few seconds on one
connection, not a thread and a connection each (issue 39).  That connection
is the renewal's own, outside the process's pool (dashboard/settings.py),
opened while leases are held: a renewal never queues for a connection
behind the runs whose leases it keeps, however busy they are.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from django.conf import settings
from django.db import connection

from runs.leases import Lease, lease_ttl
from runs.sql import application_name

logger = logging.getLogger(__name__)

# Locks the rows in id order (LockRows sits above the sort), so two
# statements that lock many runs (a renewal, the sweep's requeue) cannot
# deadlock on each other; each lease is re-checked on the row it locked.
RENEW = """
    WITH mine AS (
        SELECT run.id FROM runs_run run
        JOIN unnest(%(runs)s::bigint[], %(owners)s::text[], %(epochs)s::bigint[])
            AS held (run_id, owner, epoch)
            ON run.id = held.run_id AND run.lease_owner = held.owner
            AND run.lease_epoch = held.epoch
        WHERE run.status = 'running'
        ORDER BY run.id
        FOR NO KEY UPDATE OF run)
    UPDATE runs_run SET lease_expires_at = clock_timestamp() + %(ttl)s
    FROM mine WHERE runs_run.id = mine.id
    RETURNING runs_run.id
"""


class Renewals:
    """The leases this process holds, and the thread that renews them
    (started when the first is held, ended when none is left)."""

    def __init__(self) -> None:
        self._held: dict[Lease, threading.Event] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._connection: psycopg.Connection[Any] | None = None  # the renewal thread's

    @contextmanager
    def held(self, lease: Lease) -> Iterator[threading.Event]:
        """Keeps `lease` renewed while inside; the event is set when a
        renewal found it gone."""
        lost = threading.Event()
        with self._lock:
            self._held[lease] = lost
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._beat, name="lease-renewal", daemon=True
                )
                self._thread.start()
        try:
            yield lost
        finally:
            with self._lock:
                self._held.pop(lease, None)

    @property
    def idle(self) -> bool:
        """No lease held and no renewal thread: the next lease held starts
        one, whose first beat is a third of a lease away."""
        with self._lock:
            return self._thread is None

    def renew(self) -> int:
        """Renews every lease held now, in one statement; sets `lost` for
        those it could not renew.  How many it renewed."""
        with self._lock:
            held = dict(self._held)
        if not held:
            self._close()  # an idle renewal keeps no session
            return 0
        leases = list(held)
        params = {
            "runs": [lease.run_id for lease in leases],
            "owners": [lease.owner for lease in leases],
            "epochs": [lease.epoch for lease in leases],
            "ttl": lease_ttl(),
        }
        if self._connection is None or self._connection.closed:
            self._connection = own_connection()
        try:
            rows = self._connection.execute(RENEW, params, prepare=True).fetchall()
        except psycopg.Error:
            self._close()
            raise
        renewed = {row[0] for row in rows}
        for lease, lost in held.items():
            if lease.run_id not in renewed:
                lost.set()
        return len(renewed)

    def _beat(self) -> None:
        while True:
            with self._lock:
                if not self._held:
                    self._thread = None
                    self._close()
                    return
            # Not under the lock: a lease held meanwhile waits a beat.
            time.sleep(settings.RUNDESK_LEASE_SECONDS / 3)
            try:
                self.renew()
            except psycopg.Error as error:
                # The next protected write decides: a lease that expires
                # meanwhile changes 0 rows there, and its run stops.
                logger.warning("lease renewal failed: %s", str(error).strip())

    def _close(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(psycopg.Error):
                self._connection.close()
            self._connection = None


def own_connection() -> psycopg.Connection[Any]:
    """A connection of the renewal's own, outside the pool, named for it."""
    params = connection.get_connection_params()
    params["application_name"] = application_name(f"{settings.PROCESS_ROLE}-renewal")
    params["cursor_factory"] = psycopg.Cursor  # server-side binding: prepared once
    return psycopg.connect(**params, autocommit=True)


renewals = Renewals()

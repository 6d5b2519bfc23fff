"""The evidence records of a run: a Source row for each document it read, a
ModelCall row for each model call.  Only the capture writer makes them
(evidence/capture.py), off the main path; no lock wait of theirs lasts
longer than capture's lock timeout, and one that fails leaves a gap."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import DatabaseError, transaction

from runs.sql import bounded_lock_waits, commit_asynchronously, server_cursor

logger = logging.getLogger(__name__)


@contextmanager
def bounded() -> Iterator[Any]:
    """An evidence write's transaction (in capture's, a savepoint of it):
    it can fail, never hold anyone up.
    Its cursor can prepare its statements (`execute(..., prepare=True)`):
    the capture writer runs the same few statements for every record, and
    planning them each time cost it more than running them."""
    with transaction.atomic(), server_cursor() as cursor:
        commit_asynchronously(cursor, **bounded_lock_waits())
        yield cursor


def record_source(run_id: int, action_id: int, path: str, sha256: str, size: int) -> int:
    """A document as it was when read; its id (a resumed run finds it)."""
    with bounded() as cursor:
        cursor.execute(
            """INSERT INTO evidence_source (run_id, path, read_action_id, digest, bytes,
                   created_at, changed)
               VALUES (%s, %s, %s, %s, %s, now(), false)
               ON CONFLICT (run_id, path) DO NOTHING
               RETURNING id""",
            [run_id, path, action_id, sha256, size],
            prepare=True,
        )
        # Already recorded (a resumed run): read, never lock, so capture's
        # share locks on the row never hold this up.
        row = cursor.fetchone() or _first(
            cursor,
            "SELECT id FROM evidence_source WHERE run_id = %s AND path = %s",
            [run_id, path],
        )
        return row[0]


def record_model_call(
    run_id: int,
    action_id: int,
    provider: str,
    input_digest: str,
    output_digest: str,
    paths: list[str],
) -> int:
    """The model record of one model-call action, linked to its sources;
    its id."""
    with bounded() as cursor:
        cursor.execute(
            """INSERT INTO evidence_modelcall (run_id, action_id, provider, input_digest,
                   output_digest, created_at)
               VALUES (%s, %s, %s, %s, %s, now())
               ON CONFLICT (action_id) DO NOTHING
               RETURNING id""",
            [run_id, action_id, provider, input_digest, output_digest],
            prepare=True,
        )
        row = cursor.fetchone() or _first(
            cursor, "SELECT id FROM evidence_modelcall WHERE action_id = %s", [action_id]
        )
        model_call_id = row[0]
    try:
        with bounded() as cursor:
            cursor.execute(
                """INSERT INTO evidence_modelcall_sources (modelcall_id, source_id)
                   SELECT %s, id FROM evidence_source WHERE run_id = %s AND path = ANY(%s)
                   ON CONFLICT DO NOTHING""",
                [model_call_id, run_id, paths],
                prepare=True,
            )
    except DatabaseError as error:
        # The model record stands without its links: a copy of it then
        # names no source.
        logger.warning("run %s: sources of model call %s not linked: %s", run_id, action_id, error)
    return model_call_id


def _first(cursor: Any, sql: str, params: list[Any]) -> tuple[Any, ...]:
    cursor.execute(sql, params, prepare=True)
    return cursor.fetchone()

"""The evidence records of a run: a Source row for each document it read, a
ModelCall row for each model call.  Only the capture writer makes them
(evidence/capture.py), off the main path; no lock wait of theirs lasts
longer than capture's lock timeout, and one that fails leaves a gap."""

from __future__ import annotations

import json
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


# What record_new sends: the documents read, then the model calls whose
# model record is new, each with its links, its copy and its run's count.
NEW_SOURCES = """INSERT INTO evidence_source (run_id, path, read_action_id, digest, bytes,
        created_at, changed)
    SELECT s.run, s.path, s.action, s.digest, s.bytes, now(), false
    FROM json_to_recordset(%s::json)
        AS s(run bigint, path text, action bigint, digest text, bytes bigint)
    ON CONFLICT (run_id, path) DO NOTHING"""
NEW_CALLS = """WITH c AS (
        SELECT * FROM json_to_recordset(%s::json) AS c(run bigint, action bigint,
            provider text, input_digest text, output_digest text, paths text[],
            input text, output text, input_bytes int, output_bytes int, truncated bool)),
    call AS (
        INSERT INTO evidence_modelcall (run_id, action_id, provider, input_digest,
            output_digest, created_at)
        SELECT run, action, provider, input_digest, output_digest, now() FROM c
        ON CONFLICT (action_id) DO NOTHING
        RETURNING id, action_id),
    new AS (
        SELECT call.id, c.* FROM call JOIN c ON c.action = call.action_id),
    -- Each call's documents, looked up by (run, path) for that call alone:
    -- a join would let the planner, which cannot know how many rows the
    -- JSON holds, scan every document ever read.
    source AS (
        SELECT new.id AS call, unnest(ARRAY(
            SELECT s.id FROM evidence_source s
            WHERE s.run_id = new.run AND s.path = ANY(new.paths))) AS source
        FROM new),
    linked AS (
        INSERT INTO evidence_modelcall_sources (modelcall_id, source_id)
        SELECT call, source FROM source),
    copy AS (
        INSERT INTO evidence_evidencecopy (run_id, model_call_id, input, output,
            input_bytes, output_bytes, truncated, created_at)
        SELECT run, id, input, output, input_bytes, output_bytes, truncated, now()
        FROM new
        RETURNING id, model_call_id, run_id),
    copy_linked AS (
        INSERT INTO evidence_evidencecopy_sources (evidencecopy_id, source_id)
        SELECT copy.id, source.source FROM copy
        JOIN source ON source.call = copy.model_call_id),
    counted AS (
        INSERT INTO evidence_capturestats (run_id, captured, lost)
        SELECT run_id, count(*), 0 FROM copy GROUP BY run_id
        ON CONFLICT (run_id) DO UPDATE
            SET captured = evidence_capturestats.captured + EXCLUDED.captured)
    SELECT action_id FROM call"""


def record_new(cursor: Any, sources: list[dict[str, Any]], calls: list[dict[str, Any]]) -> set[int]:
    """Many records in two statements, in the caller's transaction: the
    documents read (`sources`: run, path, action, digest, bytes), then the
    model calls (`calls`: run, action, provider, input_digest,
    output_digest, paths, and the copy's input, output, input_bytes,
    output_bytes, truncated) whose model record is new, each with its
    links, its copy and the run's count.  The action ids of the model calls
    saved; one whose model record was there already (a run resumed) is
    not, and is left to its caller, which saves it with its locks
    (evidence/capture.py).  Capture's path for what a live run hands it:
    two statements for a batch, where a record alone takes seven."""
    if sources:
        cursor.execute(NEW_SOURCES, [json.dumps(sources, ensure_ascii=False)], prepare=True)
    if not calls:
        return set()
    cursor.execute(NEW_CALLS, [json.dumps(calls, ensure_ascii=False)], prepare=True)
    return {action_id for (action_id,) in cursor.fetchall()}

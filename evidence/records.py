"""The evidence records of a run: a Source row for each document it read, a
ModelCall row for each model call.  Only the capture writer makes them
(evidence/capture.py), off the main path; no lock wait of theirs lasts
longer than capture's lock timeout, and one that fails leaves a gap."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connection, transaction

from runs.sql import commit_asynchronously, write_optional

logger = logging.getLogger(__name__)


def bounded_lock_waits() -> dict[str, str]:
    """The setting by which a lock not granted within
    RUNDESK_CAPTURE_LOCK_TIMEOUT_MS fails the statement (55P03)."""
    return {"lock_timeout": f"{settings.RUNDESK_CAPTURE_LOCK_TIMEOUT_MS}ms"}


@contextmanager
def bounded() -> Iterator[Any]:
    """An evidence write's transaction: it can fail, never hold anyone up."""
    with transaction.atomic(), connection.cursor() as cursor:
        commit_asynchronously(cursor, **bounded_lock_waits())
        yield cursor


def record_source(run_id: int, action_id: int, path: str, sha256: str, size: int) -> int:
    """A document as it was when read; its id (a resumed run finds it).
    One round trip (runs.sql.write_optional)."""
    row = write_optional(
        # Its id is read by a statement of its own, which sees the row
        # however it got there (this insert, an earlier owner's, one that
        # committed while this one waited).  Read, never locked, so
        # capture's share locks on the row never hold this up.
        """INSERT INTO evidence_source (run_id, path, read_action_id, digest, bytes,
               created_at, changed)
           VALUES (%(run)s, %(path)s, %(action)s, %(digest)s, %(bytes)s, now(), false)
           ON CONFLICT (run_id, path) DO NOTHING;
           SELECT id FROM evidence_source WHERE run_id = %(run)s AND path = %(path)s""",
        {"run": run_id, "path": path, "action": action_id, "digest": sha256, "bytes": size},
        **bounded_lock_waits(),
    )
    assert row is not None
    return row[0]


def record_model_call(
    run_id: int,
    action_id: int,
    provider: str,
    input_digest: str,
    output_digest: str,
    paths: list[str],
) -> int:
    """The model record of one model-call action, then its links to its
    sources, each in one round trip; its id."""
    row = write_optional(
        """INSERT INTO evidence_modelcall (run_id, action_id, provider, input_digest,
               output_digest, created_at)
           VALUES (%(run)s, %(action)s, %(provider)s, %(input)s, %(output)s, now())
           ON CONFLICT (action_id) DO NOTHING;
           SELECT id FROM evidence_modelcall WHERE action_id = %(action)s""",
        {
            "run": run_id,
            "action": action_id,
            "provider": provider,
            "input": input_digest,
            "output": output_digest,
        },
        **bounded_lock_waits(),
    )
    assert row is not None
    model_call_id = row[0]
    try:
        write_optional(
            """INSERT INTO evidence_modelcall_sources (modelcall_id, source_id)
               SELECT %(call)s, id FROM evidence_source WHERE run_id = %(run)s
                   AND path = ANY(%(paths)s)
               ON CONFLICT DO NOTHING""",
            {"call": model_call_id, "run": run_id, "paths": paths},
            **bounded_lock_waits(),
        )
    except DatabaseError as error:
        # The model record stands without its links: a copy of it then
        # names no source.
        logger.warning("run %s: sources of model call %s not linked: %s", run_id, action_id, error)
    return model_call_id

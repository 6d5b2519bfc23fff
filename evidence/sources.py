"""Source refresh: are a run's documents still what the run read?

A resumed run's sources are checked against the corpus by the capture
writer (evidence/capture.py SourceCheck), off the main path: a document
that changed since it was read is marked `changed`, and the timeline says
so (the answer may cite a version that no longer exists).  The refresh
touches evidence rows only: it never locks the run row, so the run never
waits for it (the incident's refresh did: reproduce_contention keeps that
lock to show the cycle it closed).
"""

from __future__ import annotations

import hashlib
from typing import Any

from django.conf import settings

from evidence.records import bounded
from runs.agent import ToolRefused
from runs.agents.tools import resolve_in_corpus


class SourceRefresh:
    """The refresh's statements.  `run()` runs them in one transaction;
    `reproduce_contention` runs `mark_sources` inside the incident's old
    transaction."""

    def __init__(self, run_id: int) -> None:
        self.run_id = run_id
        # Files are hashed before the transaction: no lock is held for I/O.
        self.current = self._current()

    def _current(self) -> dict[int, str]:
        with bounded() as cursor:
            cursor.execute(
                "SELECT id, path FROM evidence_source WHERE run_id = %s ORDER BY id", [self.run_id]
            )
            sources = cursor.fetchall()
        return {source_id: _digest_now(path) for source_id, path in sources}

    def mark_sources(self, cursor: Any) -> list[str]:
        """Marks each source checked, and changed if its file differs now.
        Returns the paths that changed."""
        cursor.execute(
            """UPDATE evidence_source AS s
               SET checked_at = now(), changed = (s.digest IS DISTINCT FROM now_.digest)
               FROM unnest(%s::bigint[], %s::text[]) AS now_(id, digest)
               WHERE s.id = now_.id AND s.run_id = %s
               RETURNING s.path, s.changed""",
            [list(self.current), list(self.current.values()), self.run_id],
        )
        return sorted(path for path, changed in cursor.fetchall() if changed)

    def run(self) -> list[str]:
        """An observation: its lock waits are bounded like capture's."""
        with bounded() as cursor:
            return self.mark_sources(cursor)


def _digest_now(path: str) -> str:
    """The file's digest now, or '' when it can no longer be read."""
    try:
        return hashlib.sha256(
            resolve_in_corpus(path, settings.RUNDESK_CORPUS_DIR).read_bytes()
        ).hexdigest()
    except (ToolRefused, OSError):
        return ""

"""`bench --evidence-locked`: a whole run with no lock, and with every
evidence table locked by another session for the run's whole life."""

from __future__ import annotations

import statistics
import time
from typing import Any

import psycopg
from django.conf import settings
from django.db import connection
from django.db.models import Sum
from django.utils import timezone

from evidence.capture import capture
from evidence.models import CaptureGap, EvidenceCopy
from evidence.retries import retry_window
from runs.executor import claim_and_drive
from runs.models import AnswerRevision
from runs.submission import submit
from runs.timeline import timeline


def report(rounds: int) -> dict[str, Any]:
    """Runs the sample question over the whole corpus, in interleaved
    rounds: with no lock, then with another session holding every
    evidence table in SHARE mode, then in ACCESS EXCLUSIVE mode, each for
    the run's whole life.  A locked run must complete with its final
    answer in about the baseline's time; what capture could not save
    (the lock is held until capture has tried everything the run handed
    it) is counted as gaps, read once the lock is gone; those a try again
    saved after the lock (evidence/retries.py) are gaps still, and counted
    apart as saved later."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
            " AND tablename LIKE 'evidence\\_%%' ORDER BY tablename"
        )
        tables = ", ".join(name for (name,) in cursor.fetchall())
    documents = sorted(
        path.name for path in settings.RUNDESK_CORPUS_DIR.glob("*.md") if path.name != "README.md"
    )
    seconds: dict[str, list[float]] = {"none": [], "SHARE": [], "ACCESS EXCLUSIVE": []}
    published: list[dict[str, Any]] = []
    released: dict[int, Any] = {}  # a locked run: when its lock was released
    for _ in range(rounds):
        for mode in seconds:
            run = submit(
                question=f"bench --evidence-locked ({mode}): compare these funds",
                documents=documents,
            )
            with psycopg.connect(**connection.get_connection_params()) as other:
                other.execute("SET application_name = 'bench: evidence locked'")
                if mode != "none":
                    other.execute(f"LOCK TABLE {tables} IN {mode} MODE")
                start = time.perf_counter()
                outcome = claim_and_drive(run.pk)
                seconds[mode].append(time.perf_counter() - start)
                final = AnswerRevision.objects.filter(run=run, is_final=True).exists()
                # The lock outlives what the run handed to capture too.
                capture.flush(60)
                other.rollback()
                if mode != "none":
                    released[run.pk] = timezone.now()
            published.append(
                {"lock": mode, "run_id": run.pk, "outcome": outcome, "final_answer": final}
            )
    capture.wait_for_retries(retry_window(settings.RUNDESK_CAPTURE_RETRY_TRIES) + 5.0)
    timeline.flush()
    gaps = CaptureGap.objects.filter(run_id__in=released)
    return {
        "rounds": rounds,
        "documents": len(documents),
        "baseline_s": round(statistics.median(seconds["none"]), 3),
        "share_s": round(statistics.median(seconds["SHARE"]), 3),
        "access_exclusive_s": round(statistics.median(seconds["ACCESS EXCLUSIVE"]), 3),
        "published": published,
        "gaps": gaps.aggregate(n=Sum("count"))["n"] or 0,
        "saved_later": gaps.filter(saved_at__isnull=False).aggregate(n=Sum("count"))["n"] or 0,
        "captured_while_locked": sum(
            EvidenceCopy.objects.filter(run_id=run_id, created_at__lt=at).count()
            for run_id, at in released.items()
        ),
    }

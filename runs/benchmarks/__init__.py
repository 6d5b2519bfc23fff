"""The benchmarks `manage.py bench` runs, one module each, named for what it
measures, and the statistics they share (`reproduce_contention` uses them
too).

- steps: the commits and WAL syncs of a step of the real agent path, and
  its time against a single-row INSERT + COMMIT; a no-op step alone;
- capture: what handing a copy to a stalled evidence capture costs;
- evidence_locked: a whole run while every evidence table is locked;
- peers: a no-op step through DBOS, LangGraph and Rundesk, side by side;
- throughput: runs/s of executor processes against the commit ceiling, and
  the failover time after an executor dies;
- scale: runs/s of Celery worker processes on a broker;
- bundle: export time and peak memory of investigation bundles;
- pages: server time of the dashboard's pages, small tables against large.
"""

from __future__ import annotations

import math
import statistics

from django.db.models.functions import Now

from runs.models import Run, RunStatus


def holding_run(question: str) -> Run:
    """A run that only holds a benchmark's rows (events, copies): ended at
    once, so no executor of the database takes it, nor refuses to start
    (bench --throughput) because it waits to be claimed."""
    run = Run.objects.submit(question=question, documents=["(none)"])
    Run.objects.filter(pk=run.pk).update(
        status=RunStatus.CANCELLED,
        status_reason="a benchmark's run: never executed",
        finished_at=Now(),
    )
    run.refresh_from_db()
    return run


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile: the smallest sample with at least q of the
    samples at or below it."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def p50(samples: list[float]) -> float:
    return round(statistics.median(samples), 3)

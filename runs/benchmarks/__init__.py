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


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile: the smallest sample with at least q of the
    samples at or below it."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def p50(samples: list[float]) -> float:
    return round(statistics.median(samples), 3)

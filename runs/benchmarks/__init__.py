"""The benchmarks `manage.py bench` runs, one module each, named for what it
measures, and the statistics they share (`reproduce_contention` uses them
too).

- steps: an executor step against a single-row INSERT + COMMIT;
- capture: what handing a copy to a stalled evidence capture costs;
- evidence_locked: a whole run while every evidence table is locked;
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

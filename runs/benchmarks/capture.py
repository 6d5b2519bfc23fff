"""`bench --capture`: the cost of handing a copy to evidence capture while
the database is stalled for it."""

from __future__ import annotations

import time
from typing import Any

import psycopg
from django.db import connection

from evidence.capture import Capture, Copy
from runs.benchmarks import holding_run, p50, percentile


def report(copies: int) -> dict[str, Any]:
    """Hands `copies` copies to a capture writer while another session
    holds an ACCESS EXCLUSIVE lock on the evidence tables: the writer is
    stuck on its first copy, the queue fills, the rest become gaps.  What
    the caller pays is the time of each submit()."""
    run = holding_run("bench: capture")
    writer = Capture(capacity=max(1, copies // 4))
    writer.flush()  # the writer thread is running, as in a live executor
    params = connection.get_connection_params()
    samples = []
    with psycopg.connect(**params) as stall:
        stall.execute("LOCK TABLE evidence_source, evidence_modelcall IN ACCESS EXCLUSIVE MODE")
        for i in range(copies):
            start = time.perf_counter()
            writer.submit(Copy(run.pk, i, "x" * 4096, "y"))
            samples.append((time.perf_counter() - start) * 1000)
        stall.rollback()
    writer.stop()
    return {
        "copies": copies,
        "enqueue_ms_p50": p50(samples),
        "enqueue_ms_p99": round(percentile(samples, 0.99), 4),
        "enqueue_ms_max": round(max(samples), 4),
        "queue_capacity": writer.capacity,
    }

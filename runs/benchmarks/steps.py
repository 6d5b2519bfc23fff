"""`bench` (the default): one executor step (boundary + no-op read +
receipt) against a single-row INSERT + COMMIT on the same database."""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from django.core.management.base import CommandError

from runs.benchmarks import p50
from runs.dispatch import Dispatcher
from runs.leases import Lease, new_owner_name
from runs.models import Run, RunStatus
from runs.sql import server_cursor
from runs.timeline import timeline


def report(steps: int) -> dict[str, Any]:
    samples = measure(steps)
    commit = statistics.median(samples["commit"])
    return {
        "steps": steps,
        "step_ms_p50": p50(samples["step"]),
        "commit_ms_p50": p50(samples["commit"]),
        "step_over_commit": round(statistics.median(samples["step"]) / commit, 2),
        # Where a step's time goes: its two fenced writes alone, and a
        # round trip that writes nothing.
        "writes_ms_p50": p50(samples["writes"]),
        "writes_over_commit": round(statistics.median(samples["writes"]) / commit, 2),
        "roundtrip_ms_p50": p50(samples["roundtrip"]),
    }


@contextlib.contextmanager
def noop_run(steps: int) -> Iterator[Dispatcher]:
    """The Dispatcher of a claimed run for `steps` no-op reads
    (`noop_step`), finished on the way out."""
    run = Run.objects.submit(
        question=f"bench: {steps} no-op reads", documents=["(none)"], action_budget=2 * steps
    )
    lease = Lease.claim(run.pk, new_owner_name())
    if lease is None:
        raise CommandError(f"could not claim bench run {run.pk}")
    dispatcher = Dispatcher(lease, stop=threading.Event(), lease_lost=threading.Event())
    yield dispatcher
    lease.finish(RunStatus.COMPLETED, "bench")
    timeline.flush()


def noop_step(dispatcher: Dispatcher, i: int) -> object:
    """The run's i-th no-op read through the real executor path
    (Dispatcher.step: boundary, tool, receipt; timeline)."""
    return dispatcher.step(f"noop:{i}", "noop", {"i": i})


def measure(steps: int) -> dict[str, list[float]]:
    """Steps through the real executor path (lease, Dispatcher.step:
    boundary, tool, receipt; timeline), each followed by a single-row
    INSERT + COMMIT (autocommit: one round trip) on a logged table, on the
    same connection: both see the same machine at the same moment.  Each
    round also times the step's two fenced writes made through the lease
    alone (no dispatcher, timeline or tool) and a `SELECT 1`."""
    samples: dict[str, list[float]] = {"step": [], "commit": [], "writes": [], "roundtrip": []}

    def timed(name: str, work: Callable[..., object], *args: Any) -> None:
        start = time.perf_counter()
        work(*args)
        samples[name].append((time.perf_counter() - start) * 1000)

    def writes(lease: Lease, i: int) -> None:
        action = lease.record_boundary(
            step_key=f"writes:{i}", kind="noop", effect_class="read", input={"i": i}
        )
        lease.record_receipt(action, {"ok": True})

    with noop_run(steps) as dispatcher, server_cursor() as cursor:
        cursor.execute(
            "CREATE TABLE IF NOT EXISTS rundesk_bench_commit "
            "(id bigserial PRIMARY KEY, at timestamptz NOT NULL DEFAULT now())"
        )
        for i in range(steps):
            timed("step", noop_step, dispatcher, i)
            timed("commit", cursor.execute, "INSERT INTO rundesk_bench_commit DEFAULT VALUES")
            timed("writes", writes, dispatcher.lease, i)
            timed("roundtrip", cursor.execute, "SELECT 1")
        cursor.execute("DROP TABLE rundesk_bench_commit")
    return samples

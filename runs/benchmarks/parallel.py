"""`bench --parallel`: 20 reads of 200 ms each (a `tool_delay` fault plan on
no-op reads), side by side in one batch and then one after another, through
the real executor path (Dispatcher.side_by_side and Dispatcher.step), with
the durable commits each read cost; against the bound the batch must keep,
1.5 x (200 ms + 4 commits)."""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from django.core.management.base import CommandError

from runs.agent import ActionFailed, Step
from runs.agents.tools import NOOP
from runs.benchmarks.steps import commit_table, counts_now
from runs.dispatch import Dispatcher
from runs.leases import Lease, new_owner_name
from runs.models import RunStatus
from runs.sql import server_cursor
from runs.submission import submit
from runs.timeline import timeline

READS = 20
DELAY_MS = 200


def report() -> dict[str, Any]:
    commit_ms = _commit_ms()
    side_by_side, commits = _side_by_side()
    one_after_another = _one_after_another()
    bound_ms = 1.5 * (DELAY_MS + 4 * commit_ms)
    return {
        "reads": READS,
        "delay_ms": DELAY_MS,
        "commit_ms_p50": round(commit_ms, 3),
        "side_by_side_ms": round(side_by_side, 1),
        "bound_ms": round(bound_ms, 1),
        "within_bound": side_by_side <= bound_ms,
        "one_after_another_ms": round(one_after_another, 1),
        "commits_per_read": round(commits / READS, 3),
    }


def _dispatcher() -> Dispatcher:
    """A claimed run whose every no-op read waits DELAY_MS."""
    run = submit(
        question=f"bench --parallel: {READS} reads of {DELAY_MS} ms",
        documents=["(none)"],
        faults=[{"point": "tool_delay", "ms": DELAY_MS}],
        action_budget=READS + 1,
    )
    lease = Lease.claim(run.pk, new_owner_name())
    if lease is None:
        raise CommandError(f"could not claim bench run {run.pk}")
    return Dispatcher(lease, stop=threading.Event(), lease_lost=threading.Event(), tools=[NOOP])


def _side_by_side() -> tuple[float, int]:
    """The batch's time (ms), and the durable commits the run made in all
    (its boundaries, its receipts with its finish)."""
    dispatcher = _dispatcher()
    before = counts_now()
    started = time.perf_counter()
    results = dispatcher.side_by_side([Step(f"read:{i}", "noop", {"i": i}) for i in range(READS)])
    elapsed = (time.perf_counter() - started) * 1000
    dispatcher.finish(RunStatus.COMPLETED, "bench")
    used = counts_now() - before
    if any(isinstance(result, ActionFailed) for result in results):
        raise CommandError("bench --parallel: a read failed")
    timeline.flush()
    return elapsed, used.commits


def _one_after_another() -> float:
    dispatcher = _dispatcher()
    started = time.perf_counter()
    for i in range(READS):
        dispatcher.step(f"read:{i}", "noop", {"i": i})
    elapsed = (time.perf_counter() - started) * 1000
    dispatcher.finish(RunStatus.COMPLETED, "bench")
    timeline.flush()
    return elapsed


def _commit_ms() -> float:
    with commit_table(), server_cursor() as cursor:
        samples = []
        for _ in range(50):
            started = time.perf_counter()
            cursor.execute("INSERT INTO rundesk_bench_commit DEFAULT VALUES")
            samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)

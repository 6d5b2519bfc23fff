from __future__ import annotations

import json
import statistics
import threading
import time
from typing import Any

import psycopg
from django.core.management.base import BaseCommand, CommandError
from django.db import connection

from dashboard import bench as dashboard_bench
from evidence.capture import Capture
from runs.dispatch import Dispatcher
from runs.leases import Lease, new_owner_name
from runs.models import Run, RunStatus
from runs.percentiles import percentile
from runs.sql import server_cursor
from runs.timeline import timeline


def p50(samples: list[float]) -> float:
    return round(statistics.median(samples), 3)


class Command(BaseCommand):
    help = (
        "Measures one executor step (boundary + no-op read + receipt) against a single-row "
        "INSERT + COMMIT on the same database; with --capture, the cost of handing a copy "
        "to evidence capture while the database is stalled for it."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--steps", type=int, default=500)
        parser.add_argument("--capture", action="store_true")
        parser.add_argument(
            "--dashboard",
            action="store_true",
            help="server time of the dashboard's pages at 100 and 100,000 runs (own databases)",
        )
        parser.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        steps = options["steps"]
        if steps < 1:
            raise CommandError("--steps must be at least 1")
        if options["dashboard"]:
            report: Any = {"pages": dashboard_bench.measure()}
        elif options["capture"]:
            report = self._capture(steps)
        else:
            report = self._step_report(steps)
        if options["json"]:
            self.stdout.write(json.dumps(report))
        else:
            for key, value in report.items():
                self.stdout.write(f"{key}: {value}")

    def _step_report(self, steps: int) -> dict[str, Any]:
        step_ms, commit_ms = self._measure(steps)
        return {
            "steps": steps,
            "step_ms_p50": p50(step_ms),
            "commit_ms_p50": p50(commit_ms),
            "step_over_commit": round(statistics.median(step_ms) / statistics.median(commit_ms), 2),
        }

    def _capture(self, copies: int) -> dict[str, Any]:
        """Hands `copies` copies to a capture writer while another session
        holds an ACCESS EXCLUSIVE lock on the evidence tables: the writer is
        stuck on its first copy, the queue fills, the rest become gaps.  What
        the caller pays is the time of each submit()."""
        run = Run.objects.submit(question="bench: capture", documents=["(none)"])
        writer = Capture(capacity=max(1, copies // 4))
        writer.flush()  # the writer thread is running, as in a live executor
        params = connection.get_connection_params()
        samples = []
        with psycopg.connect(**params) as stall:
            stall.execute("LOCK TABLE evidence_source, evidence_modelcall IN ACCESS EXCLUSIVE MODE")
            for i in range(copies):
                start = time.perf_counter()
                writer.submit(run_id=run.pk, model_call_id=i, input="x" * 4096, output="y")
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

    def _measure(self, steps: int) -> tuple[list[float], list[float]]:
        """Steps through the real executor path (lease, Dispatcher.step:
        boundary, tool, receipt; timeline), each followed by a single-row
        INSERT + COMMIT (autocommit: one round trip) on a logged table, on the
        same connection: both see the same machine at the same moment."""
        run = Run.objects.submit(
            question=f"bench: {steps} no-op reads", documents=["(none)"], action_budget=steps
        )
        lease = Lease.claim(run.pk, new_owner_name())
        if lease is None:
            raise CommandError(f"could not claim bench run {run.pk}")
        dispatcher = Dispatcher(lease, stop=threading.Event(), lease_lost=threading.Event())
        step_ms, commit_ms = [], []
        with server_cursor() as cursor:
            cursor.execute(
                "CREATE TABLE IF NOT EXISTS rundesk_bench_commit "
                "(id bigserial PRIMARY KEY, at timestamptz NOT NULL DEFAULT now())"
            )
            for i in range(steps):
                start = time.perf_counter()
                dispatcher.step(f"noop:{i}", "noop", {"i": i})
                step_ms.append((time.perf_counter() - start) * 1000)
                start = time.perf_counter()
                cursor.execute("INSERT INTO rundesk_bench_commit DEFAULT VALUES")
                commit_ms.append((time.perf_counter() - start) * 1000)
            cursor.execute("DROP TABLE rundesk_bench_commit")
        lease.finish(RunStatus.COMPLETED, "bench")
        timeline.flush()
        return step_ms, commit_ms

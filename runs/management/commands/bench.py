from __future__ import annotations

import json
import statistics
import threading
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import connection

from runs.dispatch import Dispatcher
from runs.leases import Lease, new_owner_name
from runs.models import Run, RunStatus
from runs.timeline import timeline


def p50(samples: list[float]) -> float:
    return round(statistics.median(samples), 3)


class Command(BaseCommand):
    help = (
        "Measures one executor step (boundary + no-op read + receipt) against a single-row "
        "INSERT + COMMIT on the same database."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--steps", type=int, default=500)
        parser.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        steps = options["steps"]
        if steps < 1:
            raise CommandError("--steps must be at least 1")
        commits = self._commit_round_trips(steps // 2)
        step_ms = self._steps(steps)
        commits += self._commit_round_trips(steps - steps // 2)
        report = {
            "steps": steps,
            "step_ms_p50": p50(step_ms),
            "commit_ms_p50": p50(commits),
            "step_over_commit": round(statistics.median(step_ms) / statistics.median(commits), 2),
        }
        if options["json"]:
            self.stdout.write(json.dumps(report))
        else:
            for key, value in report.items():
                self.stdout.write(f"{key}: {value}")

    def _steps(self, steps: int) -> list[float]:
        """Real executor path: lease, Dispatcher.step (boundary, tool, receipt), timeline."""
        run = Run.objects.submit(
            question=f"bench: {steps} no-op reads", documents=["(none)"], action_budget=steps
        )
        lease = Lease.claim(run.pk, new_owner_name())
        if lease is None:
            raise CommandError(f"could not claim bench run {run.pk}")
        dispatcher = Dispatcher(lease, stop=threading.Event(), lease_lost=threading.Event())
        samples = []
        for i in range(steps):
            start = time.perf_counter()
            dispatcher.step(f"noop:{i}", "noop", {"i": i})
            samples.append((time.perf_counter() - start) * 1000)
        lease.finish(RunStatus.COMPLETED, "bench")
        timeline.flush()
        return samples

    def _commit_round_trips(self, count: int) -> list[float]:
        """A single-row INSERT + COMMIT (autocommit: one round trip), on a
        logged table, like the step's own writes."""
        samples = []
        with connection.cursor() as cursor:
            cursor.execute(
                "CREATE TABLE IF NOT EXISTS rundesk_bench_commit "
                "(id bigserial PRIMARY KEY, at timestamptz NOT NULL DEFAULT now())"
            )
            for _ in range(count):
                start = time.perf_counter()
                cursor.execute("INSERT INTO rundesk_bench_commit DEFAULT VALUES")
                samples.append((time.perf_counter() - start) * 1000)
            cursor.execute("DROP TABLE rundesk_bench_commit")
        return samples

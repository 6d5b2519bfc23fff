from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connection

from dashboard import bench as dashboard_bench
from evidence.capture import Capture, capture
from evidence.models import CaptureStats
from runs.dispatch import Dispatcher
from runs.executor import execute
from runs.leases import Lease, new_owner_name
from runs.models import AnswerRevision, Run, RunStatus
from runs.percentiles import percentile
from runs.sql import server_cursor
from runs.timeline import timeline


def measured_command(
    argv: list[str], env: dict[str, str] | None = None
) -> tuple[int, float, float]:
    """Runs `manage.py ARGV` in a process of its own: its exit code, its
    time, and its own peak resident memory in MB (VmHWM, read from /proc
    while it runs: what a fork inherited from this process is not its)."""
    start = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, str(settings.BASE_DIR / "manage.py"), *argv],
        env=env,
        stdout=subprocess.DEVNULL,
    )
    status = Path(f"/proc/{process.pid}/status")
    peak_kb = 0
    while process.poll() is None:
        try:
            for line in status.read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak_kb = max(peak_kb, int(line.split()[1]))
        except (OSError, ValueError, IndexError):
            pass  # between exec and exit the file may be gone or partial
        time.sleep(0.02)
    return process.returncode, time.perf_counter() - start, peak_kb / 1024


def p50(samples: list[float]) -> float:
    return round(statistics.median(samples), 3)


class Command(BaseCommand):
    help = (
        "Measures one executor step (boundary + no-op read + receipt) against a single-row "
        "INSERT + COMMIT on the same database; with --capture, the cost of handing a copy "
        "to evidence capture while the database is stalled for it; with --evidence-locked, a "
        "whole run while another session holds every evidence table locked."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--steps", type=int, default=500)
        parser.add_argument("--capture", action="store_true")
        parser.add_argument(
            "--evidence-locked",
            action="store_true",
            help="the same run with no lock, and with every evidence table locked by another "
            "session for the run's whole life (SHARE, ACCESS EXCLUSIVE)",
        )
        parser.add_argument("--rounds", type=int, default=3, help="with --evidence-locked")
        parser.add_argument(
            "--bundle",
            action="store_true",
            help="export time and peak memory of investigation bundles of runs with 10,000 "
            "and 200,000 events, each export in its own process",
        )
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
        elif options["bundle"]:
            report = self._bundle([10_000, 200_000])
        elif options["evidence_locked"]:
            if options["rounds"] < 1:
                raise CommandError("--rounds must be at least 1")
            report = self._evidence_locked(options["rounds"])
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
        samples = self._measure(steps)
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

    def _bundle(self, sizes: list[int]) -> dict[str, Any]:
        """Exports runs of each size (events) with `manage.py export_bundle`
        in a process of its own, timing it and reading its peak RSS."""
        measured = []
        with tempfile.TemporaryDirectory() as folder:
            for events in sizes:
                run = Run.objects.submit(
                    question=f"bench --bundle: {events} events", documents=["(none)"]
                )
                with connection.cursor() as cursor:
                    cursor.execute(
                        """INSERT INTO runs_runevent (run_id, kind, message, data, created_at)
                           SELECT %s, 'fault_injected', 'bench event ' || n,
                               jsonb_build_object('n', n, 'note', repeat('x', 80)),
                               now() + n * interval '1 millisecond'
                           FROM generate_series(1, %s) AS n""",
                        [run.pk, events],
                    )
                out = Path(folder) / f"{events}.zip"
                argv = ["export_bundle", str(run.pk), "-o", str(out)]
                returncode, seconds, peak_mb = measured_command(argv)
                if returncode != 0:
                    raise CommandError(f"export_bundle of run {run.pk} failed")
                measured.append(
                    {
                        "events": events,
                        "seconds": round(seconds, 2),
                        "events_per_s": round(events / seconds),
                        "peak_rss_mb": round(peak_mb, 1),
                        "bytes": out.stat().st_size,
                    }
                )
        small, large = measured[0], measured[-1]
        return {
            "runs": measured,
            "time_ratio": round(large["seconds"] / small["seconds"], 2),
            "events_ratio": large["events"] / small["events"],
            "rss_difference_mb": round(large["peak_rss_mb"] - small["peak_rss_mb"], 1),
        }

    def _evidence_locked(self, rounds: int) -> dict[str, Any]:
        """Runs the sample question over the whole corpus, in interleaved
        rounds: with no lock, then with another session holding every
        evidence table in SHARE mode, then in ACCESS EXCLUSIVE mode, each for
        the run's whole life.  A locked run must complete with its final
        answer in about the baseline's time; what capture could not save
        (the lock is held until capture has tried everything the run handed
        it) is counted as gaps, read once the lock is gone."""
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
                " AND tablename LIKE 'evidence\\_%%' ORDER BY tablename"
            )
            tables = ", ".join(name for (name,) in cursor.fetchall())
        documents = sorted(
            path.name
            for path in settings.RUNDESK_CORPUS_DIR.glob("*.md")
            if path.name != "README.md"
        )
        seconds: dict[str, list[float]] = {"none": [], "SHARE": [], "ACCESS EXCLUSIVE": []}
        published: list[dict[str, Any]] = []
        locked_runs: list[int] = []
        for _ in range(rounds):
            for mode in seconds:
                run = Run.objects.submit(
                    question=f"bench --evidence-locked ({mode}): compare these funds",
                    documents=documents,
                )
                with psycopg.connect(**connection.get_connection_params()) as other:
                    other.execute("SET application_name = 'bench: evidence locked'")
                    if mode != "none":
                        other.execute(f"LOCK TABLE {tables} IN {mode} MODE")
                        locked_runs.append(run.pk)
                    start = time.perf_counter()
                    outcome = execute(run.pk)
                    seconds[mode].append(time.perf_counter() - start)
                    final = AnswerRevision.objects.filter(run=run, is_final=True).exists()
                    # The lock outlives what the run handed to capture too.
                    capture.flush(60)
                    other.rollback()
                published.append(
                    {"lock": mode, "run_id": run.pk, "outcome": outcome, "final_answer": final}
                )
        capture.flush(60)
        timeline.flush()
        stats = CaptureStats.objects.filter(run_id__in=locked_runs)
        return {
            "rounds": rounds,
            "documents": len(documents),
            "baseline_s": round(statistics.median(seconds["none"]), 3),
            "share_s": round(statistics.median(seconds["SHARE"]), 3),
            "access_exclusive_s": round(statistics.median(seconds["ACCESS EXCLUSIVE"]), 3),
            "published": published,
            "gaps": sum(stats.values_list("lost", flat=True)),
            "captured_while_locked": sum(stats.values_list("captured", flat=True)),
        }

    def _measure(self, steps: int) -> dict[str, list[float]]:
        """Steps through the real executor path (lease, Dispatcher.step:
        boundary, tool, receipt; timeline), each followed by a single-row
        INSERT + COMMIT (autocommit: one round trip) on a logged table, on the
        same connection: both see the same machine at the same moment.  Each
        round also times the step's two fenced writes made through the lease
        alone (no dispatcher, timeline or tool) and a `SELECT 1`."""
        run = Run.objects.submit(
            question=f"bench: {steps} no-op reads", documents=["(none)"], action_budget=2 * steps
        )
        lease = Lease.claim(run.pk, new_owner_name())
        if lease is None:
            raise CommandError(f"could not claim bench run {run.pk}")
        dispatcher = Dispatcher(lease, stop=threading.Event(), lease_lost=threading.Event())
        samples: dict[str, list[float]] = {"step": [], "commit": [], "writes": [], "roundtrip": []}

        def timed(name: str, work: Callable[..., object], *args: Any) -> None:
            start = time.perf_counter()
            work(*args)
            samples[name].append((time.perf_counter() - start) * 1000)

        def writes(i: int) -> None:
            action = lease.record_boundary(
                step_key=f"writes:{i}", kind="noop", effect_class="read", input={"i": i}
            )
            lease.record_receipt(action, {"ok": True})

        with server_cursor() as cursor:
            cursor.execute(
                "CREATE TABLE IF NOT EXISTS rundesk_bench_commit "
                "(id bigserial PRIMARY KEY, at timestamptz NOT NULL DEFAULT now())"
            )
            for i in range(steps):
                timed("step", dispatcher.step, f"noop:{i}", "noop", {"i": i})
                timed("commit", cursor.execute, "INSERT INTO rundesk_bench_commit DEFAULT VALUES")
                timed("writes", writes, i)
                timed("roundtrip", cursor.execute, "SELECT 1")
            cursor.execute("DROP TABLE rundesk_bench_commit")
        lease.finish(RunStatus.COMPLETED, "bench")
        timeline.flush()
        return samples

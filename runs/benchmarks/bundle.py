"""`bench --bundle`: export time and peak memory of investigation bundles of
runs of different sizes, each export in a process of its own."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import CommandError
from django.db import connection

from runs.benchmarks import holding_run


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


def report(sizes: list[int]) -> dict[str, Any]:
    """Exports runs of each size (events) with `manage.py export_bundle`
    in a process of its own, timing it and reading its peak RSS."""
    measured = []
    with tempfile.TemporaryDirectory() as folder:
        for events in sizes:
            run = holding_run(f"bench --bundle: {events} events")
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

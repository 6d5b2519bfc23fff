"""`manage.py bench`: the arguments, and which benchmark of runs/benchmarks/
they ask for."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from runs.benchmarks import (
    bundle,
    capacity,
    capture,
    document,
    evidence_locked,
    overview,
    page_load,
    pages,
    parallel,
    peers,
    purge,
    scale,
    steps,
    support_path,
    throughput,
)

# tests/test_bundles.py measures exports with it, imported from here.
from runs.benchmarks.bundle import measured_command as measured_command


class Command(BaseCommand):
    help = (
        "Counts the durable commits and WAL syncs of a step of the real agent path and times "
        "it, and a no-op step, against a single-row INSERT + COMMIT on the same database; "
        "with an option, another benchmark (runs/benchmarks/); with --all, every one."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--steps", type=int, default=500)
        parser.add_argument(
            "--support-path",
            action="store_true",
            help=f"{support_path.RUNS} support runs of the sample tickets through the real agent "
            "path, mailing and updating a local SMTP server and helpdesk the bench starts: their "
            "commits and WAL syncs per step, counted as the default counts the research agent's",
        )
        parser.add_argument("--capture", action="store_true")
        parser.add_argument(
            "--evidence-locked",
            action="store_true",
            help="the same run with no lock, and with every evidence table locked by another "
            "session for the run's whole life (SHARE, ACCESS EXCLUSIVE)",
        )
        parser.add_argument(
            "--rounds", type=int, default=3, help="with --evidence-locked and --peers"
        )
        parser.add_argument(
            "--bundle",
            action="store_true",
            help="export time and peak memory of investigation bundles of runs with 10,000 "
            "and 200,000 events, each export in its own process",
        )
        parser.add_argument(
            "--dashboard",
            action="store_true",
            help="server time of the dashboard's pages at 100 and 100,000 runs, and of the "
            "overview and the runs list's search at --dashboard-runs runs with 10 events each "
            "(own databases)",
        )
        parser.add_argument(
            "--dashboard-runs",
            type=int,
            default=overview.RUNS,
            metavar="N",
            help="with --dashboard: the runs the overview and the search are measured at",
        )
        parser.add_argument(
            "--page-load",
            action="store_true",
            help="cold page-to-chart time of a run page and a lock incident page in Chromium "
            "(the small database of --dashboard)",
        )
        parser.add_argument(
            "--scale",
            action="store_true",
            help="runs/s with 1, 2 and 4 Celery worker processes, 100-run batches (own database "
            "and queue)",
        )
        parser.add_argument(
            "--broker",
            default=scale.FILESYSTEM,
            metavar="URL",
            help="with --scale: the broker (redis://, amqp://); the filesystem broker by default",
        )
        parser.add_argument(
            "--peers",
            action="store_true",
            help="no-op steps through DBOS, LangGraph (PostgresSaver, durability=sync) and "
            "Rundesk, interleaved with the bare commit, each in its own database (needs the "
            "bench extra: pip install -e '.[bench]')",
        )
        parser.add_argument(
            "--throughput",
            action="store_true",
            help="runs/s and actions/s of 100-run batches with 1, 2 and 4 executor processes "
            "against the commits/s ceiling, and the time from an executor's death to another "
            "owner resuming its run",
        )
        parser.add_argument(
            "--capacity",
            action="store_true",
            help="10, 100 and 1,000 runs of 1-s tools in flight in one executor process: peak "
            "sessions, time against one run's, CPU and memory; DBOS on the same workload",
        )
        parser.add_argument(
            "--parallel",
            action="store_true",
            help="20 reads of 200 ms side by side and one after another, with the commits each "
            "read costs",
        )
        parser.add_argument(
            "--purge",
            action="store_true",
            help="the step time of runs executing while purge_runs removes --purge-runs ended "
            "runs, against their step time with nothing else going on (own database)",
        )
        parser.add_argument(
            "--purge-runs", type=int, default=100_000, help="with --purge: ended runs removed"
        )
        parser.add_argument("--all", action="store_true", help="every benchmark, in one JSON")
        parser.add_argument("--json", action="store_true")
        parser.add_argument(
            "--markdown",
            metavar="PATH",
            help="with --all: also write the figures as one markdown table, with the machine, "
            "the date and this command, to PATH (make bench: docs/BENCHMARKS.md)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["steps"] < 1:
            raise CommandError("--steps must be at least 1")
        if options["rounds"] < 1:
            raise CommandError("--rounds must be at least 1")
        if options["dashboard_runs"] < 1:
            raise CommandError("--dashboard-runs must be at least 1")
        if options["purge_runs"] < 1:
            raise CommandError("--purge-runs must be at least 1")
        if markdown := options["markdown"]:
            # Said before the benchmarks' minutes, not after.
            if not options["all"]:
                raise CommandError("--markdown needs --all: the document holds every benchmark")
            if not Path(markdown).parent.is_dir():
                raise CommandError(
                    f"--markdown {markdown}: there is no folder {Path(markdown).parent}"
                )
        _require_migrated()
        # The bench's runs deliver their reports to an outbox of their own,
        # never the operator's (whose files may come from another database,
        # whose run ids, and so identities, this one's repeat).
        with tempfile.TemporaryDirectory(prefix="rundesk-bench-outbox-") as outbox:
            previous, settings.RUNDESK_OUTBOX_DIR = settings.RUNDESK_OUTBOX_DIR, Path(outbox)
            try:
                self._report(options)
            finally:
                settings.RUNDESK_OUTBOX_DIR = previous

    def _report(self, options: dict[str, Any]) -> None:
        # The default (steps) has no option of its own; --steps sizes it.
        chosen = [name for name in BENCHMARKS if name != "steps" and options[name]]
        if options["all"]:
            # Every one, each in its own key; one that fails says why there
            # and the others still run (the exit status says one failed).
            report: Any = {}
            for name in BENCHMARKS:
                try:
                    report[name] = self._measure(name, options)
                except Exception as error:  # said in the report; the others still run
                    report[name] = {"error": str(error) or repr(error)}
        elif len(chosen) > 1:
            raise CommandError(f"one benchmark at a time, or --all (asked: {', '.join(chosen)})")
        else:
            report = self._measure(chosen[0] if chosen else "steps", options)
        if options["json"]:
            self.stdout.write(json.dumps(report))
        else:
            for key, value in report.items():
                self.stdout.write(f"{key}: {value}")
        if options["markdown"]:
            _write_document(Path(options["markdown"]), report, options)
        if options["all"] and (failed := [n for n, v in report.items() if "error" in v]):
            raise CommandError(f"bench --all: {', '.join(failed)} failed (see its error)")

    def _measure(self, name: str, options: dict[str, Any]) -> Any:
        try:
            return BENCHMARKS[name](options)
        except (RuntimeError, ValueError) as error:
            raise CommandError(f"bench --{name.replace('_', '-')}: {error}") from error


def _require_migrated() -> None:
    """The benchmarks make runs in this database: its schema must be the
    code's."""
    executor = MigrationExecutor(connection)
    if unapplied := executor.migration_plan(executor.loader.graph.leaf_nodes()):
        raise CommandError(
            f"database {connection.settings_dict['NAME']!r} has {len(unapplied)} migrations "
            "not applied: run `python manage.py migrate` first"
        )


def _write_document(path: Path, report: dict[str, Any], options: dict[str, Any]) -> None:
    """The figures as docs/BENCHMARKS.md shows them; a benchmark that failed
    says why in its row.  Replaced whole: a crash leaves the old file."""
    # The options that shape the figures; the broker's URL may hold a
    # password, and the scale-out row names the broker.
    command = (
        f"DEBUG={int(settings.DEBUG)} python manage.py bench --all --steps {options['steps']} "
        f"--rounds {options['rounds']}{' --json' if options['json'] else ''} --markdown {path}"
    )
    text = document.markdown(report, document.Machine.here(), timezone.localdate(), command)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    partial.replace(path)


# Each benchmark by its option (dest), in the order --all runs them.
BENCHMARKS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "steps": lambda options: steps.report(options["steps"]),
    "support_path": lambda options: support_path.report(),
    "capture": lambda options: capture.report(options["steps"]),
    "parallel": lambda options: parallel.report(),
    "evidence_locked": lambda options: evidence_locked.report(options["rounds"]),
    "peers": lambda options: peers.report(options["steps"], options["rounds"]),
    "throughput": lambda options: throughput.report(),
    "capacity": lambda options: capacity.report(),
    "scale": lambda options: scale.report(options["broker"]),
    "bundle": lambda options: bundle.report([10_000, 200_000]),
    "dashboard": lambda options: {
        "pages": pages.measure(),
        "overview": overview.measure(options["dashboard_runs"]),
    },
    "page_load": lambda options: {"pages": page_load.measure()},
    "purge": lambda options: purge.report(options["purge_runs"]),
}

from __future__ import annotations

import json
import signal
import threading
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from evidence.capture import capture
from runs.cores import kept_to_one_core
from runs.executor import Ending, Executor, claim_and_drive
from runs.heap import collect_for_runs
from runs.models import Run
from runs.timeline import timeline


class Command(BaseCommand):
    help = "Executes research runs: claims queued runs (and runs whose owner died) under a lease."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--run", type=int, help="execute this run, then exit")
        parser.add_argument("--once", action="store_true", help="drain the queue, then exit")
        parser.add_argument(
            "--concurrency",
            type=int,
            default=1,
            help="runs in flight at once (threads; they share RUNDESK_DB_POOL_SIZE connections)",
        )
        parser.add_argument("--json", action="store_true", help="print the outcome of each run")

    def handle(self, *args: Any, **options: Any) -> None:
        concurrency = options["concurrency"]
        if concurrency < 1:
            raise CommandError("--concurrency must be at least 1")
        printing = threading.Lock()

        def say(run_id: int, ending: Ending) -> None:
            """Each run's ending as it comes (one line; JSON with --json)."""
            line = (
                json.dumps({"run_id": run_id, "outcome": ending})
                if options["json"]
                else f"run {run_id}: {ending}"
            )
            with printing:
                self.stdout.write(line)
                self.stdout.flush()

        # Without --json, the executor's log says each ending (runs.executor).
        executor = Executor(concurrency=concurrency, on_ending=say if options["json"] else None)
        stop = executor.stop

        def on_signal(signum: int, frame: Any) -> None:
            self.stderr.write(f"executor: {signal.Signals(signum).name}, stopping after this step")
            stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

        collect_for_runs()
        try:
            with kept_to_one_core():
                if options["run"] is not None:
                    if not Run.objects.filter(pk=options["run"]).exists():
                        raise CommandError(f"no run {options['run']}")
                    say(options["run"], claim_and_drive(options["run"], stop=stop))
                else:
                    executor.serve(once=options["once"])
        finally:
            # What the timeline and capture could not write in time becomes
            # `events_lost` and `shutdown` gaps.
            timeline.stop()
            capture.stop()

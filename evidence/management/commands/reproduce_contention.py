"""Reproduces the lock cycle of the first incident (docs/DESIGN.md, "Where
it comes from"), on purpose.

Three transactions, each in its own connection, through the real storage
entry points:

- capture (evidence/capture.py CopyTransaction): holds the source row, then
  asks for the model record;
- publication as it was at the incident: it held the model record (it
  marked the calls it used), then asked for the run row (its fence,
  Lease.publish_revision);
- a source refresh as it was at the incident: it held the run row, then
  asked for the source row (SourceRefresh.mark_sources).

Neither publication nor the refresh takes those first locks in Rundesk
(no statement of the main path touches an evidence table, and the refresh
does not lock the run row), so the cycle cannot close in production.  The
incident's two first locks are taken here, as they were then, to show what
the capture policy alone changes.

Each trial arranges that order: capture takes the source, the refresh takes
the run row, the publication takes the model record and waits for the run
row; then capture and the refresh ask for their second lock at once.  Under
`--policy wait` (capture as it was at the incident) that closes a cycle and PostgreSQL's
deadlock detector breaks it after deadlock_timeout; under `nowait` capture
gives up at once, leaving a gap, and nothing waits for it: the copy goes to
capture's retry queue (evidence/retries.py), and the capture writer tries it
again later, off every trial's path.  Each trial's capture copies a model
call of its own.  Once the trials end (the contention released), the
command waits for those tries and reports the copies saved at once, saved
later (their gaps say so) and left as gaps.  Baseline trials, interleaved
with them, run the same publications with capture switched off.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError, connection, transaction
from django.db.models import Sum

from evidence import locks
from evidence.capture import (
    POLICIES,
    Copy,
    CopyTransaction,
    GapKey,
    capture,
    gap_reason,
    record_gaps,
)
from evidence.models import CaptureGap, EvidenceCopy, GapReason, IncidentSource
from evidence.records import record_model_call, record_source
from evidence.retries import retry_window
from evidence.sources import SourceRefresh
from runs.agent import ToolCall
from runs.agents.tools import read_document
from runs.benchmarks import percentile
from runs.leases import Lease
from runs.models import RunStatus, action_identity, digest
from runs.sql import server_cursor, this_backend
from runs.submission import submit

DEADLOCK = "40P01"
DOCUMENT = "northwind-clean-energy.md"


def sqlstate(error: BaseException) -> str | None:
    return getattr(error.__cause__, "sqlstate", None)


class Command(BaseCommand):
    help = (
        "Arranges the capture / publication / source-refresh lock cycle, with the incident's "
        "(wait) or the repaired (nowait) capture, and reports publications, deadlocks and gaps."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--policy", choices=POLICIES, required=True)
        parser.add_argument("--trials", type=int, default=50)
        parser.add_argument(
            "--deadlock-timeout-ms",
            type=int,
            help="deadlock_timeout for the three connections (default: the server's)",
        )
        parser.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["trials"] < 1:
            raise CommandError("--trials must be at least 1")
        self.policy = options["policy"]
        self.deadlock_timeout = options["deadlock_timeout_ms"]
        self._set_up()
        self.gaps: Counter[GapKey] = Counter()
        # One long-lived thread, with its own connection, per transaction of
        # the cycle, as in a running system (a first statement on a new
        # connection costs several milliseconds of catalog loading).
        self.workers = {role: ThreadPoolExecutor(1) for role in ("capture", "refresh", "publish")}
        for worker in self.workers.values():
            worker.submit(self._configure_connection).result()
        self.refresh_pid = self.workers["refresh"].submit(lambda: this_backend().pid).result()
        outcomes: Counter[str] = Counter()
        publication_ms: list[float] = []
        baseline_ms: list[float] = []
        self.numbers = iter(range(1, 10**9))
        # A first trial warms the connections up; it is not counted.
        self._trial(capture=False)
        for _ in range(options["trials"]):
            result = self._trial(capture=True)
            outcomes.update(result["outcomes"])
            publication_ms.append(result["publication_ms"])
            baseline_ms.append(self._trial(capture=False)["publication_ms"])
        for worker in self.workers.values():
            worker.submit(lambda: connection.close()).result()  # in its own thread
            worker.shutdown()
        # The contention is over: what capture kept is tried again now.
        settled = capture.wait_for_retries(retry_window(settings.RUNDESK_CAPTURE_RETRY_TRIES) + 5.0)
        self.lease.finish(RunStatus.COMPLETED, "contention reproduction")
        saved_later = (
            CaptureGap.objects.filter(run=self.run, saved_at__isnull=False).aggregate(
                n=Sum("count")
            )["n"]
            or 0
        )
        saved = outcomes["capture:saved"] + saved_later
        report = {
            "policy": self.policy,
            "trials": options["trials"],
            "publications_committed": outcomes["publication:committed"],
            "publications_failed": options["trials"] - outcomes["publication:committed"],
            "deadlocks": outcomes["deadlock"],
            "capture_saved": outcomes["capture:saved"],
            "capture_saved_later": saved_later,
            "capture_gaps": options["trials"] - saved,
            "capture_saved_percent": round(100 * saved / options["trials"], 1),
            "copies_stored": EvidenceCopy.objects.filter(run=self.run).count(),
            "retries_settled": settled,
            "publication_ms": {
                "p50": round(percentile(publication_ms, 0.5), 3),
                "p99": round(percentile(publication_ms, 0.99), 3),
                "max": round(max(publication_ms), 3),
            },
            "baseline_publication_ms": {
                "p50": round(percentile(baseline_ms, 0.5), 3),
                "p99": round(percentile(baseline_ms, 0.99), 3),
            },
            "deadlock_timeout_ms": self._deadlock_timeout_ms(),
            "run_id": self.run.pk,
        }
        if options["json"]:
            self.stdout.write(json.dumps(report))
        else:
            for key, value in report.items():
                self.stdout.write(f"{key}: {value}")

    # -- set-up ------------------------------------------------------------

    def _set_up(self) -> None:
        """A run with one source and one model call, through the real paths."""
        self.run = submit(
            question=f"reproduce_contention --policy {self.policy}", documents=[DOCUMENT]
        )
        lease = Lease.claim(self.run.pk, "reproduce-contention")
        if lease is None:
            raise CommandError("could not claim the reproduction's run")
        self.lease = lease
        read_input = {"path": DOCUMENT}
        read_id = lease.record_boundary(
            step_key="read:0", kind="read_document", effect_class="read", input=read_input
        )
        identity = action_identity(self.run.pk, "read:0")
        read = read_document(read_input, ToolCall(self.run.pk, "read:0", identity, "", 30.0))
        lease.record_receipt(read_id, read)
        record_source(self.run.pk, read_id, DOCUMENT, read["sha256"], read["bytes"])
        call_input = {"messages": [{"role": "user", "content": read["text"]}]}
        call_id = lease.record_boundary(
            step_key="summarize:0", kind="model_call", effect_class="read", input=call_input
        )
        output = {"provider": "offline", "text": "A summary."}
        lease.record_receipt(call_id, output)
        model_call = record_model_call(
            self.run.pk, call_id, "offline", digest(call_input), digest(output), [DOCUMENT]
        )
        self.copy = Copy(self.run.pk, model_call, json.dumps(call_input), output["text"])
        self.source_text = read["text"]

    def _new_copy(self, number: int) -> None:
        """A model call of the trial's own, whose copy its capture makes
        (saved at once, later or never: counted apart from the others')."""
        call_input = {"messages": [{"role": "user", "content": self.source_text}], "n": number}
        call_id = self.lease.record_boundary(
            step_key=f"summarize:{number}", kind="model_call", effect_class="read", input=call_input
        )
        output = {"provider": "offline", "text": f"Summary {number}."}
        self.lease.record_receipt(call_id, output)
        model_call = record_model_call(
            self.run.pk, call_id, "offline", digest(call_input), digest(output), [DOCUMENT]
        )
        self.copy = Copy(self.run.pk, model_call, json.dumps(call_input), output["text"])

    # -- one trial ---------------------------------------------------------

    def _trial(self, *, capture: bool) -> dict[str, Any]:
        self.lease.renew()
        outcomes: Counter[str] = Counter()
        go = threading.Event()
        running: list[Future[None]] = []

        def start(role: str, target: Callable[[threading.Event], None]) -> None:
            ready = threading.Event()
            running.append(self.workers[role].submit(self._guarded, target, ready, outcomes))
            ready.wait(10)

        number = next(self.numbers)
        if capture:
            self._new_copy(number)
            start("capture", lambda ready: self._capture(ready, go, outcomes))
        start("refresh", lambda ready: self._refresh(ready, go))
        timing: dict[str, float] = {}
        start("publish", lambda ready: self._publish(ready, number, timing, outcomes))
        self._wait_until_waiting(timing)
        go.set()
        if capture and self.policy == "wait":
            self._record_cycle(running[-1])
        for future in running:
            future.result(60)
        if self.gaps:
            record_gaps(self.gaps)
            self.gaps.clear()
        return {"outcomes": outcomes, "publication_ms": timing["ms"]}

    def _configure_connection(self) -> None:
        with connection.cursor() as cursor:
            if self.deadlock_timeout:
                cursor.execute(
                    "SELECT set_config('deadlock_timeout', %s, false)",
                    [f"{self.deadlock_timeout}ms"],
                )
            cursor.execute("SELECT FROM evidence_source, evidence_modelcall, runs_run LIMIT 0")

    def _guarded(
        self,
        target: Callable[[threading.Event], None],
        ready: threading.Event,
        outcomes: Counter[str],
    ) -> None:
        """Runs `target`; a deadlock it meets is counted, not raised."""
        try:
            target(ready)
        except DatabaseError as error:
            if sqlstate(error) == DEADLOCK:
                outcomes["deadlock"] += 1
        finally:
            ready.set()

    def _capture(self, ready: threading.Event, go: threading.Event, outcomes: Counter[str]) -> None:
        copy = CopyTransaction(self.copy, self.policy)
        try:
            with transaction.atomic(), server_cursor() as cursor:
                copy.begin(cursor)
                copy.lock_sources(cursor)
                ready.set()
                go.wait(10)
                copy.lock_model_record(cursor)
                copy.insert(cursor)
            outcomes["capture:saved"] += 1
        except DatabaseError as error:
            reason = gap_reason(error)
            if reason == GapReason.LOCK_NOT_AVAILABLE:
                # As the capture writer does with a copy that could not take
                # its lock: a gap now, the copy kept to be tried again later.
                capture.retry_later(self.copy, str(error).strip())
                raise
            # Recorded after the trial, as the capture writer records its gaps
            # after the failed transaction: never inside the contention.
            self.gaps[
                (self.copy.run_id, self.copy.model_call_id, reason, str(error).strip()[:500], None)
            ] += 1
            raise

    def _refresh(self, ready: threading.Event, go: threading.Event) -> None:
        refresh = SourceRefresh(self.run.pk)
        with transaction.atomic(), connection.cursor() as cursor:
            # The incident's refresh held the run row while it marked sources.
            cursor.execute("SELECT 1 FROM runs_run WHERE id = %s FOR NO KEY UPDATE", [self.run.pk])
            ready.set()
            go.wait(10)
            refresh.mark_sources(cursor)

    def _publish(
        self, ready: threading.Event, number: int, timing: dict[str, float], outcomes: Counter[str]
    ) -> None:
        timing["pid"] = this_backend().pid
        ready.set()
        start = time.perf_counter()
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                # The incident's publication marked the model calls it used
                # (an UPDATE: this row lock) before its fence.
                cursor.execute(
                    "SELECT 1 FROM evidence_modelcall WHERE run_id = %s FOR NO KEY UPDATE",
                    [self.run.pk],
                )
                self.lease.publish_revision(
                    number, f"revision {number}", is_final=False, model_call_actions=[]
                )
            outcomes["publication:committed"] += 1
        finally:
            timing["ms"] = (time.perf_counter() - start) * 1000

    def _wait_until_waiting(self, timing: dict[str, float]) -> None:
        """Until the publication waits for the run row the refresh holds (or
        is done): not for a model record a try again of capture's holds for
        a moment, which would let this trial's capture in first."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "ms" not in timing:
            if "pid" in timing:
                with connection.cursor() as cursor:
                    cursor.execute(
                        "SELECT %s = ANY(pg_blocking_pids(%s))",
                        [self.refresh_pid, timing["pid"]],
                    )
                    row = cursor.fetchone()
                if row and row[0]:
                    return
            time.sleep(0.0005)

    def _record_cycle(self, publication: Future[None]) -> None:
        """Samples the wait-for graph once the cycle has closed, and stores it."""
        deadline = time.monotonic() + 10
        while not publication.done() and time.monotonic() < deadline:
            graph = locks.sample()
            if graph.cycle():
                locks.store(
                    IncidentSource.REPRODUCTION,
                    graph,
                    summary=f"reproduce_contention --policy {self.policy}: the cycle, as sampled",
                )
                return
            time.sleep(0.005)

    def _deadlock_timeout_ms(self) -> int:
        if self.deadlock_timeout:
            return self.deadlock_timeout
        with connection.cursor() as cursor:
            cursor.execute("SELECT setting::int FROM pg_settings WHERE name = 'deadlock_timeout'")
            return cursor.fetchone()[0]

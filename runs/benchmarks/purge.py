"""`bench --purge`: what removing ended runs costs the runs that execute
meanwhile.

A database of its own (`rundesk_bench_purge`, made and migrated if
missing) is seeded with `runs` ended runs (each with two actions and their
receipts, a checkpoint, an answer revision and ten events: 17 rows a run),
ended a year ago.  Then `manage.py purge_runs --older-than 300d` removes
every seeded run in a process of its own, while research runs of the
sample corpus (offline model provider) are driven here one after another,
as an executor drives them; each run's time over its actions is a sample
of the step time.  The purge is paused (SIGSTOP) and let go on (SIGCONT)
in turns of WINDOW seconds, between two runs, so each run is driven wholly
with the purge going on or wholly without it, and both kinds of sample
share the machine's other load as it comes and goes.  The figure is the
step time's p50 with the purge going on over the one without: the target
is at most 1.10.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import connection, transaction

from runs.benchmarks import p50, percentile
from runs.benchmarks.pages import bench_database
from runs.executor import claim_and_drive
from runs.harness import database_url
from runs.models import Action, Run
from runs.submission import submit

DATABASE = "rundesk_bench_purge"
AGE = "300d"
# The seeded runs' question starts so.
OLD_RUN = "bench --purge: an old run "
WINDOW = 3.0  # seconds of each turn, the purge going on or paused
DOCUMENTS = 3  # a run: 3 reads, 3 summaries, compose, deliver


def report(runs: int) -> dict[str, Any]:
    with bench_database(DATABASE):
        seed(runs)
        samples, purged = drive_while_purging()
    quiet, purging = samples[False], samples[True]
    baseline, during = p50(quiet), p50(purging)
    return {
        "runs_purged": purged["runs"],
        "rows_purged": sum(purged["rows"].values()),
        "purge_s": purged["seconds"],
        "purged_runs_per_s": round(purged["runs"] / purged["seconds"], 1),
        "batches": purged["batches"],
        "skipped": len(purged["skipped"]),
        "step_ms_p50_quiet": baseline,
        "step_ms_p50_purging": during,
        "step_ms_p95_quiet": round(percentile(quiet, 0.95), 3),
        "step_ms_p95_purging": round(percentile(purging, 0.95), 3),
        "step_time_ratio": round(during / baseline, 3),
        "within_target": during <= 1.10 * baseline,
        "runs_driven": {"quiet": len(quiet), "purging": len(purging)},
    }


def seed(runs: int) -> None:
    """`runs` ended runs with their rows, ended a year ago (those of an
    earlier bench left are counted in)."""
    missing = runs - Run.objects.filter(question__startswith=OLD_RUN).count()
    if missing <= 0:
        return
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            """WITH new AS (
                   INSERT INTO runs_run (agent, agent_version, input, question, documents,
                       status, status_reason, phase, phase_reason, action_budget, faults,
                       faults_fired, lease_owner, lease_epoch, cancel_requested_by, is_drill,
                       origin_format, origin_installation, origin_seal, created_at, updated_at,
                       started_at, finished_at)
                   SELECT 'research', '1', '{}', %(old)s || g, ARRAY['a.md'],
                       'completed', '', 'done', '', 40, '[]', '{}', '', 1, '', false, '', '', '',
                       now() - interval '365 days', now(), now() - interval '365 days',
                       now() - interval '365 days' + make_interval(secs => g %% 600)
                   FROM generate_series(1, %(missing)s) g
                   RETURNING id, finished_at),
               acted AS (
                   INSERT INTO runs_action (run_id, step_key, kind, effect_class, input,
                       input_digest, state, epoch, attempts, error, created_at, dispatched_at,
                       finished_at, idempotency_key)
                   SELECT new.id, 'read:' || k, 'read_document', 'read', '{}', '', 'completed',
                       1, 1, '', new.finished_at, new.finished_at, new.finished_at,
                       'rundesk:bench-purge:' || new.id || ':' || k
                   FROM new, generate_series(0, 1) k
                   RETURNING id, run_id, step_key, finished_at),
               received AS (
                   INSERT INTO runs_receipt (action_id, run_id, step_key, result, result_digest,
                       epoch, created_at)
                   SELECT id, run_id, step_key, '{"text": "a document"}', '', 1, finished_at
                   FROM acted
                   RETURNING action_id, run_id),
               saved AS (
                   INSERT INTO runs_checkpoint (run_id, after_action_id, number, epoch, outcome,
                       state, state_digest, error, created_at, resolution)
                   SELECT run_id, max(action_id), 2, 1, 'committed', '{}', '', '', now(), ''
                   FROM received GROUP BY run_id),
               published AS (
                   INSERT INTO runs_answerrevision (run_id, number, content, content_digest,
                       model_call_actions, is_final, epoch, committed_at)
                   SELECT id, 1, 'the answer', '', '{}', true, 1, finished_at FROM new)
               INSERT INTO runs_runevent (run_id, kind, message, data, created_at)
               SELECT new.id, 'action_completed', 'bench event ' || e, '{}', new.finished_at
               FROM new, generate_series(1, 10) e""",
            {"missing": missing, "old": OLD_RUN},
        )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")


def drive_once() -> float:
    """One research run driven to its end here: ms per action."""
    corpus = sorted(
        p.name for p in settings.RUNDESK_CORPUS_DIR.glob("*.md") if p.name != "README.md"
    )
    run = submit(question="bench --purge: a live run", documents=corpus[:DOCUMENTS])
    start = time.perf_counter()
    ending = claim_and_drive(run.pk)
    seconds = time.perf_counter() - start
    if ending != "completed":
        raise RuntimeError(f"bench --purge: live run {run.pk} ended {ending}")
    return seconds * 1000 / Action.objects.filter(run=run).count()


def drive_while_purging() -> tuple[dict[bool, list[float]], dict[str, Any]]:
    """Runs driven until the purge of every seeded run has ended, the purge
    going on and paused in turns: the samples by whether it went on."""
    env = {**os.environ, "DATABASE_URL": database_url(), "RUNDESK_ROLE": "purge"}
    root = Path(settings.BASE_DIR)
    samples: dict[bool, list[float]] = {True: [], False: []}
    # Its report (every run id) goes to a file: a pipe nobody reads until
    # it ends would fill and hold the purge at its last line.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        purge = subprocess.Popen(
            [sys.executable, str(root / "manage.py"), "purge_runs", "--older-than", AGE, "--json"],
            env=env,
            cwd=root,
            stdout=out,
            stderr=err,
            text=True,
        )
        going, turned = True, time.monotonic()
        try:
            while purge.poll() is None:
                if time.monotonic() - turned >= WINDOW:
                    going, turned = not going, time.monotonic()
                    purge.send_signal(signal.SIGCONT if going else signal.SIGSTOP)
                samples[going].append(drive_once())
        finally:
            purge.send_signal(signal.SIGCONT)
            purge.wait()
        out.seek(0)
        err.seek(0)
        if purge.returncode != 0:
            raise RuntimeError(f"bench --purge: purge_runs failed: {err.read().strip()[-500:]}")
        return samples, json.loads(out.read())

"""`bench --dashboard`: server time of the dashboard's pages, small tables
against large ones.

Two databases of the same server, made (or reused) for the purpose: one
with 100 runs, one with 100,000 runs and 1,000,000 events (and a run with
5,000 events, lock incidents, capture gaps in proportion).  Each page is
requested through Django's own request handling, signed in, and timed; the
ratio of the large p95 to the small one says whether a page's cost grows
with its tables.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connection, connections, transaction
from django.test import Client

from evidence.capture import record_gaps
from runs.benchmarks import percentile
from runs.models import Run

SCALES = {"small": (100, 10), "large": (100_000, 10)}  # runs, events per run
BIG_RUN_EVENTS = 5_000
REQUESTS = 25  # per page, per round; two rounds per scale, interleaved


@contextmanager
def bench_database(name: str, *, fresh: bool = False) -> Iterator[None]:
    """Points Django's connection at database `name` (made if missing,
    migrated), then back.  `fresh`: made anew for the block, and dropped
    after it."""
    settings = connections["default"].settings_dict
    original = settings["NAME"]
    params = connection.get_connection_params()
    with psycopg.connect(**params, autocommit=True) as admin:
        if fresh:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if not admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            admin.execute(f'CREATE DATABASE "{name}"')
    connection.close()
    # The process's pool (RUNDESK_DB_POOL_SIZE) holds connections to the
    # database it was made for: a new one is made for the new name.
    connection.close_pool()
    settings["NAME"] = name
    try:
        call_command("migrate", verbosity=0)
        yield
    finally:
        connection.close()
        connection.close_pool()
        settings["NAME"] = original
        if fresh:
            with psycopg.connect(**params, autocommit=True) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def seed(runs: int, events_per_run: int) -> int:
    """Runs with two actions each and their events, a few lock incidents and
    capture gaps; a run with BIG_RUN_EVENTS events.  Returns that run's id."""
    missing = runs - Run.objects.count()
    with transaction.atomic(), connection.cursor() as cursor:
        if missing > 0:
            cursor.execute(
                """WITH new AS (
                       INSERT INTO runs_run (agent, agent_version, input, question, documents,
                           status, status_reason, phase,
                           phase_reason, action_budget, faults, faults_fired, lease_owner,
                           lease_epoch, cancel_requested_by, is_drill, origin_format,
                           origin_installation, origin_seal, created_at, updated_at,
                           started_at, finished_at)
                       SELECT 'research', '1',
                           jsonb_build_object('question', 'Compare the funds, bench run ' || g,
                                              'documents', jsonb_build_array('a.md')),
                           'Compare the funds, bench run ' || g, ARRAY['a.md'], 'completed',
                           '', 'done', '', 40, '[]', '{}', '', 1, '', false, '', '', '',
                           now() - make_interval(secs => g), now(), now(), now()
                       FROM generate_series(1, %s) g
                       RETURNING id, created_at),
                   acted AS (
                       INSERT INTO runs_action (run_id, step_key, kind, effect_class, input,
                           input_digest, state, epoch, attempts, error, created_at,
                           dispatched_at, finished_at)
                       SELECT new.id, 'read:' || k, 'read_document', 'read', '{}', '', 'completed',
                           1, 1, '', new.created_at, new.created_at, new.created_at
                       FROM new, generate_series(0, 1) k)
                   INSERT INTO runs_runevent (run_id, kind, message, data, created_at)
                   SELECT new.id, 'action_completed', 'bench event ' || e, '{}',
                       new.created_at + make_interval(secs => e / 1000.0)
                   FROM new, generate_series(1, %s) e""",
                [missing, events_per_run],
            )
            incidents = max(100, runs // 10)
            cursor.execute(
                """WITH incident AS (
                       INSERT INTO evidence_lockincident (source, started_at, ended_at, processes,
                           has_cycle, cycle, summary)
                       SELECT 'sampler', now() - make_interval(secs => g), now(), 2, false,
                           '[]', 'bench'
                       FROM generate_series(1, %s) g RETURNING id)
                   INSERT INTO evidence_lockwait (incident_id, waiter_pid, waiter_role,
                       waiter_query, blocker_pid, blocker_role, blocker_query, lock_type, mode,
                       locked, first_seen, last_seen, waited_ms)
                   SELECT id, 100, 'publication', '', 101, 'capture', '', 'transactionid',
                       'ShareLock', 'transaction 1', now(), now(), 5 FROM incident""",
                [incidents],
            )
            # Through the capture writer's own statement, so its counters
            # (hourly, per run) are kept as in production.
            gap_runs = Run.objects.filter(question__startswith="Compare the funds, bench run")
            record_gaps(
                Counter(
                    {
                        (run_id, None, "lock_not_available", "bench"): 1
                        for run_id in gap_runs.values_list("id", flat=True)[: max(60, runs // 10)]
                    }
                )
            )
        big = Run.objects.filter(question="bench: a run with many events").first()
        if big is None:
            big = Run.objects.create(question="bench: a run with many events", documents=["a.md"])
            cursor.execute(
                """INSERT INTO runs_runevent (run_id, kind, message, data, created_at)
                   SELECT %s, 'action_completed', 'bench event ' || e, '{}',
                       now() + make_interval(secs => e / 1000.0)
                   FROM generate_series(1, %s) e""",
                [big.pk, BIG_RUN_EVENTS],
            )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    return big.pk


def time_pages(pages: dict[str, str], requests: int = REQUESTS) -> dict[str, list[float]]:
    """Server times (ms) of each page (name -> URL), `requests` times after
    warming its caches, as a signed-in viewer; RuntimeError for a page that
    does not answer 200.  The overview's bench times its pages with it too."""
    user, _ = User.objects.get_or_create(username="bench-viewer")
    client = Client(HTTP_HOST="127.0.0.1")  # a host ALLOWED_HOSTS accepts
    client.force_login(user)
    timings: dict[str, list[float]] = {}
    for name, url in pages.items():
        for _ in range(3):  # warm caches
            client.get(url)
        samples = []
        for _ in range(requests):
            start = time.perf_counter()
            response = client.get(url)
            samples.append((time.perf_counter() - start) * 1000)
            if response.status_code != 200:
                raise RuntimeError(f"{url} answered {response.status_code}")
        timings[name] = samples
    return timings


def seeded_pages(big_run: int) -> dict[str, str]:
    return {
        "runs list": "/",
        f"run page ({BIG_RUN_EVENTS} events)": f"/runs/{big_run}/",
        "lock incidents": "/locks/",
        "capture gaps": "/gaps/",
    }


def p95(samples: list[float]) -> float:
    return round(percentile(samples, 0.95), 1)


def measure() -> list[dict[str, Any]]:
    """Small, large, small, large: both scales see the machine alike."""
    timings: dict[str, dict[str, list[float]]] = {scale: {} for scale in SCALES}
    for scale in [*SCALES, *SCALES]:
        runs, events = SCALES[scale]
        with bench_database(f"rundesk_bench_{scale}"):
            for page, samples in time_pages(seeded_pages(seed(runs, events))).items():
                timings[scale].setdefault(page, []).extend(samples)
    return [
        {
            "page": page,
            "p50_ms_large": round(statistics.median(timings["large"][page]), 1),
            "p95_ms_large": p95(timings["large"][page]),
            "p95_ms_small": p95(timings["small"][page]),
            "ratio": round(p95(timings["large"][page]) / p95(timings["small"][page]), 2),
        }
        for page in timings["large"]
    ]

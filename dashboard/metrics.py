"""`/metrics`: Rundesk for Prometheus, in its text format (prometheus_client).

Protected, not signed in: a scraper is no person.  With no
RUNDESK_METRICS_TOKEN and no RUNDESK_METRICS_ALLOW set, /metrics does not
exist (404).  A token set, every scrape sends `Authorization: Bearer
<token>` (compared in constant time; else 401); addresses set (IPs or
networks), the scrape must come from one of them (else 403).  Both set,
both are asked.

Every figure is read from the database at scrape time (a scrape of any
process of the installation says the same), in one read-only transaction
whose statements end after STATEMENT_TIMEOUT, each served by an index and
reading few rows however many runs the database holds:

- runs not ended, by status and agent (run_status_listing_idx: the few
  queued, running and waiting rows).  Ended runs are counted over the
  window below, not all of history: a count of a million ended runs is a
  scan, and Prometheus keeps the history anyway;
- run and step durations of the runs ended in the last
  RUNDESK_METRICS_WINDOW_SECONDS (run_finished_idx, then their actions by
  action_identity_unique), as gauge histograms: what the window holds now,
  not counters since the start (histogram_quantile() over the buckets as
  they are; no rate());
- open items by kind and age (outcome_open_idx);
- counters, each from a small table or a partial index plus what retention
  removed (runs_purgedcount, so none goes down after a purge): lost capture
  copies by reason (the hourly gap counts), lease takeovers (`resumed`
  events, event_resumed_idx), alerts sent and failed attempts by channel;
- the processes renewing leases now and the runs whose lease expired
  (run_running_lease_idx), when the last sweep started (the one row of
  runs_sweepturn), and the database sessions of every Rundesk process by
  role and state (pg_stat_activity).

A figure whose query fails (its statement timed out) is left out of that
scrape and `rundesk_scrape_failed{family}` says so; the others are given.
No label holds a run id.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from django.conf import settings
from django.contrib.auth.decorators import login_not_required
from django.db import DatabaseError, connection, transaction
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    Metric,
)

# The text format every Prometheus reads (2.x and 3.x): what generate_latest writes.
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4 as TEXT_FORMAT

from runs.lifecycle import TERMINAL_STATUSES, RunStatus
from runs.models import HOLDING_KINDS

logger = logging.getLogger(__name__)

# Each statement of a scrape ends after this: a scrape never holds a
# connection long, whatever the database holds.
STATEMENT_TIMEOUT = "2s"

# Upper bounds of the buckets, in seconds.
RUN_BUCKETS = [1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600]
STEP_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300]
ITEM_AGE_BUCKETS = [300, 3600, 6 * 3600, 86400, 7 * 86400]

NOT_ENDED = [status for status in RunStatus if status not in TERMINAL_STATUSES]


# -- who may scrape ----------------------------------------------------------------


@login_not_required
@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    if refused := _refused(request):
        return refused
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RundeskCollector())
    return HttpResponse(generate_latest(registry), content_type=TEXT_FORMAT)


def _refused(request: HttpRequest) -> HttpResponse | None:
    token, allowed = settings.RUNDESK_METRICS_TOKEN, settings.RUNDESK_METRICS_ALLOW
    if not token and not allowed:
        return HttpResponse("Not found\n", status=404, content_type="text/plain")
    if allowed and not _address_allowed(request.META.get("REMOTE_ADDR", ""), allowed):
        return HttpResponse(
            "Forbidden: this address may not scrape /metrics\n",
            status=403,
            content_type="text/plain",
        )
    if token:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), token.encode()
        ):
            response = HttpResponse(
                "Unauthorized: send Authorization: Bearer <RUNDESK_METRICS_TOKEN>\n",
                status=401,
                content_type="text/plain",
            )
            response["WWW-Authenticate"] = 'Bearer realm="rundesk metrics"'
            return response
    return None


def _address_allowed(
    address: str, allowed: list[ipaddress.IPv4Network | ipaddress.IPv6Network]
) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in network for network in allowed)


# -- what is measured ----------------------------------------------------------------


class RundeskCollector:
    """Reads every figure from the database when Prometheus scrapes."""

    def collect(self) -> Iterator[Metric]:
        failed: list[str] = []
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT set_config('statement_timeout', %s, true)", [STATEMENT_TIMEOUT])
            for name, family in FAMILIES:
                try:
                    with transaction.atomic(), connection.cursor() as reading:
                        metrics = list(family(reading))
                except DatabaseError as error:
                    logger.warning("/metrics: %s not read: %s", name, error)
                    failed.append(name)
                    continue
                yield from metrics
        scrape = GaugeMetricFamily(
            "rundesk_scrape_failed",
            "1 when this scrape could not read a family of figures (its query failed)",
            labels=["family"],
        )
        for name, _ in FAMILIES:
            scrape.add_metric([name], 1 if name in failed else 0)
        yield scrape


def _runs(cursor: Any) -> Iterable[Metric]:
    cursor.execute(
        """SELECT status, agent, count(*) FROM runs_run
           WHERE status = ANY(%s) AND imported_at IS NULL GROUP BY 1, 2 ORDER BY 1, 2""",
        [[str(status) for status in NOT_ENDED]],
    )
    runs = GaugeMetricFamily(
        "rundesk_runs",
        "Runs that have not ended (queued, running, waiting for an operator), by status and "
        "agent; ended runs are in rundesk_run_duration_seconds",
        labels=["status", "agent"],
    )
    for status, agent, count in cursor.fetchall():
        runs.add_metric([status, agent], count)
    yield runs


def _window() -> float:
    return settings.RUNDESK_METRICS_WINDOW_SECONDS


def _buckets_sql(expression: str, bounds: list[float]) -> str:
    """One count per bucket (cumulative: at or below its bound), the sum
    and the count of `expression`, in one aggregate."""
    counts = ", ".join(f"count(*) FILTER (WHERE {expression} <= {bound})" for bound in bounds)
    return f"{counts}, coalesce(sum({expression}), 0), count(*)"


def _histogram(
    name: str, help_text: str, labels: list[str], bounds: list[float], rows: list[tuple[Any, ...]]
) -> GaugeHistogramMetricFamily:
    family = GaugeHistogramMetricFamily(name, help_text, labels=labels)
    for row in rows:
        values, counts = row[: len(labels)], row[len(labels) :]
        buckets = [(_bound(b), c) for b, c in zip(bounds, counts, strict=False)]
        buckets.append(("+Inf", counts[-1]))
        family.add_metric(list(values), buckets, gsum_value=float(counts[-2]))
    return family


def _bound(bound: float) -> str:
    return repr(float(bound))


RUN_SECONDS = "extract(epoch FROM finished_at - coalesce(started_at, created_at))"


def _run_durations(cursor: Any) -> Iterable[Metric]:
    cursor.execute(
        f"""SELECT agent, status, {_buckets_sql(RUN_SECONDS, RUN_BUCKETS)} FROM runs_run
            WHERE finished_at >= now() - make_interval(secs => %s) AND imported_at IS NULL
            GROUP BY 1, 2 ORDER BY 1, 2""",
        [_window()],
    )
    yield _histogram(
        "rundesk_run_duration_seconds",
        "Runs ended in the last RUNDESK_METRICS_WINDOW_SECONDS, by agent and how they ended: "
        "seconds from their start to their end",
        ["agent", "status"],
        RUN_BUCKETS,
        cursor.fetchall(),
    )


STEP_SECONDS = "extract(epoch FROM a.finished_at - a.dispatched_at)"


def _step_durations(cursor: Any) -> Iterable[Metric]:
    cursor.execute(
        f"""SELECT r.agent, a.kind, {_buckets_sql(STEP_SECONDS, STEP_BUCKETS)}
            FROM runs_run r JOIN runs_action a ON a.run_id = r.id
            WHERE r.finished_at >= now() - make_interval(secs => %s) AND r.imported_at IS NULL
              AND a.finished_at IS NOT NULL
            GROUP BY 1, 2 ORDER BY 1, 2""",
        [_window()],
    )
    yield _histogram(
        "rundesk_step_duration_seconds",
        "Actions (tool dispatches, model calls) of the runs ended in the last "
        "RUNDESK_METRICS_WINDOW_SECONDS, by agent and tool: seconds from their last dispatch "
        "to their receipt or failure",
        ["agent", "tool"],
        STEP_BUCKETS,
        cursor.fetchall(),
    )


ITEM_AGE = "extract(epoch FROM now() - i.created_at)"


def _open_items(cursor: Any) -> Iterable[Metric]:
    cursor.execute(
        f"""SELECT i.kind, {_buckets_sql(ITEM_AGE, ITEM_AGE_BUCKETS)}
            FROM runs_outcomeitem i JOIN runs_run r ON r.id = i.run_id
            WHERE i.state = 'open' AND r.imported_at IS NULL AND NOT r.is_drill
            GROUP BY 1 ORDER BY 1"""
    )
    rows = {row[0]: row for row in cursor.fetchall()}
    # Every kind, 0 when none is open: an alert rule sees the series at once.
    empty = (0,) * (len(ITEM_AGE_BUCKETS) + 2)
    kinds = sorted({*HOLDING_KINDS, "checkpoint", *rows})
    yield _histogram(
        "rundesk_open_item_age_seconds",
        "Open outcome items (unknown outcomes an operator or evidence must settle; drills' "
        "left out), by kind: how long each has been open",
        ["kind"],
        ITEM_AGE_BUCKETS,
        [rows.get(kind, (kind, *empty)) for kind in kinds],
    )


def _capture_gaps(cursor: Any) -> Iterable[Metric]:
    cursor.execute("SELECT reason, sum(count) FROM evidence_capturegaphour GROUP BY 1 ORDER BY 1")
    gaps = CounterMetricFamily(
        "rundesk_capture_gaps",
        "Copies of model calls capture could not save, by why (capture gaps)",
        labels=["reason"],
    )
    for reason, count in cursor.fetchall():
        gaps.add_metric([reason], int(count))
    yield gaps


def _purged(cursor: Any, counter: str) -> dict[str, int]:
    """What retention removed of `counter`'s rows, by label."""
    cursor.execute("SELECT label, value FROM runs_purgedcount WHERE counter = %s", [counter])
    return dict(cursor.fetchall())


def _takeovers(cursor: Any) -> Iterable[Metric]:
    cursor.execute(
        """SELECT count(*) FROM runs_runevent e JOIN runs_run r ON r.id = e.run_id
           WHERE e.kind = 'resumed' AND r.imported_at IS NULL"""
    )
    (kept,) = cursor.fetchone()
    purged = _purged(cursor, "lease_takeovers").get("", 0)
    yield CounterMetricFamily(
        "rundesk_lease_takeovers",
        "Claims of a run another owner had driven (its timeline's `resumed`): after a crash, "
        "a release, a requeue or an operator's decision",
        value=kept + purged,
    )


def _alerts(cursor: Any) -> Iterable[Metric]:
    cursor.execute(
        """SELECT channel, count(*) FILTER (WHERE state = 'sent'),
                  coalesce(sum(attempts), 0) - count(*) FILTER (WHERE state = 'sent'),
                  count(*) FILTER (WHERE state = 'failing')
           FROM runs_alert GROUP BY 1"""
    )
    rows = {channel: counts for channel, *counts in cursor.fetchall()}
    sent_purged, failed_purged = _purged(cursor, "alerts_sent"), _purged(cursor, "alert_failures")
    sent = CounterMetricFamily(
        "rundesk_alerts_sent", "Alerts the operators' channel took, by channel", labels=["channel"]
    )
    failed = CounterMetricFamily(
        "rundesk_alert_failures",
        "Attempts to send an alert that failed (each is tried again), by channel",
        labels=["channel"],
    )
    failing = GaugeMetricFamily(
        "rundesk_alerts_failing",
        "Alerts whose last attempt failed: the operators may not have been told",
        labels=["channel"],
    )
    for channel in sorted({"email", "webhook", *rows, *sent_purged, *failed_purged}):
        kept_sent, kept_failed, now_failing = rows.get(channel, (0, 0, 0))
        sent.add_metric([channel], kept_sent + sent_purged.get(channel, 0))
        failed.add_metric([channel], kept_failed + failed_purged.get(channel, 0))
        failing.add_metric([channel], now_failing)
    yield from (sent, failed, failing)


def _liveness(cursor: Any) -> Iterable[Metric]:
    # An owner is named host:pid:random (leases.new_owner_name): a process
    # is its host and pid.
    cursor.execute(
        """SELECT count(DISTINCT split_part(lease_owner, ':', 1) || ':'
                               || split_part(lease_owner, ':', 2))
                      FILTER (WHERE lease_expires_at >= now()),
                  count(*) FILTER (WHERE lease_expires_at >= now()),
                  count(*) FILTER (WHERE lease_expires_at < now())
           FROM runs_run WHERE status = 'running' AND imported_at IS NULL"""
    )
    processes, renewed, expired = cursor.fetchone()
    yield GaugeMetricFamily(
        "rundesk_lease_processes",
        "Processes (executors, Celery workers) renewing a run's lease now: alive and busy",
        value=processes,
    )
    yield GaugeMetricFamily(
        "rundesk_runs_in_flight", "Running runs whose lease is renewed now", value=renewed
    )
    yield GaugeMetricFamily(
        "rundesk_leases_expired",
        "Running runs whose owner stopped renewing the lease: the sweep gives them back",
        value=expired,
    )
    cursor.execute("SELECT extract(epoch FROM max(started_at)) FROM runs_sweepturn")
    (swept,) = cursor.fetchone()
    yield GaugeMetricFamily(
        "rundesk_sweep_last_timestamp_seconds",
        "When the last sweep started (an executor's or Celery beat's), in Unix time; 0: never",
        value=float(swept or 0),
    )


def _sessions(cursor: Any) -> Iterable[Metric]:
    # application_name is rundesk:<role>[:run-<id>]: the role only, never the run.
    cursor.execute(
        """SELECT split_part(application_name, ':', 2), coalesce(state, ''), count(*)
           FROM pg_stat_activity
           WHERE datname = current_database() AND application_name LIKE 'rundesk:%%'
           GROUP BY 1, 2 ORDER BY 1, 2"""
    )
    sessions = GaugeMetricFamily(
        "rundesk_db_sessions",
        "Database sessions of Rundesk's processes, by role (application_name) and state "
        "(active and idle in transaction are in use)",
        labels=["role", "state"],
    )
    for role, state, count in cursor.fetchall():
        sessions.add_metric([role, state], count)
    yield sessions


FAMILIES: list[tuple[str, Callable[[Any], Iterable[Metric]]]] = [
    ("runs", _runs),
    ("run_durations", _run_durations),
    ("step_durations", _step_durations),
    ("open_items", _open_items),
    ("capture_gaps", _capture_gaps),
    ("lease_takeovers", _takeovers),
    ("alerts", _alerts),
    ("liveness", _liveness),
    ("sessions", _sessions),
]

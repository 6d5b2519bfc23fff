"""The overview's summaries: runs submitted and ended per minute and per
hour, by agent, with their durations and their steps' (RunSummary), kept
up to date by a roll-up that reads only what is new.

The roll-up reads runs the database already committed, from a cursor per
source (SummaryCursor): runs by (created_at, id) for what was submitted,
runs by (finished_at, id) for what ended, with the actions of those runs
for the step latencies (through action_identity_unique, run first).  It
adds what it read to the buckets in one transaction with the cursor's
move, so a roll-up that dies counts nothing twice and loses nothing.  No
statement of a run's main path touches a summary: a run that ends waits
on no summary row, the roll-up comes after (the sweep, an executor's or
beat's, runs it; two at once: one skips, SKIP LOCKED).

Why a horizon: created_at and finished_at are the writing transaction's
time (now(), statement_timestamp()), taken before its COMMIT, so a row may
become visible with a time the cursor has already passed.  The roll-up
reads only up to the start of the oldest transaction still open (none of
them can write a time before it), less SETTLE for sessions whose start
this role cannot see.

A run's steps are counted when the run ends, in the bucket of its end: a
step latency figure is that of the runs that ended then.
"""

from __future__ import annotations

import bisect
import datetime as dt
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from django.db import connection, transaction
from django.db.backends.utils import CursorWrapper

from runs.models import SummaryCursor, SummaryGrain, SummaryMeasure

# The histogram's buckets, by their lower bound in seconds (bucket 0 holds
# what is shorter than the first): a run's duration and a step's latency
# alike, from 10 ms to a day.  p50/p95/p99 are read from it, interpolated
# inside a bucket (summaries.Latency).
LATENCY_BOUNDS = (
    0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600,
    1200, 1800, 3600, 7200, 14400, 28800, 86400,
)  # fmt: skip
BUCKETS = len(LATENCY_BOUNDS) + 1
# A session this role cannot see may have begun this long before the roll-up.
SETTLE = dt.timedelta(seconds=2)
# Runs read per source per roll-up: a sweep's roll-up stays short; the next
# one goes on from where it stopped.
BATCH = 20_000
EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)

ENDED = {
    "completed": SummaryMeasure.COMPLETED,
    "failed": SummaryMeasure.FAILED,
    "cancelled": SummaryMeasure.CANCELLED,
}


@dataclass
class Bucket:
    count: int = 0
    seconds: float = 0.0
    histogram: list[int] = field(default_factory=lambda: [0] * BUCKETS)

    def add(self, seconds: float | None) -> None:
        self.count += 1
        if seconds is not None:
            seconds = max(seconds, 0.0)
            self.seconds += seconds
            self.histogram[bisect.bisect_right(LATENCY_BOUNDS, seconds)] += 1


# A summary row's key: grain, bucket, agent, measure.
Key = tuple[str, dt.datetime, str, str]
Buckets = dict[Key, Bucket]


@dataclass(frozen=True)
class Rolled:
    """What a roll-up read: runs per source (0: nothing new, or another
    roll-up held the cursor)."""

    submitted: int
    ended: int
    steps: int


def horizon() -> dt.datetime:
    """The time before which every run's created_at and finished_at is
    committed: the start of the oldest other transaction open now (or now),
    less SETTLE."""
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT least(statement_timestamp(), min(xact_start)) FROM pg_stat_activity
               WHERE datname = current_database() AND xact_start IS NOT NULL
                 AND pid <> pg_backend_pid()"""
        )
        (oldest,) = cursor.fetchone()
    return oldest - SETTLE


def roll_up(batch: int = BATCH) -> Rolled:
    """Adds the runs submitted and ended since the cursors to the summaries,
    up to the horizon, at most `batch` of each source."""
    until = horizon()
    submitted = _roll(
        "created",
        until,
        batch,
        """SELECT id, created_at, agent, NULL, NULL, is_drill OR imported_at IS NOT NULL
           FROM runs_run WHERE (created_at, id) > (%(at)s, %(id)s) AND created_at < %(until)s
           ORDER BY created_at, id LIMIT %(batch)s""",
    )
    ended = _roll(
        "finished",
        until,
        batch,
        """SELECT id, finished_at, agent, status,
               extract(epoch FROM finished_at - coalesce(started_at, created_at)),
               is_drill OR imported_at IS NOT NULL
           FROM runs_run WHERE finished_at IS NOT NULL
             AND (finished_at, id) > (%(at)s, %(id)s) AND finished_at < %(until)s
           ORDER BY finished_at, id LIMIT %(batch)s""",
    )
    return Rolled(submitted[0], ended[0], ended[1])


def roll_up_all() -> Rolled:
    """Rolls up until nothing is left before the horizon (the bench, a
    first roll-up of an installation with many runs)."""
    submitted = ended = steps = 0
    while True:
        rolled = roll_up()
        submitted, ended, steps = (
            submitted + rolled.submitted,
            ended + rolled.ended,
            steps + rolled.steps,
        )
        if rolled.submitted < BATCH and rolled.ended < BATCH:
            return Rolled(submitted, ended, steps)


def _roll(source: str, until: dt.datetime, batch: int, query: str) -> tuple[int, int]:
    """One source: (runs read, steps read)."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO runs_summarycursor (source, at, last_id) VALUES (%s, %s, 0)"
            " ON CONFLICT (source) DO NOTHING",
            [source, EPOCH],
        )
        cursor.execute(
            "SELECT at, last_id FROM runs_summarycursor WHERE source = %s FOR UPDATE SKIP LOCKED",
            [source],
        )
        held = cursor.fetchone()
        if held is None:
            return 0, 0  # another roll-up is reading this source now
        at, last_id = held
        cursor.execute(query, {"at": at, "id": last_id, "until": until, "batch": batch})
        rows = cursor.fetchall()
        if not rows:
            cursor.execute(
                "UPDATE runs_summarycursor SET rolled_at = statement_timestamp() WHERE source = %s",
                [source],
            )
            return 0, 0
        buckets: Buckets = defaultdict(Bucket)
        counted: dict[int, tuple[str, dt.datetime]] = {}
        for run_id, moment, agent, status, seconds, left_out in rows:
            if left_out:
                continue  # a drill's run, or one imported: not this installation's work
            measure = SummaryMeasure.SUBMITTED if status is None else ENDED.get(status)
            if measure is None:
                continue
            for key in _keys(moment, agent, measure):
                buckets[key].add(None if seconds is None else float(seconds))
            if status is not None:
                counted[run_id] = (agent, moment)
        steps = _steps(cursor, counted, buckets) if counted else 0
        _add(cursor, buckets)
        last = rows[-1]
        cursor.execute(
            "UPDATE runs_summarycursor SET at = %s, last_id = %s,"
            " rolled_at = statement_timestamp() WHERE source = %s",
            [last[1], last[0], source],
        )
    return len(rows), steps


def _keys(moment: dt.datetime, agent: str, measure: str) -> Iterable[Key]:
    minute = moment.astimezone(dt.UTC).replace(second=0, microsecond=0)
    yield SummaryGrain.MINUTE, minute, agent, measure
    yield SummaryGrain.HOUR, minute.replace(minute=0), agent, measure
    yield SummaryGrain.DAY, minute.replace(hour=0, minute=0), agent, measure


def _steps(
    cursor: CursorWrapper, counted: dict[int, tuple[str, dt.datetime]], buckets: Buckets
) -> int:
    """The latencies of the ended runs' actions (dispatch to end), in the
    bucket of their run's end."""
    cursor.execute(
        """SELECT run_id, extract(epoch FROM finished_at - dispatched_at) FROM runs_action
           WHERE run_id = ANY(%s) AND finished_at IS NOT NULL""",
        [list(counted)],
    )
    steps = 0
    # A run's steps all go to the buckets of its end: found once per run,
    # not once per step (a thousand runs ending were a thousand times eight
    # times three bucket keys worked out in the executor's serve thread).
    into_by_run: dict[int, list[Bucket]] = {}
    for run_id, seconds in cursor.fetchall():
        into = into_by_run.get(run_id)
        if into is None:
            agent, moment = counted[run_id]
            into = into_by_run[run_id] = [
                buckets[key] for key in _keys(moment, agent, SummaryMeasure.STEP)
            ]
        value = float(seconds)
        for bucket in into:
            bucket.add(value)
        steps += 1
    return steps


def _add(cursor: CursorWrapper, buckets: Buckets) -> None:
    """Adds the buckets to the summaries (one statement)."""
    if not buckets:
        return
    grains, moments, agents, measures, counts, seconds, histograms = ([] for _ in range(7))
    for (grain, moment, agent, measure), bucket in buckets.items():
        grains.append(grain)
        moments.append(moment)
        agents.append(agent)
        measures.append(measure)
        counts.append(bucket.count)
        seconds.append(bucket.seconds)
        # A row per bucket: unnest cannot take a two-dimensional array apart by rows.
        histograms.append(",".join(map(str, bucket.histogram)))
    cursor.execute(
        """INSERT INTO runs_runsummary (grain, bucket, agent, measure, count, seconds, histogram)
           SELECT g, b, a, m, c, s, string_to_array(h, ',')::bigint[]
           FROM unnest(%s::text[], %s::timestamptz[], %s::text[], %s::text[], %s::bigint[],
                       %s::float8[], %s::text[]) AS t(g, b, a, m, c, s, h)
           ON CONFLICT (grain, bucket, agent, measure) DO UPDATE SET
               count = runs_runsummary.count + EXCLUDED.count,
               seconds = runs_runsummary.seconds + EXCLUDED.seconds,
               histogram = ARRAY(
                   SELECT old + new
                   FROM unnest(runs_runsummary.histogram, EXCLUDED.histogram)
                        WITH ORDINALITY AS h(old, new, i)
                   ORDER BY i)""",
        [grains, moments, agents, measures, counts, seconds, histograms],
    )


# -- reading them -----------------------------------------------------------------------


@dataclass(frozen=True)
class Latency:
    """Durations of runs or steps of an agent: how many, and p50/p95/p99
    read from the histogram (None when there are none)."""

    count: int
    mean: float | None
    p50: float | None
    p95: float | None
    p99: float | None

    @classmethod
    def of(cls, count: int, seconds: float, histogram: list[int]) -> Latency:
        return cls(
            count,
            seconds / count if count else None,
            *(quantile(histogram, q) for q in (0.50, 0.95, 0.99)),
        )


def quantile(histogram: list[int], q: float) -> float | None:
    """The q-quantile of the durations in `histogram` (LATENCY_BOUNDS),
    interpolated linearly inside its bucket; the last bucket has no upper
    bound: its lower one is said."""
    total = sum(histogram)
    if not total:
        return None
    rank = q * total
    seen = 0
    for index, n in enumerate(histogram):
        if n and seen + n >= rank:
            low = LATENCY_BOUNDS[index - 1] if index else 0.0
            if index >= len(LATENCY_BOUNDS):
                return low
            high = LATENCY_BOUNDS[index]
            return low + (high - low) * (rank - seen) / n
        seen += n
    return LATENCY_BOUNDS[-1]


@dataclass(frozen=True)
class Window:
    """A span the overview shows: how far back, in which grain over time,
    and in which its durations are summed (the fewer rows, the faster)."""

    name: str
    span: dt.timedelta
    grain: str
    totals_grain: str


WINDOWS = {
    window.name: window
    for window in [
        Window("hour", dt.timedelta(hours=1), SummaryGrain.MINUTE, SummaryGrain.MINUTE),
        Window("day", dt.timedelta(days=1), SummaryGrain.HOUR, SummaryGrain.HOUR),
        Window("week", dt.timedelta(days=7), SummaryGrain.HOUR, SummaryGrain.DAY),
    ]
}


def start_of(window: Window, now: dt.datetime, grain: str | None = None) -> dt.datetime:
    """The first bucket of `window` at `now`, in its grain (or `grain`)."""
    grain = grain or window.grain
    start = (now - window.span).astimezone(dt.UTC).replace(second=0, microsecond=0)
    if grain == SummaryGrain.MINUTE:
        return start
    return (
        start.replace(minute=0) if grain == SummaryGrain.HOUR else start.replace(hour=0, minute=0)
    )


def over_time(window: Window, now: dt.datetime) -> list[tuple[dt.datetime, str, int]]:
    """(bucket, measure, runs) of every agent, from the window's start:
    runs submitted and ended per bucket."""
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT bucket, measure, sum(count)::bigint FROM runs_runsummary
               WHERE grain = %s AND bucket >= %s AND measure <> %s
               GROUP BY bucket, measure ORDER BY bucket, measure""",
            [window.grain, start_of(window, now), SummaryMeasure.STEP],
        )
        return cursor.fetchall()


def latencies(window: Window, now: dt.datetime) -> dict[str, dict[str, Latency]]:
    """agent -> "run" or "step" -> Latency over the window (from the start
    of its first bucket in its totals' grain: a week's from the start of
    its first day): the runs that ended (completed, failed, cancelled
    together) and their steps."""
    rows = """WITH rows AS (
                  SELECT agent, CASE WHEN measure = %(step)s THEN 'step' ELSE 'run' END AS what,
                         count, seconds, histogram
                  FROM runs_runsummary
                  WHERE grain = %(grain)s AND bucket >= %(since)s AND measure <> %(submitted)s)"""
    arguments = {
        "step": SummaryMeasure.STEP,
        "submitted": SummaryMeasure.SUBMITTED,
        "grain": window.totals_grain,
        "since": start_of(window, now, window.totals_grain),
    }
    histograms: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0] * BUCKETS)
    with connection.cursor() as cursor:
        cursor.execute(
            rows
            + """ SELECT agent, what, i, sum(n)::bigint
                       FROM rows, unnest(histogram) WITH ORDINALITY AS h(n, i)
                       GROUP BY agent, what, i""",
            arguments,
        )
        for agent, what, index, n in cursor.fetchall():
            histograms[agent, what][index - 1] = n
        cursor.execute(
            rows
            + """ SELECT agent, what, sum(count)::bigint, sum(seconds) FROM rows
                       GROUP BY agent, what ORDER BY agent, what""",
            arguments,
        )
        found: dict[str, dict[str, Latency]] = {}
        for agent, what, count, seconds in cursor.fetchall():
            found.setdefault(agent, {})[what] = Latency.of(count, seconds, histograms[agent, what])
        return found


def rolled_up_to() -> dt.datetime | None:
    """How far the summaries go: the older of the two cursors' last roll-up
    (None before the first)."""
    times = list(SummaryCursor.objects.values_list("rolled_at", flat=True))
    return min(times) if times and None not in times else None

"""The overview: its figures over time come from summaries the roll-up
keeps incrementally (a second roll-up reads only what is new, a run
committed late behind the cursor is still counted once), its figures of
now from the few rows in each state; every figure links to the list
behind it; the page only reads, for every signed-in user."""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid

import psycopg
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.db.models import Sum
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from evidence.models import CaptureGapHour, LockIncident
from runs import summaries
from runs.executor import claim_and_drive
from runs.harness import database_url
from runs.models import (
    Action,
    ActionState,
    Alert,
    AlertChannel,
    AlertState,
    OutcomeKind,
    Phase,
    Run,
    RunStatus,
    RunSummary,
    SummaryCursor,
)
from runs.outcomes import open_item
from runs.submission import submit
from runs.sweep import sweep

pytestmark = pytest.mark.django_db

ENDED = (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED)


def ended_run(
    status: RunStatus,
    *,
    ended: dt.datetime,
    took: float,
    agent: str = "research",
    steps: tuple[float, ...] = (),
    drill: bool = False,
) -> Run:
    """A run that ended at `ended` after `took` seconds, with an action per
    latency in `steps` (dispatched to finished)."""
    started = ended - dt.timedelta(seconds=took)
    run = Run.objects.create(
        agent=agent,
        question=f"{status} run",
        documents=["a.md"],
        status=status,
        phase=Phase.DONE if status == RunStatus.COMPLETED else Phase.RESEARCH,
        created_at=started - dt.timedelta(seconds=1),
        started_at=started,
        finished_at=ended,
        is_drill=drill,
    )
    for n, latency in enumerate(steps):
        Action.objects.create(
            run=run,
            step_key=f"read:{n}",
            kind="read_document",
            effect_class="read",
            input={},
            input_digest="",
            state=ActionState.COMPLETED,
            epoch=1,
            dispatched_at=ended - dt.timedelta(seconds=latency),
            finished_at=ended,
        )
    return run


def minute_of(moment: dt.datetime) -> dt.datetime:
    return moment.replace(second=0, microsecond=0)


def summary(measure: str, bucket: dt.datetime, grain: str = "minute") -> RunSummary:
    return RunSummary.objects.get(grain=grain, bucket=bucket, agent="research", measure=measure)


def test_roll_up_counts_runs_and_steps_per_minute_and_hour():
    ended = minute_of(timezone.now() - dt.timedelta(minutes=10)) + dt.timedelta(seconds=30)
    for took in (1.5, 3.0, 12.0):
        ended_run(RunStatus.COMPLETED, ended=ended, took=took, steps=(0.03, 0.3))
    ended_run(RunStatus.FAILED, ended=ended, took=4.0, steps=(2.5,))
    ended_run(RunStatus.COMPLETED, ended=ended, took=1.0, drill=True, steps=(1.0,))  # left out

    rolled = summaries.roll_up()
    assert (rolled.ended, rolled.steps) == (5, 7)  # read: the drill's too, counted: not
    completed = summary("completed", minute_of(ended))
    assert completed.count == 3 and completed.seconds == pytest.approx(16.5)
    # 1.5 s and 3 s in [1, 2) and [2, 5); 12 s in [10, 20).
    assert completed.histogram[summaries.LATENCY_BOUNDS.index(1) + 1] == 1
    assert completed.histogram[summaries.LATENCY_BOUNDS.index(10) + 1] == 1
    assert summary("failed", minute_of(ended)).count == 1
    assert summary("step", minute_of(ended)).count == 7
    hour = summary("completed", minute_of(ended).replace(minute=0), grain="hour")
    assert hour.count == 3
    assert summary("submitted", minute_of(ended - dt.timedelta(seconds=13))).count >= 1

    figures = summaries.latencies(summaries.WINDOWS["hour"], timezone.now())["research"]
    run, step = figures["run"], figures["step"]
    assert run.count == 4 and step.count == 7
    # Quantiles from the buckets: the median of (1.5, 3, 4, 12) lies in [2, 5).
    assert 2 <= run.p50 <= 5 and 10 <= run.p99 <= 20
    assert 0.02 <= step.p50 <= 0.5 and 2 <= step.p99 <= 5


def test_a_second_roll_up_reads_only_what_is_new():
    ended = timezone.now() - dt.timedelta(minutes=5)
    ended_run(RunStatus.COMPLETED, ended=ended, took=2.0)
    first = summaries.roll_up()
    assert first.ended == 1
    assert summaries.roll_up() == summaries.Rolled(0, 0, 0)  # nothing new: nothing read

    ended_run(RunStatus.CANCELLED, ended=ended + dt.timedelta(seconds=1), took=1.0)
    again = summaries.roll_up()
    assert (again.submitted, again.ended) == (1, 1)  # the new run only
    assert summary("completed", minute_of(ended)).count == 1  # not counted twice
    assert summary("cancelled", minute_of(ended + dt.timedelta(seconds=1))).count == 1
    cursor = SummaryCursor.objects.get(source="finished")
    assert cursor.at == ended + dt.timedelta(seconds=1)


def test_roll_up_reads_in_batches_from_its_cursor():
    ended = timezone.now() - dt.timedelta(minutes=5)
    for n in range(5):
        ended_run(RunStatus.COMPLETED, ended=ended + dt.timedelta(seconds=n), took=1.0)
    assert summaries.roll_up(batch=2).ended == 2
    assert summaries.roll_up(batch=2).ended == 2
    assert summaries.roll_up(batch=2).ended == 1
    assert summaries.roll_up(batch=2).ended == 0
    assert (
        summary("completed", minute_of(ended)).count
        + (
            RunSummary.objects.filter(grain="minute", measure="completed")
            .exclude(bucket=minute_of(ended))
            .values_list("count", flat=True)
            .first()
            or 0
        )
        == 5
    )


@pytest.mark.django_db(transaction=True)
def test_a_run_that_commits_late_behind_the_cursor_is_counted_once():
    """A transaction stamps a run's end with its own start time (now()) but
    commits after a roll-up that read runs ended later: the roll-up waits
    for it (its horizon is the oldest open transaction's start), so the
    late run is counted, once, by the next one."""
    ended_run(RunStatus.COMPLETED, ended=timezone.now() - dt.timedelta(minutes=3), took=1.0)
    started: list[dt.datetime] = []
    failures: list[BaseException] = []
    opened, release = threading.Event(), threading.Event()

    def late_writer() -> None:
        try:
            with psycopg.connect(database_url()) as conn:
                started.append(conn.execute("SELECT now()").fetchone()[0])
                opened.set()
                release.wait(20)
                conn.execute(
                    """INSERT INTO runs_run (agent, agent_version, input, question, documents,
                           status, status_reason, phase, phase_reason, action_budget, faults,
                           faults_fired, lease_owner, lease_epoch, cancel_requested_by,
                           is_drill, origin_format, origin_installation, origin_seal,
                           created_at, updated_at, started_at, finished_at, labels)
                       VALUES ('research', '1', '{}', 'late', '{}', 'failed', '', 'research',
                           '', 40, '[]', '{}', '', 1, '', false, '', '', '',
                           now() - interval '1 second', now(), now(), now(), '{}')"""
                )
                conn.commit()
        except BaseException as error:  # said by the test, not lost in the thread
            failures.append(error)
            opened.set()

    writer = threading.Thread(target=late_writer)
    writer.start()
    try:
        assert opened.wait(10) and not failures
        (began,) = started
        # A run that ended after the late one's stamp, committed first.
        ended_run(RunStatus.COMPLETED, ended=began + dt.timedelta(seconds=1), took=1.0)
        while timezone.now() < began + summaries.SETTLE + dt.timedelta(seconds=1.5):
            time.sleep(0.05)  # the clock passes both ends and the settle margin
        assert summaries.roll_up().ended == 1  # the first run only: the horizon held
    finally:
        release.set()
        writer.join(20)
    assert not failures
    while timezone.now() < began + summaries.SETTLE + dt.timedelta(seconds=2):
        time.sleep(0.05)
    assert summaries.roll_up().ended == 2  # the late run and the one after it
    assert summaries.roll_up().ended == 0
    counts = dict(
        RunSummary.objects.filter(grain="hour")
        .values_list("measure")
        .annotate(n=Sum("count"))
        .values_list("measure", "n")
    )
    assert counts["failed"] == 1 and counts["completed"] == 2


# -- the page ---------------------------------------------------------------------------


def seed_now() -> dict[str, object]:
    """Trouble of every kind the overview counts now."""
    now = timezone.now()
    waiting = Run.objects.create(
        question="waits", documents=["a.md"], status=RunStatus.NEEDS_OPERATOR
    )
    item = open_item(
        run_id=waiting.pk,
        kind=OutcomeKind.EFFECT,
        subject=f"effect:{uuid.uuid4().hex}",
        summary="an effect whose answer was lost",
        evidence={},
    )
    Run.objects.create(question="waits alone", documents=["a.md"], status=RunStatus.NEEDS_OPERATOR)
    Run.objects.create(
        question="runs",
        documents=["a.md"],
        status=RunStatus.RUNNING,
        lease_owner="executor@host-9:77",
        lease_epoch=1,
        lease_expires_at=now + dt.timedelta(seconds=10),
        started_at=now,
    )
    Alert.objects.filter(item_id=item.pk).delete()
    Alert.objects.create(
        item_id=item.pk,
        channel=AlertChannel.WEBHOOK,
        state=AlertState.FAILING,
        attempts=2,
        last_error="connection refused",
    )
    CaptureGapHour.objects.create(
        hour=now.replace(minute=0, second=0, microsecond=0), reason="queue_full", count=6
    )
    LockIncident.objects.create(source="sampler", summary="x", started_at=now)
    return {"item": item}


def test_the_overview_shows_every_figure_with_the_list_behind_it(viewer):
    ended = timezone.now() - dt.timedelta(minutes=7)
    failed = ended_run(RunStatus.FAILED, ended=ended, took=3.0, steps=(0.2,))
    ended_run(RunStatus.COMPLETED, ended=ended, took=2.0, steps=(0.1, 0.4))
    seed_now()
    summaries.roll_up()

    response = viewer.get("/overview/")
    assert response.status_code == 200
    page = response.content.decode()
    context = response.context
    # Runs over time: a bar per measure, each point linking to its runs.
    traces = {trace["name"]: trace for trace in context["over_time"]["data"]}
    assert set(traces) >= {"submitted", "completed", "failed"}
    link = traces["failed"]["customdata"][0]
    assert [run.pk for run in viewer.get(link).context["runs"]] == [failed.pk]
    # Per agent: durations and throughput.
    (research,) = context["agents"]
    assert research.run.count == 2 and research.step.count == 3
    assert research.runs_per_minute == round(2 / 60, 2)
    assert 'id="agent-research"' in page
    # Now: waiting and why, open items by age, owners, gaps, locks, alerts.
    reasons = {words: line.runs for words, line, _ in context["waiting"]}
    assert reasons == {"outside effect": 1, "no item holds it": 1}
    ((_, ages),) = context["items"]
    assert ages.by_age == [1, 0, 0, 0]
    (owner,) = context["owners"]
    assert (owner.name, owner.runs, owner.alive) == ("executor@host-9:77", 1, True)
    assert [n for _, n, _ in context["gaps"]] == [6]
    assert [n for _, n, _ in context["locks"]] == [1]
    assert [n for _, n in context["alerts"]] == [1]
    assert "/inbox/?kind=effect" in page and "/?status=needs_operator" in page


def test_the_overview_reads_as_many_statements_at_any_size(viewer):
    """Its cost does not grow with the runs: the same statements for 3
    runs ended and for 60 (the summaries hold them)."""
    ended = timezone.now() - dt.timedelta(minutes=7)
    seed_now()

    def statements() -> int:
        summaries.roll_up()
        with CaptureQueriesContext(connection) as queries:
            assert viewer.get("/overview/?window=week").status_code == 200
        return len(queries)

    for n in range(3):
        ended_run(RunStatus.COMPLETED, ended=ended, took=1.0 + n, steps=(0.1,))
    few = statements()
    for n in range(60):
        ended_run(RunStatus.FAILED, ended=ended, took=1.0 + n, steps=(0.1, 0.2))
    assert statements() == few


def test_the_figures_refresh_alone(viewer):
    page = viewer.get("/overview/").content.decode()
    assert 'hx-get="/overview/"' in page and 'hx-trigger="every 10s"' in page
    region = viewer.get(
        "/overview/", HTTP_HX_REQUEST="true", HTTP_HX_TARGET="overview-figures"
    ).content.decode()
    assert region.lstrip().startswith('<div id="overview-figures"') and "<header>" not in region


@pytest.mark.parametrize("window", ["hour", "day", "week"])
def test_each_window_answers(viewer, window):
    ended_run(RunStatus.COMPLETED, ended=timezone.now() - dt.timedelta(minutes=3), took=1.0)
    summaries.roll_up()
    response = viewer.get("/overview/", {"window": window})
    assert response.status_code == 200 and response.context["window"].name == window


def test_a_window_it_does_not_know_answers_400(viewer):
    response = viewer.get("/overview/", {"window": "fortnight"})
    assert response.status_code == 400 and "is not one of: hour, day, week" in (
        response.content.decode()
    )


def test_anonymous_is_sent_to_sign_in(client: Client):
    response = client.get("/overview/")
    assert response.status_code == 302 and response.url.startswith("/login/")


def test_viewers_and_operators_read_it_and_nobody_posts(viewer, operator):
    assert viewer.get("/overview/").status_code == 200
    assert operator.get("/overview/").status_code == 200
    assert operator.post("/overview/").status_code == 405
    assert "nav-overview" in viewer.get("/needs-you/").content.decode()


@pytest.mark.django_db(transaction=True)
def test_a_run_ends_while_the_summaries_are_locked_and_the_sweep_goes_on():
    """Another session holds every summary table locked (ACCESS EXCLUSIVE)
    for the whole run: the run is driven to its end all the same (no
    statement of its path touches a summary), and the sweep's roll-up gives
    up within its lock bound while the sweep's other steps go on; once the
    lock is gone, the next roll-up counts the run."""
    with psycopg.connect(database_url()) as holder:
        holder.execute("LOCK TABLE runs_runsummary, runs_summarycursor IN ACCESS EXCLUSIVE MODE")
        run = submit(question="Compare the funds", documents=["northwind-clean-energy.md"])
        claim_and_drive(run.pk)
        run.refresh_from_db()
        assert run.status == RunStatus.COMPLETED
        started = time.monotonic()
        assert sweep().rolled == 0
        assert time.monotonic() - started < 10
        holder.rollback()
    deadline = time.monotonic() + 30
    while not RunSummary.objects.filter(measure="completed").exists():
        assert time.monotonic() < deadline, "the run was never rolled up"
        summaries.roll_up()
        time.sleep(0.1)
    assert (
        sum(
            RunSummary.objects.filter(grain="minute", measure="completed").values_list(
                "count", flat=True
            )
        )
        == 1
    )


def test_the_bench_refuses_no_runs_to_measure_at():
    with pytest.raises(CommandError, match="--dashboard-runs must be at least 1"):
        call_command("bench", "--dashboard", "--dashboard-runs", "0")

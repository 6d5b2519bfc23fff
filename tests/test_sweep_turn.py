"""The installation's executors take turns at the sweep (runs/sweep.py,
`take_turn`): N executors sweep once or twice an interval between them,
not N times, and no interval and a half passes without a sweep."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import psycopg
import pytest
from django.db import OperationalError, connection

from runs import sweep, tasks
from runs.executor import Executor
from runs.models import SweepTurn
from tests.conftest import database_url

pytestmark = pytest.mark.django_db(transaction=True)

INTERVAL = 0.4


def on_threads(count: int, work: Callable[[int], None]) -> None:
    """`work(i)` on `count` threads, each on a connection of its own, started together."""
    barrier = threading.Barrier(count)
    errors: list[BaseException] = []

    def thread(i: int) -> None:
        try:
            barrier.wait()
            work(i)
        except BaseException as error:
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=thread, args=(i,)) for i in range(count)]
    for each in threads:
        each.start()
    for each in threads:
        each.join(60)
    assert not errors, errors


def test_of_executors_due_at_once_one_takes_the_turn(settings):
    settings.RUNDESK_SWEEP_SECONDS = 3600
    for round in range(10):
        SweepTurn.objects.update(started_at="2000-01-01T00:00:00Z")
        taken: list[str] = []

        def due(i: int) -> None:
            if sweep.take_turn(f"executor-{i}"):
                taken.append(f"executor-{i}")

        on_threads(4, due)
        assert len(taken) == 1, (round, taken)
        assert SweepTurn.objects.get().taken_by == taken[0]


def test_the_turn_comes_back_after_half_an_interval(settings):
    settings.RUNDESK_SWEEP_SECONDS = INTERVAL
    assert sweep.take_turn("a")  # no row yet: the first takes it
    assert not sweep.take_turn("b")
    assert not sweep.take_turn("a")
    time.sleep(INTERVAL / 2 + 0.05)
    assert sweep.take_turn("b")
    assert SweepTurn.objects.get().taken_by == "b"


def test_a_turn_dated_ahead_of_the_servers_clock_is_taken(settings):
    """A clock set back, or a failover to a server behind: the turn would
    stop every executor's sweep until the clock caught up."""
    settings.RUNDESK_SWEEP_SECONDS = 3600
    SweepTurn.objects.create(id=1, started_at="2999-01-01T00:00:00Z", taken_by="ahead")
    assert sweep.take_turn("a")
    assert SweepTurn.objects.get().taken_by == "a"
    assert not sweep.take_turn("b")


def sweeps_of(executors: int, seconds: float, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """When the sweeps of `executors` executors due every INTERVAL started,
    over `seconds` (each executor's serve thread, as Executor.serve runs
    it), by the server's clock: the turn each took."""
    started: list[float] = []
    real = sweep.sweep

    def recorded() -> sweep.Swept:
        started.append(SweepTurn.objects.get().started_at.timestamp())
        return real()

    monkeypatch.setattr(sweep, "sweep", recorded)
    end = time.monotonic() + seconds

    def serving(i: int) -> None:
        executor = Executor()
        time.sleep(i * INTERVAL / executors)  # due at their own times
        while time.monotonic() < end:
            executor._sweep_if_due()
            time.sleep(0.01)

    on_threads(executors, serving)
    return sorted(started)


def test_four_executors_sweep_once_or_twice_an_interval_not_four_times(settings, monkeypatch):
    settings.RUNDESK_SWEEP_SECONDS = INTERVAL
    started = sweeps_of(4, 10 * INTERVAL, monkeypatch)
    # Each swept every interval before: 40 or more.  (The bounds leave
    # room for threads a busy machine runs late.)
    assert 8 <= len(started) <= 2 * 10 + 1, started
    gaps = [b - a for a, b in itertools.pairwise(started)]
    assert min(gaps) >= INTERVAL / 2, gaps
    assert max(gaps) <= 1.5 * INTERVAL + 0.3, gaps


def test_an_executor_alone_sweeps_every_interval(settings, monkeypatch):
    settings.RUNDESK_SWEEP_SECONDS = INTERVAL
    started = sweeps_of(1, 10 * INTERVAL + 0.1, monkeypatch)
    # 11 on time; a turn it found not come back yet would leave about 6.
    assert 9 <= len(started) <= 11, started


@pytest.mark.parametrize(
    "held",
    [
        "SELECT 1 FROM runs_sweepturn FOR UPDATE",
        "LOCK TABLE runs_sweepturn IN ACCESS EXCLUSIVE MODE",
    ],
)
def test_a_stranger_holding_the_turn_stops_no_sweep(held, settings, monkeypatch):
    """Each executor then sweeps, as it did before turns, after waiting for
    the lock at most LOCK_WAIT (a quarter second here)."""
    monkeypatch.setattr("runs.decisions.LOCK_WAIT", "250ms")
    settings.RUNDESK_SWEEP_SECONDS = 3600
    assert sweep.take_turn("a")
    with psycopg.connect(database_url()) as stranger:
        stranger.execute(held)
        started = time.monotonic()
        assert sweep.take_turn("b")
        assert sweep.take_turn("c")
        assert time.monotonic() - started < 2
        stranger.rollback()
    assert SweepTurn.objects.get().taken_by == "a"
    assert not sweep.take_turn("d")  # the turn a took is still recent


def test_beats_sweep_takes_the_turn_whoever_swept_and_executors_leave_theirs(settings):
    """Beat's sweep also hands out runs again, which an executor's does not:
    beat sweeps every interval whatever, and says so."""
    settings.RUNDESK_SWEEP_SECONDS = 3600
    assert sweep.take_turn("executor-a")
    tasks.sweep()
    assert SweepTurn.objects.get().taken_by.startswith("beat ")
    assert not sweep.take_turn("executor-b")


def test_a_turn_the_database_cannot_take_is_swept_anyway(monkeypatch, caplog):
    def gone(*args: object) -> int:
        raise OperationalError("connection refused")

    monkeypatch.setattr("runs.sweep.changes_rows_waits_bounded", gone)
    assert sweep.take_turn("executor-a")
    assert "its turn not taken, sweeping anyway: connection refused" in caplog.text

"""Real Celery worker processes for tests: started, waited for, killed.

The worker process itself is the benchmark's (runs/benchmarks/scale.py:
`CeleryWorker`, configured for a `Broker`); a test's `Worker` adds that a
worker which dies unasked fails the test, with its output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from django.conf import settings

from runs.benchmarks.scale import FILESYSTEM, Broker, CeleryWorker
from runs.harness import wait_for
from runs.tasks import execute_run


@pytest.fixture
def broker(tmp_path: Path, settings: object) -> Iterator[Path]:
    """The filesystem broker folder the worker processes use (process_env's
    RUNDESK_VAR_DIR), for the tasks this process sends too."""
    folder = tmp_path / "var" / "celery-broker"
    folder.mkdir(parents=True)
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(folder),
        "data_folder_out": str(folder),
        "control_folder": str(folder.parent / "celery-control"),
        "store_processed": False,
    }
    conf = execute_run.app.conf
    previous, conf.broker_transport_options = (
        conf.broker_transport_options,
        settings.CELERY_BROKER_TRANSPORT_OPTIONS,
    )
    try:
        yield folder
    finally:
        conf.broker_transport_options = previous


def polled_often() -> Broker:
    """The project's filesystem queue (the `broker` fixture's folder, once
    it has set it) for a `Worker` that looks at it every 50 ms, not every
    second (kombu's default): a task sent waits that long for it."""
    return Broker(
        FILESYSTEM,
        settings.CELERY_TASK_DEFAULT_QUEUE,
        {**settings.CELERY_BROKER_TRANSPORT_OPTIONS, "polling_interval": 0.05},
    )


def enqueue(run_id: int) -> None:
    """execute_run for the run, on a connection of its own: the app's pooled
    producer may still point at an earlier test's broker folder."""
    with execute_run.app.connection_for_write() as conn:
        execute_run.apply_async((run_id,), connection=conn)


class Worker(CeleryWorker):
    """`celery -A dashboard worker` (solo pool unless told; with beat=True,
    beat embedded, as make demo runs it) for a `Broker`, or with the
    project's settings (the filesystem broker of `broker` above)."""

    def alive(self) -> None:
        assert not self.exited(), self.output()

    def wait_ready(self, timeout: float = 30) -> None:
        wait_until(self.ready, timeout, "worker not ready", self)


def wait_until(
    condition: Callable[[], object], timeout: float, what: str, *workers: Worker
) -> None:
    """Waits for `condition`; a worker of `workers` that dies meanwhile
    fails the test at once, with its output."""
    wait_for(condition, what, timeout, watching=[worker.alive for worker in workers])

"""The same execute(run_id) as a Celery task, with a real worker process."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from runs.models import Run, RunStatus
from runs.tasks import execute_run
from tests.conftest import ROOT

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_real_worker_executes_a_run_and_a_redelivered_task_changes_nothing(
    process_env, journal, tmp_path, settings
):
    broker = tmp_path / "var" / "celery-broker"
    broker.mkdir(parents=True)
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(broker),
        "data_folder_out": str(broker),
        "store_processed": False,
    }
    conf = execute_run.app.conf
    previous, conf.broker_transport_options = (
        conf.broker_transport_options,
        settings.CELERY_BROKER_TRANSPORT_OPTIONS,
    )
    run = Run.objects.submit(question="q", documents=["northwind-clean-energy.md"])
    # The same task twice: as after a redelivery (acks_late).
    execute_run.delay(run.pk)
    execute_run.delay(run.pk)
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "dashboard",
            "worker",
            "--pool",
            "solo",
            "--loglevel",
            "info",
            "--without-heartbeat",
            "--without-mingle",
            "--without-gossip",
        ],
        cwd=ROOT,
        env=process_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while Run.objects.get(pk=run.pk).status != RunStatus.COMPLETED:
            assert time.monotonic() < deadline, "worker did not complete the run"
            assert worker.poll() is None, worker.stdout.read()
            time.sleep(0.1)
        while any(broker.iterdir()):  # the second task is consumed too
            assert time.monotonic() < deadline, "second task not consumed"
            time.sleep(0.1)
    finally:
        conf.broker_transport_options = previous
        worker.terminate()
        output, _ = worker.communicate(timeout=30)
    run.refresh_from_db()
    assert run.lease_epoch == 1  # claimed once
    assert sum(journal.counts().values()) == 4  # read, summarize, compose, deliver: once each
    assert "'completed'" in output and "'not_claimable'" in output

"""Garbage collection in the processes that drive runs (runs/heap.py):
the executor's and a Celery worker's leave start-up's objects out of
every collection and collect a young generation of YOUNG_OBJECTS."""

from __future__ import annotations

import pytest

from runs.heap import YOUNG_OBJECTS
from tests.conftest import python

# What the process's collections are set to once it has done its work.
REPORT = "import gc; print(gc.get_threshold()[0], gc.get_freeze_count())"


def collections_after(code: str, env: dict[str, str]) -> tuple[int, int]:
    done = python(f"{code}\n{REPORT}", env)
    assert done.returncode == 0, done.stderr
    young, frozen = done.stdout.split()[-2:]
    return int(young), int(frozen)


@pytest.mark.django_db(transaction=True)
def test_the_executor_collects_for_many_runs(process_env):
    young, frozen = collections_after(
        "import django; django.setup()\n"
        "from django.core.management import call_command\n"
        "call_command('executor', '--once')",
        process_env,
    )
    assert young == YOUNG_OBJECTS
    assert frozen > 10_000  # Django's and the agents' objects, left out


def test_a_celery_worker_collects_for_many_runs(process_env):
    young, frozen = collections_after(
        "from celery import signals\n"
        "import dashboard.celery\n"
        "signals.worker_process_init.send(sender=None)",
        process_env,
    )
    assert young == YOUNG_OBJECTS
    assert frozen > 10_000


def test_a_plain_process_keeps_pythons_collections(process_env):
    young, frozen = collections_after("import dashboard.celery", process_env)
    assert young < YOUNG_OBJECTS
    assert frozen == 0

"""An executor keeps its threads on one CPU core (runs/cores.py): the one
fewest other executors keep to, RUNDESK_EXECUTOR_CORE's, or none (off)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter

import pytest

from runs import cores
from runs.cores import _cores_of_other_executors, is_executor, least_taken
from tests.conftest import manage, python

CORES = sorted(os.sched_getaffinity(0))
needs_two_cores = pytest.mark.skipif(len(CORES) < 2, reason="one core allowed: nothing to choose")


def threads_cores(pid: int | str) -> set[tuple[int, ...]]:
    """The cores each thread of process `pid` may use."""
    threads = os.listdir(f"/proc/{pid}/task")
    return {tuple(sorted(os.sched_getaffinity(int(t)))) for t in threads}


@needs_two_cores
@pytest.mark.django_db(transaction=True)
def test_an_executor_keeps_every_thread_on_one_core(process_env):
    executor = manage("executor", env=process_env)
    try:
        deadline = time.monotonic() + 60
        while len(cores := threads_cores(executor.pid)) != 1 or len(next(iter(cores))) != 1:
            assert executor.poll() is None, executor.communicate()[1]
            assert time.monotonic() < deadline, f"its threads may still use {cores}"
            time.sleep(0.05)
    finally:
        executor.terminate()
        executor.communicate(timeout=60)
    assert next(iter(cores))[0] in CORES


# A thread started before, then the core and every thread's cores in the block.
IN_THE_BLOCK = (
    "import django, os, threading, time; django.setup()\n"
    "from runs.cores import kept_to_one_core\n"
    "def threads_cores(pid):\n"
    "    threads = os.listdir(f'/proc/{pid}/task')\n"
    "    return {tuple(sorted(os.sched_getaffinity(int(t)))) for t in threads}\n"
    "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
    "with kept_to_one_core() as core:\n"
    "    print(core, sorted(threads_cores('self')))\n"
    "print(sorted(threads_cores('self')))"
)


@needs_two_cores
def test_the_core_can_be_named_or_the_keeping_turned_off(process_env):
    named = python(IN_THE_BLOCK, {**process_env, "RUNDESK_EXECUTOR_CORE": str(CORES[-1])})
    assert named.returncode == 0, named.stderr
    assert named.stdout.splitlines()[-2:] == [f"{CORES[-1]} [({CORES[-1]},)]", f"[{tuple(CORES)}]"]
    off = python(IN_THE_BLOCK, {**process_env, "RUNDESK_EXECUTOR_CORE": "off"})
    assert off.returncode == 0, off.stderr
    assert off.stdout.splitlines()[-2:] == [f"None [{tuple(CORES)}]", f"[{tuple(CORES)}]"]


@needs_two_cores
@pytest.mark.django_db(transaction=True)
def test_a_process_that_ran_an_executor_gets_its_cores_back(process_env):
    done = python(
        "import django, os; django.setup()\n"
        "from django.core.management import call_command\n"
        "call_command('executor', '--once')\n"
        "print(sorted(os.sched_getaffinity(0)))",
        process_env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == str(CORES)


@pytest.mark.django_db(transaction=True)
def test_a_core_the_process_may_not_use_is_refused_with_why(process_env):
    executor = manage("executor", "--once", env={**process_env, "RUNDESK_EXECUTOR_CORE": "4095"})
    _, stderr = executor.communicate(timeout=120)
    assert executor.returncode != 0
    assert "RUNDESK_EXECUTOR_CORE=4095: this process may use cores" in stderr


def test_a_setting_that_is_not_a_core_is_refused_at_start_up(process_env):
    done = python("import django; django.setup()", {**process_env, "RUNDESK_EXECUTOR_CORE": "fast"})
    assert done.returncode != 0
    assert "RUNDESK_EXECUTOR_CORE must be auto, off or a core number, got 'fast'" in done.stderr


def test_the_core_fewest_executors_keep_to_is_chosen_the_current_one_first():
    assert least_taken([0, 1], Counter({0: 1}), 0) == 1
    assert least_taken([0, 1], Counter(), 1) == 1
    assert least_taken([0, 1, 2], Counter({1: 1}), 1) == 0
    assert least_taken([2, 3], Counter({2: 2, 3: 2}), None) == 2


def test_executors_are_told_by_their_command_line():
    assert is_executor([b"python", b"manage.py", b"executor", b"--concurrency", b"5", b""])
    assert is_executor([b"/venv/bin/python", b"/srv/rundesk/manage.py", b"executor", b""])
    assert not is_executor([b"python", b"manage.py", b"runserver", b""])
    assert not is_executor([b"python", b"manage.py", b"bench", b"executor", b""])
    assert not is_executor([b"celery", b"-A", b"dashboard", b"worker", b""])


@needs_two_cores
def test_another_executors_core_is_counted_as_taken(tmp_path):
    """A process that looks like an executor, kept to the last core, counts
    against that core (other executors may count too: at least one)."""
    script = tmp_path / "manage.py"
    script.write_text("import time\ntime.sleep(60)\n")
    other = subprocess.Popen([sys.executable, str(script), "executor"])
    try:
        os.sched_setaffinity(other.pid, {CORES[-1]})
        deadline = time.monotonic() + 10
        while _cores_of_other_executors()[CORES[-1]] < 1:
            assert time.monotonic() < deadline, "the other executor's core was never counted"
            time.sleep(0.05)
    finally:
        other.kill()
        other.wait()


@needs_two_cores
def test_a_lock_file_that_cannot_be_opened_does_not_stop_the_choice(monkeypatch, tmp_path):
    monkeypatch.setattr(cores, "LOCK_FILE", tmp_path)  # a folder: cannot be opened for writing
    with cores.kept_to_one_core() as core:
        assert core in CORES
        assert os.sched_getaffinity(0) == {core}
    assert sorted(os.sched_getaffinity(0)) == CORES

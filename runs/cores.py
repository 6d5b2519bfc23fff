"""An executor keeps its threads on one CPU core.

All of an executor's runs share one interpreter lock, so the process runs
Python on one core at a time, however many it may use.  Allowed every core,
its threads hand that lock to each other across cores, and each handover
wakes a thread on the other core: at 1,000 runs in flight whose every tool
takes 1 s, 32 voluntary context switches and 0.4 ms of the kernel's CPU an
action, half of the process's CPU in the scheduler and in futexes (perf).
Kept to one core, 7 switches and 0.18 ms, and the other core is left to
PostgreSQL.

Which core: RUNDESK_EXECUTOR_CORE, a core number, `off`, or `auto` (the
default): of the cores the process may use, the one the fewest other
executors on this machine keep to, and among those the one it runs on now
(where the kernel placed it: the least busy then).  Executors starting at
once choose one at a time (a lock file in the temporary folder, when it can
be opened), so that two of them never take the same core while another is
free.  With one core
allowed (a container's cpuset, `taskset`) there is nothing to choose.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

LOCK_FILE = Path(tempfile.gettempdir()) / "rundesk-executor-cores.lock"


@contextlib.contextmanager
def kept_to_one_core() -> Iterator[int | None]:
    """Keeps this process's threads (those running now, and those they
    start) on one core while the block runs, as RUNDESK_EXECUTOR_CORE says;
    gives the core, or None (off, or one core allowed anyway).  After it,
    the threads may use the cores they could before (a test process that
    ran an executor goes on with its own).  ImproperlyConfigured if the core
    asked for is not one this process may use."""
    wanted = settings.RUNDESK_EXECUTOR_CORE
    allowed = os.sched_getaffinity(0)
    if wanted not in ("auto", "off") and int(wanted) not in allowed:
        raise ImproperlyConfigured(
            f"RUNDESK_EXECUTOR_CORE={wanted}: this process may use cores {sorted(allowed)} only"
        )
    if wanted == "off" or len(allowed) == 1:
        yield None
        return
    if wanted == "auto":
        with _one_at_a_time():
            core = least_taken(allowed, _cores_of_other_executors(), _current_core())
            _pin({core})
    else:
        core = int(wanted)
        _pin({core})
    try:
        yield core
    finally:
        _pin(allowed)


@contextlib.contextmanager
def _one_at_a_time() -> Iterator[None]:
    """Executors choosing a core choose one at a time, on LOCK_FILE; where
    it cannot be opened (another user's, a read-only folder), alone: two
    starting at that moment may then take the same core."""
    try:
        lock = LOCK_FILE.open("a")
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def least_taken(allowed: Iterable[int], taken: Counter[int], current: int | None) -> int:
    """Of the `allowed` cores, one the fewest executors keep to (`taken`):
    `current` if it is one of those, else the lowest."""
    fewest = min(taken[core] for core in allowed)
    candidates = sorted(core for core in allowed if taken[core] == fewest)
    return current if current in candidates else candidates[0]


def _pin(cores: set[int]) -> None:
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.sched_setaffinity(int(thread), cores)


def _current_core() -> int | None:
    try:
        stat = Path("/proc/self/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[36])  # field 39, `processor`


def _cores_of_other_executors() -> Counter[int]:
    """The cores other executor processes on this machine keep to (those
    kept to one), counted."""
    taken: Counter[int] = Counter()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
            if not is_executor(argv):
                continue
            status = Path(entry.path, "status").read_text()
        except OSError:
            continue  # gone, or not ours to read
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                cores = line.split(":", 1)[1].strip()
                if cores.isdigit():
                    taken[int(cores)] += 1
    return taken


def is_executor(argv: list[bytes]) -> bool:
    """Whether a command line is `... manage.py executor ...`."""
    return any(
        arg.endswith(b"manage.py") and argv[i + 1 : i + 2] == [b"executor"]
        for i, arg in enumerate(argv)
    )

"""Garbage collection in a process that drives runs (the executor's, a
Celery worker's).

What start-up loaded (Django, the agents, the app registry) lives as long
as the process: every collection leaves it out (`gc.freeze`), instead of
walking it again and again while runs allocate (about a tenth of a
millisecond a step).

The runs in flight keep what they allocate for as long as they run.  With
CPython's default young generation (700 new objects), a thousand runs in
flight filled it every few steps, and each collection moved their objects
on to the older generations, whose collections then walked all of them:
at 1,000 runs whose every tool takes 1 s, 1.5 s of the executor's 15 s of
CPU, a tenth of every action's.  With a young generation of
YOUNG_OBJECTS, collected a seventieth as often: 0.1 s.  What that costs is
memory: garbage in reference cycles waits for up to YOUNG_OBJECTS new
objects before it is freed.
"""

from __future__ import annotations

import gc

YOUNG_OBJECTS = 50_000


def collect_for_runs() -> None:
    """Sets this process's collections for driving runs: start-up's objects
    left out, a young generation of YOUNG_OBJECTS.  Called once start-up is
    done."""
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_OBJECTS, middle, old)

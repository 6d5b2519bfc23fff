"""Fault plans: faults injected at named points of the real code path.

A run carries its plan in `Run.faults`, a JSON list of faults, each
`{"point": NAME, ...}`.  Drills, the demo and the tests use them; the points
live in the runtime, so what a drill exercises is the code that runs in
production.  "Action K" is the K-th step of the run's sequence (1-based;
steps settled by a receipt on resume count too).  Every fault but
`tool_delay` fires at most once per run: it is recorded in
`Run.faults_fired` in the same statement that decides it fires, so a
resumed run does not meet it again.

- `tool_delay` `{"ms": 300, "action": 2}`: sleeps before the tool of action
  2 (of every action without "action").  Makes runs slow enough to watch.
- `checkpoint_serialize_error` `{"action": K}`: the checkpoint after action
  K does not serialize (a real TypeError from the JSON encoder), so it
  fails before anything is written.
- `drop_connection_at_commit` `{"write": "checkpoint" | "receipt" |
  "publication" | "boundary", "action": K, "outcome": "committed" |
  "aborted" | "late"}`: the first such write at or after action K loses
  its connection while its transaction is in flight, after announcing its
  xid.  A `boundary` is one that carries the previous read's receipt (the
  write it is settled as); a `receipt` is one written alone.  The server side
  then commits (`committed`), is terminated before COMMIT (`aborted`), or
  stays in flight for `stall_ms` (default 10000) and commits later (`late`:
  the writer cannot settle it in time).  The writer gets no answer in all
  three cases.
- `lease_stolen` `{"action": K}`: before action K another owner takes the
  lease (a new epoch, from a second connection).
- `cancel` `{"action": K}`: before action K a cancel request arrives.
- `tool_error` `{"action": K}`: the tool of action K fails (known not to
  have happened) instead of running.
- `delivery_timeout` `{"action": K}`: an effect's tool runs (its receiver
  gets it) but its answer is lost (of the first effect without "action").
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from django.conf import settings
from django.db import connection

from runs import lifecycle
from runs.sql import application_name, socket_fd, this_backend
from runs.timeline import EventKind, timeline

WRITES = ("checkpoint", "receipt", "publication", "boundary")
OUTCOMES = ("committed", "aborted", "late")

# point -> its keys besides "point"
POINTS: dict[str, set[str]] = {
    "tool_delay": {"ms", "action"},
    "checkpoint_serialize_error": {"action"},
    "drop_connection_at_commit": {"write", "action", "outcome", "stall_ms"},
    "lease_stolen": {"action"},
    "cancel": {"action"},
    "tool_error": {"action"},
    "delivery_timeout": {"action"},
}
# The most steps a run can take: its action budget is a PostgreSQL integer.
# A fault's action is one of them.
MAX_STEPS = 2**31 - 1
NEEDS_ACTION = {"checkpoint_serialize_error", "drop_connection_at_commit", "lease_stolen"}
NEEDS_ACTION |= {"cancel", "tool_error"}

# How long the writer's transaction stays in flight after announcing its xid
# while the fault cuts the connection (the `late` outcome takes stall_ms).
CUT_STALL_MS = 300


class FaultPlanError(ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    index: int
    point: str
    action: int | None = None
    ms: int = 0
    write: str = ""
    outcome: str = ""
    stall_ms: int = 10_000

    @property
    def key(self) -> str:
        return f"{self.index}:{self.point}"


@dataclass(frozen=True)
class FaultPlan:
    faults: tuple[Fault, ...] = ()
    run_id: int | None = None

    @classmethod
    def parse(cls, raw: Any, run_id: int | None = None) -> FaultPlan:
        """Validates a plan; the error says what is wrong and where."""
        if raw in (None, ""):
            return cls(run_id=run_id)
        if not isinstance(raw, list):
            raise FaultPlanError("a fault plan is a JSON list of faults")
        return cls(tuple(_parse_fault(i, item) for i, item in enumerate(raw)), run_id)

    @property
    def aims_at_writes(self) -> bool:
        """Whether the plan breaks a receipt's or a checkpoint's write.  Such
        a run writes each receipt on its own at once and saves a checkpoint
        after every action, so the fault meets the very write it names (not
        one a read's receipt rode with, or a checkpoint not due)."""
        return any(
            f.point == "checkpoint_serialize_error"
            or (f.point == "drop_connection_at_commit" and f.write in ("receipt", "checkpoint"))
            for f in self.faults
        )

    def tool_delay(self, step: int) -> float:
        """Seconds to sleep before the tool of the run's `step`-th action."""
        ms = sum(f.ms for f in self.faults if f.point == "tool_delay" and f.action in (None, step))
        return ms / 1000

    def fire(self, point: str, step: int, *, write: str = "") -> Fault | None:
        """The fault planned at this point for this step, if it has not fired
        yet for this run; it is marked fired in the same statement."""
        for fault in self.faults:
            if fault.point != point or (write and fault.write != write):
                continue
            due = (
                fault.action is not None and fault.action <= step
                if point == "drop_connection_at_commit"
                else fault.action in (None, step)
            )
            if due and self._mark_fired(fault):
                timeline.record(
                    self.run_id,
                    EventKind.FAULT_INJECTED,
                    f"{point} at action {step}",
                    fault=fault.key,
                )
                return fault
        return None

    @contextmanager
    def at_commit(self, write: str, step: int) -> Iterator[None]:
        """Around a `write` (checkpoint, receipt, publication): cuts its
        connection in flight if the plan says so."""
        fault = self.fire("drop_connection_at_commit", step, write=write)
        if fault is None:
            yield
            return
        with drop_connection_at_commit(fault, this_backend().pid, socket_fd()):
            yield

    def _mark_fired(self, fault: Fault) -> bool:
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE runs_run SET faults_fired = array_append(faults_fired, %s) "
                "WHERE id = %s AND NOT (%s = ANY (faults_fired))",
                [fault.key, self.run_id, fault.key],
            )
            return cursor.rowcount == 1


def _one_of(value: Any, choices: Collection[str]) -> bool:
    return isinstance(value, str) and value in choices


def _whole(value: Any) -> bool:
    """A JSON integer (JSON's true and false are not numbers here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_fault(i: int, item: Any) -> Fault:
    if not isinstance(item, dict) or not _one_of(item.get("point"), POINTS):
        raise FaultPlanError(f"fault {i}: 'point' must be one of {sorted(POINTS)}")
    point = item["point"]
    unknown = set(item) - POINTS[point] - {"point"}
    if unknown:
        raise FaultPlanError(f"fault {i}: unknown keys {sorted(unknown)}")
    action = item.get("action")
    if point in NEEDS_ACTION and action is None:
        raise FaultPlanError(f"fault {i}: {point} needs 'action'")
    if action is not None and (not _whole(action) or not 1 <= action <= MAX_STEPS):
        raise FaultPlanError(f"fault {i}: 'action' must be an integer from 1 to {MAX_STEPS}")
    for key, top in (("ms", 600_000), ("stall_ms", 600_000)):
        value = item.get(key, 0)
        if not _whole(value) or not 0 <= value <= top:
            raise FaultPlanError(f"fault {i}: '{key}' must be an integer from 0 to {top}")
    fields: dict[str, Any] = {"ms": item.get("ms", 0)}
    if point == "drop_connection_at_commit":
        if not _one_of(item.get("write"), WRITES):
            raise FaultPlanError(f"fault {i}: 'write' must be one of {list(WRITES)}")
        if not _one_of(item.get("outcome", "committed"), OUTCOMES):
            raise FaultPlanError(f"fault {i}: 'outcome' must be one of {list(OUTCOMES)}")
        fields.update(
            write=item["write"],
            outcome=item.get("outcome", "committed"),
            stall_ms=item.get("stall_ms", 10_000),
        )
    return Fault(index=i, point=point, action=action, **fields)


# -- what the faults do -----------------------------------------------------------


@contextmanager
def _side_connection() -> Iterator[psycopg.Connection[Any]]:
    """A second connection, as another process would have.  What goes wrong
    with it (no connection slot left, say) is a database error like any
    other: the run is left to its lease, not failed."""
    params = connection.get_connection_params()
    params["application_name"] = application_name("fault-plan")
    with connection.wrap_database_errors, psycopg.connect(**params, autocommit=True) as side:
        yield side


def steal_lease(run_id: int) -> None:
    """Another owner takes the run: a new epoch, from a second connection."""
    with _side_connection() as side:
        side.execute(
            "UPDATE runs_run SET lease_owner = 'fault-plan:thief', lease_epoch = lease_epoch + 1,"
            " lease_expires_at = now() + make_interval(secs => %s)"
            " WHERE id = %s AND status = 'running'",
            (settings.RUNDESK_LEASE_SECONDS, run_id),
        )


FAULT_PLAN = "the fault plan"


def inject_cancel(run_id: int) -> None:
    """A cancel request arrives, from a second connection, as an operator's
    would (Run.request_cancel is the operator's own)."""
    # The operator's statement (lifecycle.CANCEL), of a running run: it only
    # marks it, and its owner ends it.
    with _side_connection() as side:
        side.execute(
            lifecycle.CANCEL_SQL,
            {
                "run": run_id,
                "by": FAULT_PLAN,
                "why": f"cancelled by {FAULT_PLAN}",
                "sources": ["running"],
            },
        )


@contextmanager
def drop_connection_at_commit(fault: Fault, pid: int, fd: int) -> Iterator[None]:
    """Around one write on this thread's connection (backend `pid`, socket
    `fd`): the write's transaction stays in flight after it announces its
    xid; meanwhile a second connection waits for that moment and cuts the
    writer's connection.  The writer sees a lost connection, no answer.  A
    write that never gets that far (e.g. fenced out) is not cut."""
    stall = fault.stall_ms if fault.outcome == "late" else CUT_STALL_MS
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT set_config('rundesk.stall_after_announce_ms', %s, false)", [str(stall)]
        )
    finished, cut = threading.Event(), threading.Event()
    # Connected before the write starts: on a busy machine a connection
    # can take longer than the stall it has to catch.
    with _side_connection() as side:
        cutter = threading.Thread(
            target=_cut, args=(side, fault.outcome, pid, fd, finished, cut), daemon=True
        )
        cutter.start()
        try:
            yield
        finally:
            finished.set()
            cutter.join()
            if not cut.is_set():
                with connection.cursor() as cursor:
                    cursor.execute("RESET rundesk.stall_after_announce_ms")


def _cut(
    side: psycopg.Connection[Any],
    outcome: str,
    pid: int,
    fd: int,
    finished: threading.Event,
    cut: threading.Event,
) -> None:
    while not finished.is_set():
        waiting = side.execute(
            "SELECT wait_event FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
        if waiting and waiting[0] == "PgSleep":
            break
        finished.wait(0.005)
    else:
        return
    # The client's end goes first: whatever the server does next, the
    # writer hears nothing more.
    with socket.socket(fileno=os.dup(fd)) as writer_end:
        writer_end.shutdown(socket.SHUT_RDWR)
    cut.set()
    if outcome == "aborted":
        side.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))

"""A run's lifecycle: its statuses, the transitions between them, why each
is taken, and the one statement that takes each.

Every change of a run's status is made here, by one conditional UPDATE of
runs_run (its WHERE is the transition's condition: an owner's is fenced by
its lease, OWNER; the sweep's take only runs whose lease expired, skipping
rows others hold), whoever asks: the leases (claim, release, finish), the
sweep, decisions, cancels (the fault plan's too).  The database refuses any
other change of status: a trigger (`trigger_sql`, installed by migration
0017 and generated from TRANSITIONS, the one source) checks OLD.status ->
NEW.status against the table.  It fires only when the status changes, so
a step's fenced writes, which leave the status alone, cost nothing more.
A row inserted with any status (an imported run keeps the one it had where
it ran; benchmarks insert rows) is no transition.

A transition into `queued` hands the run to a Celery worker once its
transaction commits (runs/handover.py), wherever it happens; the sweep's
redelivery is the backstop for a hand-over that was lost.

This module sits below runs/models.py (which takes RunStatus from here) and
so speaks SQL, not querysets.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import models, transaction

from runs.handover import hand_over_run
from runs.sql import fetch_one, server_cursor


class RunStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    NEEDS_OPERATOR = "needs_operator"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL_STATUSES = [RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED]
ACTIVE_STATUSES = [RunStatus.QUEUED, RunStatus.RUNNING]

# What each status means (docs/DESIGN.md's table is checked against it).
MEANING: dict[RunStatus, str] = {
    RunStatus.QUEUED: "waits for a worker to claim it",
    RunStatus.RUNNING: "an owner holds its lease and drives it",
    RunStatus.NEEDS_OPERATOR: "waits for a decision (an item holds it, or the run itself)",
    RunStatus.COMPLETED: "its final answer is published",
    RunStatus.FAILED: "an action failed for good, or an internal error",
    RunStatus.CANCELLED: "a cancel or an abandon ended it",
}


@dataclass(frozen=True)
class Transition:
    name: str
    sources: tuple[RunStatus, ...]
    target: RunStatus
    why: str


CLAIM = Transition(
    "claim",
    (RunStatus.QUEUED,),
    RunStatus.RUNNING,
    "a worker claims it (SKIP LOCKED), with a new epoch; a running run whose lease "
    "expired is claimed the same way and stays running",
)
RELEASE = Transition(
    "release",
    (RunStatus.RUNNING,),
    RunStatus.QUEUED,
    "its owner stops (SIGTERM), or its lease expired before it went on: it gives the run back",
)
REQUEUE = Transition(
    "requeue",
    (RunStatus.RUNNING,),
    RunStatus.QUEUED,
    "its owner stopped renewing the lease: the sweep gives the run back",
)
COMPLETE = Transition(
    "complete", (RunStatus.RUNNING,), RunStatus.COMPLETED, "its owner published the final answer"
)
FAIL = Transition(
    "fail",
    (RunStatus.RUNNING,),
    RunStatus.FAILED,
    "an action failed for good, or an internal error",
)
WAIT = Transition(
    "wait",
    (RunStatus.RUNNING,),
    RunStatus.NEEDS_OPERATOR,
    "its owner met what only an operator can settle",
)
END_CANCELLED = Transition(
    "end_cancelled",
    (RunStatus.RUNNING,),
    RunStatus.CANCELLED,
    "a cancel was asked: its owner carries it out (at its next boundary, instead of "
    "waiting or of giving it back), or the sweep once the owner stopped",
)
CANCEL = Transition(
    "cancel",
    (RunStatus.QUEUED, RunStatus.NEEDS_OPERATOR),
    RunStatus.CANCELLED,
    "an operator's cancel of a run nobody owns: it ends at once",
)
RESUME = Transition(
    "resume",
    (RunStatus.NEEDS_OPERATOR,),
    RunStatus.QUEUED,
    "no open item holds it any more (the last was settled), or an operator resumes it",
)
ABANDON = Transition(
    "abandon",
    (RunStatus.NEEDS_OPERATOR,),
    RunStatus.CANCELLED,
    "an operator abandons it",
)

TRANSITIONS = (
    CLAIM,
    RELEASE,
    REQUEUE,
    COMPLETE,
    FAIL,
    WAIT,
    END_CANCELLED,
    CANCEL,
    RESUME,
    ABANDON,
)
# The changes of status the database allows (OLD.status, NEW.status).
ALLOWED: frozenset[tuple[RunStatus, RunStatus]] = frozenset(
    (source, t.target) for t in TRANSITIONS for source in t.sources
)


def illegal() -> list[tuple[RunStatus, RunStatus]]:
    """Every change of status the lifecycle does not allow."""
    return [
        (source, target)
        for source in RunStatus
        for target in RunStatus
        if source != target and (source, target) not in ALLOWED
    ]


def trigger_sql() -> str:
    """The trigger that refuses any other change of status, generated from
    ALLOWED (CREATE OR REPLACE: a migration that changes the table installs
    it again)."""
    pairs = ", ".join(f"('{source}', '{target}')" for source, target in sorted(ALLOWED))
    return f"""
CREATE OR REPLACE FUNCTION rundesk_run_transition() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF (OLD.status, NEW.status) NOT IN ({pairs}) THEN
        RAISE EXCEPTION 'rundesk: run % cannot go from % to %: no transition of its lifecycle',
            OLD.id, OLD.status, NEW.status
            USING ERRCODE = 'check_violation',
                  HINT = 'the transitions are runs/lifecycle.py''s TRANSITIONS';
    END IF;
    RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS run_lifecycle ON runs_run;
CREATE TRIGGER run_lifecycle BEFORE UPDATE OF status ON runs_run
    FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION rundesk_run_transition();
"""


DROP_TRIGGER_SQL = """
DROP TRIGGER IF EXISTS run_lifecycle ON runs_run;
DROP FUNCTION IF EXISTS rundesk_run_transition();
"""


def markdown_table() -> str:
    """The states and transitions, as docs/DESIGN.md lists them (a test
    keeps the two the same)."""
    lines = ["| status | means |", "|---|---|"]
    lines += [f"| `{status}` | {MEANING[status]} |" for status in RunStatus]
    lines += ["", "| transition | from | to | taken when |", "|---|---|---|---|"]
    lines += [
        f"| {t.name} | {', '.join(f'`{s}`' for s in t.sources)} | `{t.target}` | {t.why} |"
        for t in TRANSITIONS
    ]
    return "\n".join(lines)


# -- the statements --------------------------------------------------------------

# The ownership a lease grants: this owner and epoch, the run still running.
# A claim raises the epoch, so once another owner has the run this matches
# no more.  Parameters: run, owner, epoch.  The status is tested inside a
# CASE so that every plan finds the run by its id, one probe of the primary
# key: a generic plan made while few runs ran (so the statistics said)
# found it among the running ones (run_running_lease_idx,
# run_status_listing_idx), and with a thousand in flight each step of each
# read them all (tests/test_statement_plans.py).
OWNER = """id = %(run)s AND lease_owner = %(owner)s AND lease_epoch = %(epoch)s
    AND CASE WHEN status = 'running' THEN true END"""
# A run waiting to be claimed, and one whose owner stopped renewing its lease.
QUEUED = "status = 'queued'"
EXPIRED = "status = 'running' AND lease_expires_at < statement_timestamp()"
# A run of this installation that may be claimed: queued, or running with
# a lease its owner stopped renewing.  Parameter: lab (RUNDESK_DRILL_LAB:
# a drill's runs are claimed by its lab's processes only, and only those).
CLAIMABLE = f"""imported_at IS NULL AND is_drill = %(lab)s
    AND ({QUEUED} OR {EXPIRED})"""
# Running runs of this installation whose owner stopped renewing its lease.
ABANDONED = f"imported_at IS NULL AND {EXPIRED}"
# A cancelled run's status_reason names who asked.
CANCELLED_BY = "'cancelled by ' || cancel_requested_by"

# Claims lock the run row FOR NO KEY UPDATE, not FOR UPDATE: a row that
# another transaction's foreign-key check holds FOR KEY SHARE (an event or
# an evidence row being written for the run) is not skipped by SKIP LOCKED.
# The rows taken are found by their ids, given as an array: asked as `id IN
# (...)`, a plan made on statistics that counted few runs (taken after
# many were deleted, their pages still there) joined the ids taken with a
# walk of every run, the whole table read at every claim
# (tests/test_statement_plans.py).
_TAKE = """UPDATE runs_run SET status = 'running', lease_owner = %(owner)s,
        lease_epoch = lease_epoch + 1, lease_expires_at = statement_timestamp() + %(ttl)s,
        started_at = coalesce(started_at, statement_timestamp())
    WHERE id = ANY(ARRAY({taken}))
    RETURNING id, lease_epoch"""
CLAIM_ONE_SQL = _TAKE.format(
    taken=f"SELECT id FROM runs_run WHERE id = %(run)s AND {CLAIMABLE}"
    " FOR NO KEY UPDATE SKIP LOCKED"
)
# An executor's loop takes the oldest claimable runs of the agents
# installed in its process (%(agents)s: a run of an agent only other
# processes know waits for them), `most` at most: the oldest queued ones,
# taken from their index in its order until it has them
# (rundesk_oldest_queued(), migration 0030), and the oldest whose lease
# expired (few, unless executors died), merged.  Asked in one condition,
# the planner read every queued run and sorted them at each claim: with a
# backlog of thousands, each claim cost the server more than a step
# (tests/test_statement_plans.py).  The rows a branch locked and the merge
# left are free again at the claim's COMMIT.
CLAIM_NEXT_SQL = f"""WITH queued AS (
        SELECT * FROM rundesk_oldest_queued(%(agents)s::text[], %(lab)s, %(most)s)),
    expired AS (
        SELECT id, created_at FROM runs_run
        WHERE agent = ANY(%(agents)s::text[]) AND {ABANDONED} AND is_drill = %(lab)s
        ORDER BY created_at, id LIMIT %(most)s FOR NO KEY UPDATE SKIP LOCKED)
""" + _TAKE.format(
    taken="SELECT id FROM (SELECT * FROM queued UNION ALL SELECT * FROM expired) AS oldest"
    " ORDER BY created_at, id LIMIT %(most)s"
)
# Added to a claim made on its own (autocommit): its COMMIT does not wait
# for the WAL flush (Lease._claim says why it may).  Set from the
# statement's RETURNING, for the statement's own transaction only: a claim
# that takes no run writes nothing to flush.
ASYNC_COMMIT = ", set_config('synchronous_commit', 'off', true)"

RELEASE_SQL = f"""UPDATE runs_run SET lease_owner = '', lease_expires_at = NULL,
       status = CASE WHEN cancel_requested_at IS NULL THEN 'queued' ELSE 'cancelled' END,
       status_reason = CASE WHEN cancel_requested_at IS NULL THEN status_reason
                            ELSE {CANCELLED_BY} END,
       queued_at = CASE WHEN cancel_requested_at IS NULL THEN now() ELSE queued_at END,
       finished_at = CASE WHEN cancel_requested_at IS NULL THEN NULL ELSE now() END
   WHERE {OWNER}
   RETURNING status, is_drill"""

# The owner's end: completed, failed, cancelled, or needs_operator -- which
# ends as cancelled instead when a cancel was asked (nobody is to decide for
# it any more).  {ctes} is the caller's WITH list, which names a `receipt`
# written with it (runs/leases.py); the end is written only with it.
_FINISH_CANCELLED = (
    "(%(status)s::text = 'cancelled' OR (%(status)s::text = 'needs_operator'"
    " AND cancel_requested_at IS NOT NULL))"
)
FINISH_SQL = f"""WITH {{ctes}}
    UPDATE runs_run SET
       status = CASE WHEN {_FINISH_CANCELLED} THEN 'cancelled' ELSE %(status)s::text END,
       status_reason = CASE WHEN {_FINISH_CANCELLED} THEN {CANCELLED_BY} ELSE %(reason)s END,
       phase = CASE WHEN %(status)s::text = 'completed' THEN 'done' ELSE phase END,
       finished_at = CASE WHEN {_FINISH_CANCELLED}
                          OR %(status)s::text IN ('completed', 'failed')
                     THEN now() END,
       lease_owner = '', lease_expires_at = NULL
    WHERE {OWNER}
      AND (SELECT count(*) FROM receipt) = cardinality(%(receipt_actions)s::bigint[])
    RETURNING status"""
FINISHES = (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.NEEDS_OPERATOR)

# The sweep's: each takes the rows nobody else is changing (SKIP LOCKED), so
# a sweep racing an executor, another sweep or an old owner that wakes up
# changes each run once; the old owner's fenced writes then change nothing.
# The rows taken are found by their ids, as a claim's are (_TAKE).
END_ABANDONED_CANCELS_SQL = f"""UPDATE runs_run SET status = 'cancelled',
        status_reason = {CANCELLED_BY} || '; its owner had stopped',
        lease_owner = '', lease_expires_at = NULL, finished_at = statement_timestamp()
    WHERE id = ANY(ARRAY(SELECT id FROM runs_run
                         WHERE {ABANDONED} AND cancel_requested_at IS NOT NULL
                         FOR NO KEY UPDATE SKIP LOCKED))
    RETURNING id"""
REQUEUE_SQL = f"""UPDATE runs_run SET status = 'queued', status_reason = %(why)s,
        lease_owner = '', lease_expires_at = NULL, queued_at = statement_timestamp()
    WHERE id = ANY(ARRAY(SELECT id FROM runs_run
                         WHERE {ABANDONED} AND cancel_requested_at IS NULL
                         FOR NO KEY UPDATE SKIP LOCKED))
    RETURNING id, is_drill"""
REQUEUE_WHY = "its owner stopped renewing the lease: queued again"

# A run that waits for an operator goes back to the queue when no open item
# holds it (%(holding)s: the kinds that hold, models.HOLDING_KINDS).
RESUME_SQL = """UPDATE runs_run SET status = 'queued', status_reason = %(why)s,
        queued_at = statement_timestamp()
    WHERE id = %(run)s AND imported_at IS NULL AND status = 'needs_operator'
      AND cancel_requested_at IS NULL
      AND NOT EXISTS (SELECT 1 FROM runs_outcomeitem
                      WHERE run_id = runs_run.id AND state = 'open' AND kind = ANY(%(holding)s))
    RETURNING is_drill"""

# A cancel: a run nobody owns (queued, waiting: %(sources)s) ends at once; a
# running one is marked, and its owner (or whoever claims it, or the sweep)
# ends it.  One statement: a run that moves between queued, running and
# waiting while the cancel is asked is cancelled all the same (the CASE sees
# the row as it is when the UPDATE takes it).
CANCEL_SQL = """UPDATE runs_run SET
        status = CASE WHEN status = 'running' THEN status ELSE 'cancelled' END,
        status_reason = CASE WHEN status = 'running' THEN status_reason ELSE %(why)s END,
        finished_at = CASE WHEN status = 'running' THEN NULL ELSE now() END,
        cancel_requested_at = now(), cancel_requested_by = %(by)s
    WHERE id = %(run)s AND cancel_requested_at IS NULL AND status = ANY(%(sources)s)
      AND imported_at IS NULL
    RETURNING status"""


def claim(
    owner: str,
    ttl: dt.timedelta,
    *,
    lab: bool,
    run_id: int | None = None,
    most: int = 1,
    asynchronous: bool = False,
) -> list[tuple[int, int]]:
    """CLAIM: the `most` oldest claimable runs of an installed agent (or
    `run_id`, if claimable, whatever its agent: its driver says why it
    cannot run it), for `owner`: (run id, new epoch) each, oldest first.
    `asynchronous`: its COMMIT does not wait for the WAL flush
    (ASYNC_COMMIT; only for a statement that is its own transaction)."""
    sql = CLAIM_NEXT_SQL if run_id is None else CLAIM_ONE_SQL
    if asynchronous:
        sql += ASYNC_COMMIT
    agents = list(settings.RUNDESK_AGENTS)
    params = {"owner": owner, "ttl": ttl, "lab": lab, "run": run_id, "agents": agents}
    return sorted((row[0], row[1]) for row in _fetch_all(sql, {**params, "most": most}))


def release(fence: Mapping[str, Any]) -> RunStatus | None:
    """RELEASE, or END_CANCELLED when a cancel was asked meanwhile (a queued
    run with a cancel would wait for nothing): the new status, or None when
    this owner (`fence`: run, owner, epoch) no longer held the run."""
    row = fetch_one(RELEASE_SQL, fence)
    if row is None:
        return None
    status, is_drill = RunStatus(row[0]), row[1]
    if status == RunStatus.QUEUED:
        _hand_over_after_commit([(fence["run"], is_drill)])
    return status


def finish(
    fence: Mapping[str, Any], status: RunStatus, reason: str, *, ctes: str, **receipt: Any
) -> RunStatus | None:
    """COMPLETE, FAIL, WAIT or END_CANCELLED, by the owner (`fence`), written
    with the receipt its `ctes` name: the status written, or None when this
    owner no longer held the run (or the receipt was not written)."""
    assert status in FINISHES, status
    row = fetch_one(
        FINISH_SQL.format(ctes=ctes), {**fence, "status": status.value, "reason": reason, **receipt}
    )
    return RunStatus(row[0]) if row else None


def end_abandoned_cancels() -> list[int]:
    """END_CANCELLED, by the sweep: runs whose cancel was asked and whose
    owner died before it could carry it out."""
    return [row[0] for row in _fetch_all(END_ABANDONED_CANCELS_SQL, {})]


def requeue_abandoned() -> list[int]:
    """REQUEUE, by the sweep: runs whose owner stopped renewing its lease,
    resumed from their receipts by whoever claims them next (with a new
    epoch)."""
    rows = _fetch_all(REQUEUE_SQL, {"why": REQUEUE_WHY})
    _hand_over_after_commit(rows)
    return [run_id for run_id, _ in rows]


def resume(run_id: int, why: str, holding: Sequence[str]) -> bool:
    """RESUME: the run waits for an operator and no open item of the kinds
    `holding` holds it.  Called under the run's lock (decisions)."""
    row = fetch_one(RESUME_SQL, {"run": run_id, "why": why, "holding": list(holding)})
    if row is not None:
        _hand_over_after_commit([(run_id, row[0])])
    return row is not None


def cancel(run_id: int, by: str, why: str, sources: Iterable[RunStatus]) -> RunStatus | None:
    """CANCEL (or ABANDON, `sources` the waiting status only), asked by `by`:
    the status after it (running: its owner ends it), or None when the run
    was in none of `sources`, imported, or its cancel already asked."""
    row = fetch_one(
        CANCEL_SQL, {"run": run_id, "by": by, "why": why, "sources": [str(s) for s in sources]}
    )
    return RunStatus(row[0]) if row else None


def _hand_over_after_commit(runs: Iterable[tuple[int, bool]]) -> None:
    """Each of `runs` (id, is_drill), now queued, to a Celery worker once
    this transaction commits (at once in autocommit)."""
    for run_id, is_drill in runs:
        transaction.on_commit(lambda r=run_id, d=is_drill: hand_over_run(r, d))


def _fetch_all(sql: str, params: Mapping[str, Any]) -> list[Any]:
    with server_cursor() as cursor:
        cursor.execute(sql, params, prepare=True)
        return cursor.fetchall()

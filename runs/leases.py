"""Execution ownership of a run, and the protected writes it fences.

A lease is (run, owner, epoch).  Each claim raises the epoch.  Every
protected write below checks the lease in the same SQL statement, with the
run row read FOR SHARE: a concurrent claim (an UPDATE of that row) either
commits first, and the re-checked condition no longer matches, or waits
until the write has committed.  So a stale owner's write changes 0 rows,
and its caller stops: it dispatches nothing more.

Each write is a single autocommit statement, prepared once per connection:
one round trip, no open transaction around slow work.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import os
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import transaction

from runs import lifecycle
from runs.lifecycle import OWNER
from runs.models import (
    ActionState,
    Phase,
    Run,
    RunStatus,
    canonical_json,
    digest,
    new_idempotency_key,
    text_digest,
)
from runs.outcomes import NeedsOperator
from runs.sql import (
    array_literal,
    bounded_lock_waits,
    changes_rows_waits_bounded,
    fetch_one,
    server_cursor,
    unanswered_as,
)

# The ownership a lease grants (lifecycle.OWNER).  Writes that keep or end
# this ownership (renew, release, enter_phase, finish) need no more than
# OWNER: past the lease's expiry, until someone claims the run, this owner is
# still its only one.
# What every write that starts or shapes the run's work requires: the
# ownership, and a lease that has not expired (a run whose lease expired may
# be claimed any moment).  A receipt needs only OWNER (RECEIPT_CTES).
HELD = f"{OWNER} AND lease_expires_at > clock_timestamp()"
# ... and no cancel requested: for the writes that start new work.  A
# receipt is written even after a cancel request: the action did complete,
# and that fact must stay.
HELD_NOT_CANCELLED = f"{HELD} AND cancel_requested_at IS NULL"
# The run row, locked FOR SHARE, as long as the caller holds it.
OWNED = f"SELECT 1 FROM runs_run WHERE {HELD} FOR SHARE"
OWNED_NOT_CANCELLED = f"SELECT 1 FROM runs_run WHERE {HELD_NOT_CANCELLED} FOR SHARE"
# The receipts of actions this owner dispatched (%(receipt_actions)s, with
# their results and digests, in the same order; empty: none), as CTEs to
# put in front of another write of the run, so that all commit together:
# each action's state becomes completed and its receipt copies its identity
# from its row.  `owned` is the run row, locked FOR SHARE, with whether new
# work may start (no cancel asked, `may_start`; the lease not expired,
# `live`).  A receipt needs only the ownership: the action completed, and
# until another owner claims the run (a claim skips the run while this
# statement holds its row, and then sees the receipts) or a sweep ends or
# requeues it, nobody else can have written or decided anything about it.
# The action's state is tested inside a CASE so that no plan finds the
# actions through action_dispatched_idx: that index keeps an entry for each
# version of a row ever dispatched until VACUUM removes it, and a generic
# plan (the statements are prepared; PostgreSQL keeps a plan made without
# the parameters' values once it looks no dearer) that chose it read tens
# of thousands of entries, on a busy database, for the one action it
# updates.  Each receipt finds its action by id, one probe of the primary
# key: the receipts come from rundesk_pending_receipts() (migration 0029),
# which the planner reckons one row whatever their number.  Seen as the ten
# rows of an `unnest()` of unknown length, they made a plan that read every
# action of the run (the run's entries in action_identity_unique) look
# cheaper, on a database whose runs have a few actions each: in a run of
# thousands of steps each step read them all.  And a probe per receipt is
# cheaper than a scan of a table never analysed, however small: no plan
# made while it was small reads the whole table as it grows.  The run is
# read through a sub-select, `(SELECT %(run)s)`, whose value no plan knows:
# a custom plan saw it (a run the statistics know little of) and looked so
# much cheaper than the generic plan that PostgreSQL planned every receipt,
# publication and finish again, where it now keeps one plan per connection
# (tests/test_statement_plans.py).
RECEIPT_CTES = f"""owned AS (
        SELECT cancel_requested_at IS NULL AS may_start,
            lease_expires_at > clock_timestamp() AS live
        FROM runs_run WHERE {OWNER} FOR SHARE),
    pending AS (
        SELECT * FROM rundesk_pending_receipts(%(receipt_actions)s::bigint[],
            %(results)s::jsonb[], %(result_digests)s::text[])),
    completed AS (
        UPDATE runs_action SET state = 'completed', finished_at = now()
        FROM pending
        WHERE runs_action.id = pending.action_id AND run_id = (SELECT %(run)s::bigint)
          AND epoch = %(epoch)s AND CASE WHEN state = 'dispatched' THEN true END
          AND EXISTS (SELECT 1 FROM owned)
        RETURNING id, run_id, step_key, pending.result, pending.result_digest),
    receipt AS (
        INSERT INTO runs_receipt (action_id, run_id, step_key, result, result_digest, epoch,
            xid, created_at)
        SELECT id, run_id, step_key, result, result_digest, %(epoch)s, rundesk_xid(false), now()
        FROM completed
        RETURNING action_id)"""
# Whether every receipt of RECEIPT_CTES was written (all of them, or the
# write that carries them writes nothing).
RECEIPTS_WRITTEN = "(SELECT count(*) FROM receipt) = cardinality(%(receipt_actions)s::bigint[])"
# The active holds that may stop an action of the run %(run)s: a CTE for
# the statements that write or re-arm a boundary, read once in the
# statement's own snapshot, so a hold committed before the statement
# started always stops it (runs/holds.py; the index of
# hold_one_active_per_scope serves it).  Materialised, so that each
# boundary of the statement reads it, not the table: it costs the same
# whatever the number of boundaries, and the statement's generic plan looks
# no dearer than a custom one, so PostgreSQL keeps it instead of planning
# the boundary's statement at every step (tests/test_statement_plans.py).
ACTIVE_HOLDS = """holds AS MATERIALIZED (
        SELECT id, tool FROM runs_hold
        WHERE released_at IS NULL
          AND (agent = '' OR agent = (SELECT agent FROM runs_run WHERE id = %(run)s)))"""
# The hold of ACTIVE_HOLDS that stops an action of the tool {kind} (its
# effect class {effect_class}): its id, or NULL.
HOLDING = """(SELECT min(id) FROM holds
    WHERE tool = {kind} OR tool = '' AND {effect_class} = 'effect')"""
# The hold that stops the action of the row in scope (runs_action), if any.
HOLDING_ACTION = HOLDING.format(kind="kind", effect_class="effect_class")

# Publishing an answer revision: one statement, fenced like the others,
# with the receipts of reads completed before it (RECEIPT_CTES: all commit,
# or nothing; the revision only if every receipt is written).  It reads,
# writes and locks nothing of the evidence tables (the model calls it used
# are named on its own row): no lock anyone holds there can hold an answer
# back.
# It says what it writes first: pg_stat_activity keeps only a statement's
# first kilobyte, and a lock graph tells a publication by its table
# (evidence.locks.STATEMENT_ROLES), which comes after the receipts' CTEs.
PUBLISH = f"""/* runs_answerrevision */ WITH {RECEIPT_CTES},
    published AS (
        INSERT INTO runs_answerrevision (run_id, number, content, content_digest,
            model_call_actions, is_final, epoch, xid, committed_at)
        SELECT %(run)s, %(number)s, %(content)s, %(content_digest)s, %(model_call_actions)s,
            %(is_final)s, %(epoch)s, rundesk_xid(true), now()
        FROM owned
        WHERE may_start AND live AND {RECEIPTS_WRITTEN}
        ON CONFLICT (run_id, number) DO NOTHING
        RETURNING id)
    SELECT (SELECT may_start FROM owned), (SELECT live FROM owned), {RECEIPTS_WRITTEN},
        EXISTS (SELECT 1 FROM published)"""


class WriteRefused(Exception):
    """A protected write changed 0 rows.  The caller dispatches nothing more."""


class LeaseLost(WriteRefused):
    """... because this owner no longer holds the run: another owner took it,
    or the lease expired (it is fenced out)."""


class LeaseExpired(LeaseLost):
    """... because the lease expired: no new work starts, though nobody has
    claimed the run yet.  A receipt written with the refused write stands."""


class CancelRequested(WriteRefused):
    """... because a cancel was asked: the run is still this owner's, to end
    as cancelled."""


class Held(NeedsOperator):
    """Boundaries active holds stopped: the run waits until they are
    released.  `stopped` names each step key held, with its tool and its
    hold's id; `written` the boundaries of the same statement that were
    not held, by step key (reads side by side go on)."""

    def __init__(
        self, stopped: dict[str, tuple[str, int]], written: dict[str, int] | None = None
    ) -> None:
        self.step_key, (self.tool, self.hold_id) = next(iter(stopped.items()))
        super().__init__(f"{self.step_key} ({self.tool}) is held by hold {self.hold_id}")
        self.stopped = stopped
        self.written = written or {}


class RevisionExists(ValueError):
    """An answer revision under this number was published with other
    content (by this run before it resumed)."""


@dataclass(frozen=True)
class PendingReceipt:
    """The result of an action this owner dispatched, for its receipt
    (serialised once, however often it is written or said)."""

    action_id: int
    result: dict[str, Any]
    # `result` in canonical form: given by a caller that has it (the check
    # that a tool's answer is JSON made it), made here otherwise.
    result_json: str = ""

    def __post_init__(self) -> None:
        if not self.result_json:
            object.__setattr__(self, "result_json", canonical_json(self.result))

    @functools.cached_property
    def result_digest(self) -> str:
        return text_digest(self.result_json)


def receipt_params(receipts: Sequence[PendingReceipt]) -> dict[str, Any]:
    """RECEIPT_CTES's parameters for `receipts` (none: an empty list)."""
    return {
        "receipt_actions": array_literal([receipt.action_id for receipt in receipts]),
        "results": array_literal([receipt.result_json for receipt in receipts]),
        "result_digests": array_literal([receipt.result_digest for receipt in receipts]),
    }


@dataclass(frozen=True)
class Boundary:
    """One action to write the boundary of: its step key, its tool, its
    effect class, its input, and the key it is sent under."""

    step_key: str
    kind: str
    effect_class: str
    input: dict[str, Any]
    idempotency_key: str

    @functools.cached_property
    def input_json(self) -> str:
        return canonical_json(self.input)


def new_owner_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def lease_ttl() -> dt.timedelta:
    return dt.timedelta(seconds=settings.RUNDESK_LEASE_SECONDS)


@dataclass(frozen=True)
class Lease:
    run_id: int
    owner: str
    epoch: int

    # -- taking and keeping ownership -------------------------------------

    @classmethod
    def claim_next(cls, owner: str) -> Lease | None:
        """Claims the oldest claimable run, skipping runs other executors are
        claiming at this moment; of a drill's runs only in its lab's
        processes, and only those (RUNDESK_DRILL_LAB)."""
        return next(iter(cls.claim_oldest(owner, 1)), None)

    @classmethod
    def claim_oldest(cls, owner: str, most: int) -> list[Lease]:
        """claim_next for the `most` oldest claimable runs (fewer if fewer
        are), in one statement: an executor given a thousand runs takes
        them in twenty claims, not a thousand."""
        return cls._claim(owner, None, most)

    @classmethod
    def claim(cls, run_id: int, owner: str) -> Lease | None:
        """Claims one run if it is claimable: queued, or its owner's lease
        expired.  A run another owner holds, or a finished run, gives None;
        so does a drill's run outside its lab, and any other inside it."""
        return next(iter(cls._claim(owner, run_id, 1)), None)

    @classmethod
    def _claim(cls, owner: str, run_id: int | None, most: int) -> list[Lease]:
        """lifecycle.CLAIM, one statement.  On its own, its COMMIT does not
        wait for the WAL flush: nothing leaves the database on a claim's
        account before the new owner's first durable write (a boundary, a
        re-dispatch, a publication, a phase change, a renewal, the
        finish), and that COMMIT flushes the claim with it, since WAL is
        flushed in order.  A server crash before then loses the claim and
        nothing else: the run is claimable again (or swept, as an expired
        lease), and the owner's next write is fenced out.  Saves one WAL
        sync per run.  Inside a caller's transaction, which may hold
        facts, the commit stays synchronous."""
        rows = lifecycle.claim(
            owner,
            lease_ttl(),
            lab=settings.RUNDESK_DRILL_LAB,
            run_id=run_id,
            most=most,
            asynchronous=not transaction.get_connection().in_atomic_block,
        )
        return [cls(run_id=claimed, owner=owner, epoch=epoch) for claimed, epoch in rows]

    def renew(self) -> bool:
        """Renews this lease alone (an executor renews all its process holds
        in one statement: runs/renewal.py).  False means it is gone: stop."""
        return self._changes_rows(
            f"UPDATE runs_run SET lease_expires_at = clock_timestamp() + %(ttl)s WHERE {OWNER}",
            ttl=lease_ttl(),
        )

    def release(self) -> RunStatus | None:
        """Gives the run back (clean shutdown): to the queue, where another
        executor resumes it from its receipts at once without waiting for
        expiry; or, if a cancel was asked meanwhile, ends it as cancelled (a
        queued run with a cancel would wait for nothing).  The new status, or
        None when this owner no longer held the run."""
        return lifecycle.release(self._params({}))

    def held(self) -> bool:
        return self._changes_rows(OWNED)

    def cancel_requested(self) -> bool:
        return Run.objects.filter(pk=self.run_id, cancel_requested_at__isnull=False).exists()

    # -- protected writes --------------------------------------------------

    def record_boundaries(
        self, boundaries: Sequence[Boundary], receipts: Sequence[PendingReceipt] = ()
    ) -> dict[str, int]:
        """The durable write before dispatching `boundaries` (one, or reads
        sent side by side), with the receipts of actions completed before
        them (`receipts`), in one statement: all commit, or nothing.
        Returns each new action's id by step key; an identity that already
        exists is left out (the caller looks at it).  A boundary an active
        hold matches is not written (runs/holds.py): Held names them, and
        the boundaries written beside them.  Refused, it says why:
        fenced out (LeaseLost: nothing is written), a cancel
        (CancelRequested) or the lease expired, the run not claimed yet
        (LeaseExpired): in these two the receipts are written, the
        boundaries are not.  With receipts, a lost connection raises
        CommitUnanswered (all or nothing committed)."""
        what = "boundary of " + ", ".join(boundary.step_key for boundary in boundaries)
        with unanswered_as(what) if receipts else contextlib.nullcontext():
            row = self._fetch_one(
                f"""WITH {RECEIPT_CTES}, {ACTIVE_HOLDS},
                    new AS (
                        SELECT given.*, {
                    HOLDING.format(kind="given.kind", effect_class="given.effect_class")
                } AS hold
                        FROM unnest(%(step_keys)s::text[], %(kinds)s::text[],
                            %(effect_classes)s::text[], %(inputs)s::jsonb[],
                            %(input_digests)s::text[], %(keys)s::text[])
                            WITH ORDINALITY AS given (step_key, kind, effect_class, input,
                                input_digest, idempotency_key, position)),
                    boundary AS (
                        INSERT INTO runs_action (run_id, step_key, kind, effect_class, input,
                            input_digest, state, epoch, attempts, idempotency_key, error,
                            created_at, dispatched_at)
                        SELECT %(run)s, new.step_key, new.kind, new.effect_class, new.input,
                            new.input_digest, 'dispatched', %(epoch)s, 1, new.idempotency_key,
                            '', now(), now()
                        FROM owned, new
                        WHERE may_start AND live AND {RECEIPTS_WRITTEN} AND new.hold IS NULL
                        ORDER BY new.position
                        ON CONFLICT (run_id, step_key) DO NOTHING
                        RETURNING id, step_key)
                    SELECT (SELECT may_start FROM owned), (SELECT live FROM owned),
                        {RECEIPTS_WRITTEN},
                        (SELECT array_agg(step_key ORDER BY id) FROM boundary),
                        (SELECT array_agg(id ORDER BY id) FROM boundary),
                        (SELECT array_agg(step_key ORDER BY position) FROM new
                            WHERE hold IS NOT NULL),
                        (SELECT array_agg(hold ORDER BY position) FROM new
                            WHERE hold IS NOT NULL)""",
                step_keys=array_literal([boundary.step_key for boundary in boundaries]),
                kinds=array_literal([boundary.kind for boundary in boundaries]),
                effect_classes=array_literal([boundary.effect_class for boundary in boundaries]),
                inputs=array_literal([boundary.input_json for boundary in boundaries]),
                input_digests=array_literal(
                    [text_digest(boundary.input_json) for boundary in boundaries]
                ),
                keys=array_literal([boundary.idempotency_key for boundary in boundaries]),
                **receipt_params(receipts),
            )
        assert row is not None
        may_start, live, receipts_written, step_keys, action_ids, held_keys, holds = row
        if may_start is None or not receipts_written:
            raise LeaseLost(f"{what} refused")
        if not may_start:
            raise CancelRequested(f"{what} refused: a cancel was asked")
        if not live:
            raise LeaseExpired(f"{what} refused: the lease expired")
        written = dict(zip(step_keys or (), action_ids or (), strict=True))
        if held_keys:
            kinds = {boundary.step_key: boundary.kind for boundary in boundaries}
            stopped = {key: (kinds[key], hold) for key, hold in zip(held_keys, holds, strict=True)}
            raise Held(stopped, written)
        return written

    def record_boundary(
        self,
        *,
        step_key: str,
        kind: str,
        effect_class: str,
        input: dict[str, Any],
        receipts: Sequence[PendingReceipt] = (),
        idempotency_key: str = "",
    ) -> int | None:
        """One boundary (record_boundaries): its action's id, or None when
        the identity already exists."""
        boundary = Boundary(
            step_key, kind, effect_class, input, idempotency_key or new_idempotency_key()
        )
        return self.record_boundaries([boundary], receipts).get(step_key)

    def redispatch_boundary(self, action_id: int) -> None:
        """Re-arms the boundary of an action that has no receipt, under its
        original identity, for this epoch: a `read` still dispatched (its
        owner died before its receipt; a read that failed stays failed), or
        an effect that an operator's decision says to send once more (its
        `failed` state; the database also counts the decisions, migration
        0008).  Not while an active hold matches it: Held."""
        row = self._fetch_one(
            f"""WITH {ACTIVE_HOLDS},
                held AS (
                    SELECT step_key, kind, {HOLDING_ACTION} AS hold
                    FROM runs_action WHERE id = %(action)s),
                armed AS (
                    UPDATE runs_action SET epoch = %(epoch)s, attempts = attempts + 1,
                        state = 'dispatched', dispatched_at = now(), error = ''
                    WHERE id = %(action)s AND run_id = %(run)s
                      AND (effect_class = 'read' AND state = 'dispatched'
                           OR effect_class = 'effect' AND state = 'failed')
                      AND epoch < %(epoch)s
                      AND EXISTS ({OWNED_NOT_CANCELLED})
                      AND NOT EXISTS (SELECT 1 FROM held WHERE hold IS NOT NULL)
                    RETURNING id)
                SELECT (SELECT count(*) FROM armed), step_key, kind, hold FROM held""",
            action=action_id,
        )
        if row is not None and row[0] == 0 and row[3] is not None and self.held():
            _, step_key, kind, hold = row
            raise Held({step_key: (kind, hold)})
        if row is None or row[0] == 0:
            what = f"re-dispatch of action {action_id}"
            raise self._refused(what, f": run {self.run_id} epoch {self.epoch} not held")

    def record_receipts(self, receipts: Sequence[PendingReceipt]) -> None:
        """The facts that the actions completed, with the actions' states,
        in one statement: written while this owner has the run, past its
        lease's expiry too (RECEIPT_CTES).  A lost connection raises
        CommitUnanswered: the caller settles it (runs/outcomes.py)."""
        what = "receipt of action " + ", ".join(str(receipt.action_id) for receipt in receipts)
        with unanswered_as(what):
            row = self._fetch_one(
                f"WITH {RECEIPT_CTES} SELECT {RECEIPTS_WRITTEN}", **receipt_params(receipts)
            )
        if not row or not row[0]:
            raise self._refused(what, f": run {self.run_id} epoch {self.epoch} not held")

    def record_receipt(self, action_id: int, result: dict[str, Any]) -> str:
        """One receipt (record_receipts); returns the result's digest."""
        receipt = PendingReceipt(action_id, result)
        self.record_receipts([receipt])
        return receipt.result_digest

    def record_action_state(self, action_id: int, state: ActionState, error: str) -> None:
        """A dispatched action that did not complete: `failed` (known not to
        have happened) or `unknown` (only evidence can settle it)."""
        self._require(
            f"""UPDATE runs_action SET state = %(state)s, error = %(error)s, finished_at = now()
                WHERE id = %(action)s AND run_id = %(run)s AND state = 'dispatched'
                  AND EXISTS ({OWNED})""",
            f"outcome of action {action_id}",
            action=action_id,
            state=state.value,
            error=error,
        )

    def publish_revision(
        self,
        number: int,
        content: str,
        *,
        is_final: bool,
        model_call_actions: Sequence[int] = (),
        receipts: Sequence[PendingReceipt] = (),
    ) -> bool:
        """Commits an answer revision readers can read back, naming the
        model-call actions it used, with the receipts of actions completed
        before it (`receipts`) in the same statement: all commit, or
        nothing.  Returns False if this revision was already published (a
        resumed run), with the same content; a different content under the
        same number is an error.  Refused, it says why, as record_boundaries
        does (a cancel or an expired lease: the receipts are written, the
        revision is not).  A lost connection raises CommitUnanswered."""
        what = f"publication of revision {number}"
        with unanswered_as(what):
            row = self._fetch_one(
                PUBLISH,
                number=number,
                content=content,
                content_digest=digest(content),
                model_call_actions=list(model_call_actions),
                is_final=is_final,
                **receipt_params(receipts),
            )
        assert row is not None
        may_start, live, receipts_written, published = row
        if may_start is None or not receipts_written:
            raise LeaseLost(f"{what} refused: run {self.run_id} epoch {self.epoch} not held")
        if not may_start:
            raise CancelRequested(f"{what} refused: a cancel was asked")
        if not live:
            raise LeaseExpired(f"{what} refused: the lease expired")
        if published:
            return True
        existing = self._fetch_one(
            "SELECT content_digest FROM runs_answerrevision WHERE run_id = %(run)s"
            " AND number = %(number)s",
            number=number,
        )
        assert existing is not None  # the insert met it: revisions are never deleted
        if existing[0] != digest(content):
            raise RevisionExists(
                f"revision {number} of run {self.run_id} exists with other content"
            )
        return False

    def save_checkpoint(
        self, *, after_action: int, number: int, state: str, state_digest: str
    ) -> None:
        """Saves the agent's state (JSON text) in its own statement: never in
        a receipt's transaction.  A recovery write: it checks the lease but
        does not lock the run row, so a checkpoint whose connection is cut
        while it is in flight cannot hold up the lease renewal or the run's
        other writes.  Nor can a stranger's lock hold the run: a lock not
        granted within RUNDESK_CAPTURE_LOCK_TIMEOUT_MS fails it before it
        writes (55P03).  A lost connection raises CommitUnanswered."""
        with unanswered_as(f"checkpoint {number}"):
            written = changes_rows_waits_bounded(
                f"""INSERT INTO runs_checkpoint (run_id, after_action_id, number, epoch,
                        outcome, state, state_digest, xid, error, resolution, created_at)
                    SELECT %(run)s, %(action)s, %(number)s, %(epoch)s, 'committed',
                        %(state)s::jsonb, %(state_digest)s, rundesk_xid(true), '', '', now()
                    WHERE EXISTS (SELECT 1 FROM runs_run WHERE {HELD})""",
                self._params(
                    {
                        "action": after_action,
                        "number": number,
                        "state": state,
                        "state_digest": state_digest,
                    }
                ),
                bounded_lock_waits()["lock_timeout"],
            )
        if not written:
            raise self._refused(
                f"checkpoint {number}", f": run {self.run_id} epoch {self.epoch} not held"
            )

    def enter_phase(self, phase: Phase, reason: str) -> None:
        self._require(
            f"UPDATE runs_run SET phase = %(phase)s, phase_reason = %(reason)s WHERE {OWNER}",
            f"phase change to {phase}",
            phase=phase.value,
            reason=reason,
        )

    def finish(
        self, status: RunStatus, reason: str = "", *, receipts: Sequence[PendingReceipt] = ()
    ) -> RunStatus:
        """Ends this ownership with the run's new status: completed, failed,
        cancelled (its reason names who asked), or needs_operator (the run
        waits for a person) -- unless a cancel was asked meanwhile: a run
        that would wait ends as cancelled instead, since nobody is to decide
        for it any more.  With `receipt` (the last read's), both are
        written in one statement, or neither: a run never ends with its
        last receipt missing.  Returns the status written.  It locks the run
        row (and the receipt's action) and no item: an owner that ends
        waiting then locks the run, then its item, the one order of every
        decision (runs/decisions.py)."""
        ended = lifecycle.finish(
            self._params({}),
            status,
            reason,
            ctes=RECEIPT_CTES,
            **receipt_params(receipts),
        )
        if ended is None:
            raise LeaseLost(
                f"finish as {status} refused: run {self.run_id} epoch {self.epoch} not held"
            )
        return ended

    # -- plumbing ----------------------------------------------------------

    def _params(self, extra: dict[str, Any]) -> dict[str, Any]:
        return {"run": self.run_id, "owner": self.owner, "epoch": self.epoch, **extra}

    def _changes_rows(self, sql: str, **extra: Any) -> bool:
        with server_cursor() as cursor:
            cursor.execute(sql, self._params(extra), prepare=True)
            return cursor.rowcount > 0

    def _fetch_one(self, sql: str, **extra: Any) -> tuple[Any, ...] | None:
        return fetch_one(sql, self._params(extra))

    def _require(self, sql: str, what: str, **extra: Any) -> None:
        if not self._changes_rows(sql, **extra):
            raise self._refused(what, f": run {self.run_id} epoch {self.epoch} not held")

    def _refused(self, what: str, detail: str = "") -> WriteRefused:
        """Why a write changed 0 rows: a cancel, if the run is still held
        (the write was one that starts new work); the lease expired, if the
        run is still this owner's; else the lease is lost."""
        row = self._fetch_one(
            "SELECT cancel_requested_at IS NOT NULL, lease_expires_at > clock_timestamp()"
            f" FROM runs_run WHERE {OWNER}"
        )
        cancelled, live = row or (False, True)
        if live and cancelled:
            return CancelRequested(f"{what} refused: a cancel was asked")
        if not live:
            return LeaseExpired(f"{what} refused: the lease expired")
        return LeaseLost(f"{what} refused{detail}")

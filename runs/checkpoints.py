"""Checkpoints: the agent's state and the run's progress, saved after an
action the agent completes, when one is due (`Checkpointer.due`).

A checkpoint is recovery, not a fact: it supports continuing and never
overrides a receipt.  Saving one is its own statement, never part of a
receipt's transaction, and its failure is handled by the decision table of
docs/DESIGN.md, row by row:

- it failed before writing, after an action whose receipt verifies under its
  original identity, with the lease held and no cancel request: record the
  failure and go on, in the same phase; the next action still passes its
  own boundary;
- its COMMIT got no answer: record the unknown outcome with its xid and
  settle it by evidence (runs/outcomes.py); what stays unknown goes to an
  operator, and is never written again;
- the receipt is missing or does not verify, the lease is lost, or the run
  is cancelled: no local handling.  NeedsOperator or LeaseLost stops the
  run before anything else is dispatched.

Resuming trusts no content of a checkpoint.  Its row could have been
changed after it was written (a restore, a hand edit, a bad migration), so
the agent rebuilds the state it had from the run's receipts, up to the
action the checkpoint was saved after (its `replay`), and the progress is
rebuilt from the receipts too; the checkpoint is used only if its saved
values are exactly those, and its digest matches them.  Otherwise it is
ignored and the agent rebuilds its state by stepping through the receipts
again: slower, never wrong, nothing executed again.

Nothing here knows an agent: a checkpoint is the run's Progress and the
agent's state (a JSON object), side by side in one object.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from django.conf import settings
from django.db import DatabaseError

from runs.faults import FaultPlan
from runs.leases import CancelRequested, Lease, LeaseLost
from runs.models import Checkpoint, CheckpointOutcome, OutcomeKind, Receipt
from runs.outcomes import NeedsOperator, settle_checkpoint, settle_unanswered
from runs.progress import History, Progress
from runs.sql import CommitUnanswered, bounded_lock_waits, waits_bounded
from runs.timeline import EventKind, timeline

logger = logging.getLogger(__name__)

PROGRESS_FIELDS = ("steps", "taken")


def canonical(raw: Any) -> str:
    """The JSON text a checkpoint's digest is taken of.  The state column is
    jsonb, which keeps values but not text: the same function recomputes
    the text from the loaded value to check the digest."""
    return json.dumps(raw, sort_keys=True, separators=(",", ":"))


class Disagreement(Exception):
    """Why a checkpoint is not used to resume (said in the timeline)."""


@dataclass(frozen=True)
class ResumePoint:
    """A checkpoint that agrees with the receipts: the progress and the
    agent's state to continue from."""

    progress: Progress
    state: dict[str, Any]


# An agent's replay: its state after `step_key`, rebuilt from the history
# (Disagreement if the receipts cannot have led to a checkpoint there).
Replay = Callable[[str, History], dict[str, Any]]


class Checkpointer:
    def __init__(self, lease: Lease, faults: FaultPlan) -> None:
        self.lease = lease
        self.run_id = lease.run_id
        self.faults = faults
        self.saved_at(0)

    # -- saving ------------------------------------------------------------

    def due(self, number: int) -> bool:
        """Whether a checkpoint is due after step `number`: every
        RUNDESK_CHECKPOINT_EVERY steps or RUNDESK_CHECKPOINT_SECONDS,
        whichever comes first.  The receipts are the facts; a checkpoint
        only spares a resumed run recomputing the agent's state, so it need
        not cost a commit per step.  A run whose fault plan aims at a
        checkpoint or a receipt saves one after every action
        (FaultPlan.aims_at_writes)."""
        return (
            self.faults.aims_at_writes
            or number - self._last_number >= settings.RUNDESK_CHECKPOINT_EVERY
            or time.monotonic() - self._last_at >= settings.RUNDESK_CHECKPOINT_SECONDS
        )

    def saved_at(self, number: int) -> None:
        """Counts from here (a save, or the checkpoint a resume starts from)."""
        self._last_number, self._last_at = number, time.monotonic()

    def save(
        self, step_key: str, action_id: int, progress: Progress, state: dict[str, Any]
    ) -> None:
        """Saves `progress` and the agent's `state` after the action
        `step_key` (`action_id`), which this owner has just completed."""
        number = progress.steps
        self.saved_at(number)
        raw: Any = {**state, **asdict(progress)}
        if self.faults.fire("checkpoint_serialize_error", number):
            raw["scratch"] = object()  # the fault: a value JSON cannot encode
        try:
            text = canonical(raw)
        except (TypeError, ValueError) as error:
            self._failed_before_write(
                step_key, action_id, number, f"state does not serialize: {error}"
            )
            return
        try:
            with self.faults.at_commit("checkpoint", number):
                self.lease.save_checkpoint(
                    after_action=action_id,
                    number=number,
                    state=text,
                    state_digest=hashlib.sha256(text.encode()).hexdigest(),
                )
        except CommitUnanswered as unanswered:
            try:
                self._unanswered(step_key, action_id, number, unanswered)
            except DatabaseError as error:
                # Recovery class: the run goes on (if the conditions below
                # hold); the log says what could not be recorded.
                logger.warning(
                    "run %s: checkpoint %s unknown, not recorded: %s", self.run_id, number, error
                )
            self._require_local_conditions(step_key, action_id, f"checkpoint {number} unanswered")
        except DatabaseError as error:
            # The database answered with an error: the statement rolled back.
            self._failed_before_write(step_key, action_id, number, str(error).strip())
        else:
            timeline.record(
                self.run_id,
                EventKind.CHECKPOINT_SAVED,
                f"checkpoint {number} after {step_key}",
                number=number,
            )

    def _failed_before_write(self, step_key: str, action_id: int, number: int, error: str) -> None:
        try:
            self._record(action_id, number, CheckpointOutcome.FAILED_BEFORE_WRITE, error=error)
        except DatabaseError as record_error:
            # The record of a failed recovery write is itself optional.
            logger.warning("run %s: checkpoint failure not recorded: %s", self.run_id, record_error)
        self._require_local_conditions(step_key, action_id, f"checkpoint {number} failed: {error}")
        timeline.record(
            self.run_id,
            EventKind.CHECKPOINT_FAILED,
            f"checkpoint {number} after {step_key} failed before write ({error}); the receipt "
            "verifies, the lease is held, no cancel: handled locally, research goes on",
            number=number,
        )

    def _unanswered(
        self, step_key: str, action_id: int, number: int, unanswered: CommitUnanswered
    ) -> None:
        record = self._record(
            action_id,
            number,
            CheckpointOutcome.UNKNOWN,
            xid=unanswered.xid,
            error=f"COMMIT sent, no answer: {unanswered.error}",
        )
        settlement = settle_unanswered(
            unanswered,
            lambda: Checkpoint.objects.filter(
                run_id=self.run_id, number=number, state__isnull=False
            ).exists(),
            run_id=self.run_id,
            kind=OutcomeKind.CHECKPOINT,
            subject=f"checkpoint:{record.pk}",
            lease_epoch=self.lease.epoch,
            afterwards="the run went on with independent work; this checkpoint is not used "
            "to resume and is not written again",
            checkpoint=record,
        )
        settle_checkpoint(record, settlement)

    def _record(
        self, action_id: int, number: int, outcome: CheckpointOutcome, **fields: Any
    ) -> Checkpoint:
        """A checkpoint that did not save, recorded; a stranger's lock fails
        it (DatabaseError) before it holds the run, as it fails the save."""
        with waits_bounded(bounded_lock_waits()["lock_timeout"]):
            return Checkpoint.objects.create(
                run_id=self.run_id,
                after_action_id=action_id,
                number=number,
                epoch=self.lease.epoch,
                outcome=outcome,
                **fields,
            )

    def _require_local_conditions(self, step_key: str, action_id: int, what: str) -> None:
        """Local handling only after an action whose receipt verifies under
        its original identity, with the lease held and no cancel request."""
        receipt = Receipt.objects.select_related("action").filter(action_id=action_id).first()
        if receipt is None or not receipt.verifies(receipt.action):
            problem = "is missing" if receipt is None else "does not verify"
            raise NeedsOperator(
                f"{what}, and the receipt of {step_key} {problem}: no local handling"
            )
        if self.lease.cancel_requested():
            raise CancelRequested(f"{what}, and the run is cancelled: no local handling")
        if not self.lease.held():
            raise LeaseLost(f"{what}, and the lease is lost: no local handling")

    # -- resuming ----------------------------------------------------------

    def resume_point(self, history: History, replay: Replay) -> ResumePoint | None:
        """The newest committed checkpoint, if it agrees in every value with
        what the receipts say (the agent's `replay` and the history);
        otherwise None, and the agent rebuilds its state from the receipts
        by stepping through them."""
        newest = (
            Checkpoint.objects.filter(run_id=self.run_id, state__isnull=False)
            .order_by("-number")
            .first()
        )
        if newest is None:
            return None
        try:
            point = self._checked(newest, history, replay)
        except Disagreement as disagreement:
            timeline.record(
                self.run_id,
                EventKind.CHECKPOINT_IGNORED,
                f"checkpoint {newest.number} {disagreement}: rebuilt from the receipts instead",
                number=newest.number,
            )
            return None
        timeline.record(
            self.run_id,
            EventKind.CHECKPOINT_USED,
            f"continuing from checkpoint {newest.number} and the receipts after it",
            number=newest.number,
        )
        return point

    def _checked(self, checkpoint: Checkpoint, history: History, replay: Replay) -> ResumePoint:
        """The checkpoint's progress and state, if they are what the
        receipts rebuild; Disagreement naming the first value that differs.
        The receipts are asked first (they are the facts), then the
        checkpoint's own digest."""
        saved = checkpoint.state
        after = history.step_key_of(checkpoint.after_action_id)
        if history.result(after) is None:
            raise Disagreement(
                f"was saved after {after or 'an action of another run'}, which has "
                "no receipt that verifies"
            )
        # Compared as JSON values: what the checkpoint holds once loaded.
        rebuilt = json.loads(canonical({"taken": history.taken_through(after)}))
        state = replay(after, history)
        if not isinstance(state, dict):
            # `return Disagreement` meant as a raise, say.
            raise Disagreement(f"replay gave {type(state).__name__}, not the agent's state")
        try:
            rebuilt.update(json.loads(canonical(state)))
        except (TypeError, ValueError) as error:
            raise Disagreement(f"replay gave a state that is no JSON: {error}") from None
        if not isinstance(saved, dict) or not {*rebuilt, *PROGRESS_FIELDS} <= saved.keys():
            raise Disagreement("holds no agent state")
        for name, value in rebuilt.items():
            if saved[name] != value:
                raise Disagreement(_difference(name, saved[name], value))
        # A step that failed counts too and leaves no receipt, so the count
        # is checked against the row's number and bounded by the receipts.
        steps = saved["steps"]
        if steps != checkpoint.number:
            raise Disagreement(f"counts {steps!r} steps but was saved as step {checkpoint.number}")
        if steps < len(rebuilt["taken"]):
            raise Disagreement(
                f"counts {steps} steps, fewer than its {len(rebuilt['taken'])} with receipts"
            )
        if hashlib.sha256(canonical(saved).encode()).hexdigest() != checkpoint.state_digest:
            raise Disagreement("has a state that does not match its digest")
        state = {name: saved[name] for name in rebuilt if name not in PROGRESS_FIELDS}
        return ResumePoint(Progress(steps, list(rebuilt["taken"])), state)


def _difference(name: str, saved: Any, rebuilt: Any) -> str:
    """Says which saved value differs from the one rebuilt from the
    receipts.  An agent's `receipts` (step key -> result digest: the
    receipts its state was learned from) name the step they contradict."""
    if name == "receipts" and isinstance(saved, dict) and isinstance(rebuilt, dict):
        step_key = next(k for k in sorted({*saved, *rebuilt}) if saved.get(k) != rebuilt.get(k))
        return f"disagrees with the receipt of {step_key}"
    return f"disagrees with the receipts on its {name}"

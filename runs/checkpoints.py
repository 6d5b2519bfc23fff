"""Checkpoints: the agent's state, saved after each action it completes.

A checkpoint is recovery, not a fact: it supports continuing and never
overrides a receipt.  Saving one is its own statement, never part of a
receipt's transaction, and its failure is handled by the decision table of
DESIGN.md, row by row:

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
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from django.db import DatabaseError

from runs.dispatch import Dispatcher
from runs.leases import LeaseLost
from runs.models import Checkpoint, CheckpointOutcome, EventKind, OutcomeKind, Receipt
from runs.outcomes import (
    CommitUnanswered,
    NeedsOperator,
    settle_checkpoint,
    settle_unanswered,
)
from runs.timeline import timeline

logger = logging.getLogger(__name__)


@dataclass
class AgentState:
    """What the research agent needs to continue: where it is, what it has
    learned, and the digests of the receipts that learning came from."""

    position: int = 0
    summaries: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    steps: int = 0
    taken: list[str] = field(default_factory=list)
    receipts: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, raw: dict[str, Any]) -> AgentState:
        return cls(
            position=raw["position"],
            summaries=[(path, text) for path, text in raw["summaries"]],
            notes=list(raw["notes"]),
            steps=raw["steps"],
            taken=list(raw["taken"]),
            receipts=dict(raw["receipts"]),
        )


class Checkpointer:
    def __init__(self, dispatcher: Dispatcher) -> None:
        self.d = dispatcher
        self.lease = dispatcher.lease
        self.run_id = dispatcher.run.pk

    # -- saving ------------------------------------------------------------

    def after(self, step_key: str, state: AgentState) -> None:
        """Saves `state` after the action `step_key`, if this owner has just
        completed it (an action settled by an earlier receipt needs none)."""
        action_id = self.d.completed_now.get(step_key)
        if action_id is None:
            return
        number = self.d.steps
        state.steps, state.taken = number, list(self.d.taken)
        raw: Any = asdict(state)
        if self.d.faults.fire("checkpoint_serialize_error", number):
            raw["scratch"] = object()  # the fault: a value JSON cannot encode
        try:
            text = json.dumps(raw, sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError) as error:
            self._failed_before_write(
                step_key, action_id, number, f"state does not serialize: {error}"
            )
            return
        try:
            with self.d.faults.at_commit("checkpoint", number):
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
            raise LeaseLost(f"{what}, and the run is cancelled: no local handling")
        if not self.lease.held():
            raise LeaseLost(f"{what}, and the lease is lost: no local handling")

    # -- resuming ----------------------------------------------------------

    def resume_state(self) -> AgentState | None:
        """The newest committed checkpoint's state, if the receipts agree
        with it (the receipts are the facts); otherwise None, and the agent
        rebuilds its state from the receipts."""
        newest = (
            Checkpoint.objects.filter(run_id=self.run_id, state__isnull=False)
            .order_by("-number")
            .first()
        )
        if newest is None:
            return None
        state = AgentState.load(newest.state)
        for step_key in [*state.taken, *state.receipts]:
            action = self.d.known.get(step_key)
            receipt = getattr(action, "receipt", None)
            if (
                receipt is None
                or not receipt.verifies(action)
                or state.receipts.get(step_key, receipt.result_digest) != receipt.result_digest
            ):
                timeline.record(
                    self.run_id,
                    EventKind.CHECKPOINT_IGNORED,
                    f"checkpoint {newest.number} disagrees with the receipt of {step_key}: "
                    "rebuilt from the receipts instead",
                )
                return None
        timeline.record(
            self.run_id,
            EventKind.CHECKPOINT_USED,
            f"continuing from checkpoint {newest.number} and the receipts after it",
            number=newest.number,
        )
        return state

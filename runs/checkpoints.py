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

Resuming trusts no content of a checkpoint.  Its row could have been
changed after it was written (a restore, a hand edit, a bad migration), so
the state a resumed agent gets is rebuilt from the run's documents and
receipts, up to the action the checkpoint was saved after; the checkpoint
is used only if its saved state is exactly that, and its digest matches
it.  Otherwise it is ignored and the agent rebuilds its state by stepping
through the receipts again: slower, never wrong, nothing executed again.
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
from runs.models import ActionState, Checkpoint, CheckpointOutcome, OutcomeKind, Phase, Receipt
from runs.outcomes import (
    CommitUnanswered,
    NeedsOperator,
    settle_checkpoint,
    settle_unanswered,
)
from runs.timeline import EventKind, timeline

logger = logging.getLogger(__name__)


def canonical(raw: Any) -> str:
    """The JSON text a checkpoint's digest is taken of.  The state column is
    jsonb, which keeps values but not text: the same function recomputes
    the text from the loaded value to check the digest."""
    return json.dumps(raw, sort_keys=True, separators=(",", ":"))


class Disagreement(Exception):
    """Why a checkpoint is not used to resume (said in the timeline)."""


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
            text = canonical(raw)
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
        """The state to continue from: the newest committed checkpoint's,
        rebuilt from the receipts, if the checkpoint agrees with it in every
        value; otherwise None, and the agent rebuilds its state from the
        receipts by stepping through them."""
        newest = (
            Checkpoint.objects.filter(run_id=self.run_id, state__isnull=False)
            .order_by("-number")
            .first()
        )
        if newest is None:
            return None
        try:
            state = self._rebuilt(newest)
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
        return state

    def _rebuilt(self, checkpoint: Checkpoint) -> AgentState:
        """The state the agent had when it saved `checkpoint`, rebuilt from
        the run's documents and receipts; Disagreement if the saved state
        differs in any value.  The receipts are asked first (they are the
        facts), then the checkpoint's own digest."""
        try:
            saved = AgentState.load(checkpoint.state)
        except (KeyError, TypeError, ValueError) as error:
            raise Disagreement(f"holds no agent state ({error!r})") from None
        after = next(
            (
                key
                for key, action in self.d.known.items()
                if action.pk == checkpoint.after_action_id
            ),
            "",
        )
        if self._result(after) is None:
            raise Disagreement(
                f"was saved after {after or 'an action of another run'}, which has "
                "no receipt that verifies"
            )
        rebuilt = AgentState(position=self._position_after(after))
        for index, path in enumerate(self.d.run.documents[: rebuilt.position]):
            self._replay(index, path, rebuilt)
        if after in (f"read:{rebuilt.position}", "compose"):
            rebuilt.taken.append(after)
        for name in ("taken", "receipts", "summaries", "position", "notes"):
            if getattr(saved, name) != getattr(rebuilt, name):
                raise Disagreement(_difference(name, getattr(saved, name), getattr(rebuilt, name)))
        # A step that failed counts too and leaves no receipt, so the count
        # is checked against the row's number and bounded by the receipts.
        if saved.steps != checkpoint.number:
            raise Disagreement(
                f"counts {saved.steps!r} steps but was saved as step {checkpoint.number}"
            )
        if saved.steps < len(rebuilt.taken):
            raise Disagreement(
                f"counts {saved.steps} steps, fewer than its {len(rebuilt.taken)} with receipts"
            )
        rebuilt.steps = saved.steps
        if hashlib.sha256(canonical(checkpoint.state).encode()).hexdigest() != (
            checkpoint.state_digest
        ):
            raise Disagreement("has a state that does not match its digest")
        return rebuilt

    def _position_after(self, step_key: str) -> int:
        """The document the agent was at when it saved a checkpoint after
        `step_key` (ResearchAgent: after a read it is at that document,
        after its summary at the next one, after composing past the last)."""
        total = len(self.d.run.documents)
        if step_key == "compose":
            return total
        kind, _, index = step_key.partition(":")
        if kind in ("read", "summarize") and index.isdigit() and int(index) < total:
            return int(index) + (kind == "summarize")
        raise Disagreement(f"was saved after {step_key}, which the agent does not save after")

    def _replay(self, index: int, path: str, state: AgentState) -> None:
        """What ResearchAgent._research kept of document `index`, from its
        receipts: a summary (and its receipt's digest), or a note saying why
        there is none.  The notes' wording is the agent's."""
        read_key, summary_key = f"read:{index}", f"summarize:{index}"
        read = self._result(read_key)
        if read is None:
            state.notes.append(self._not_done(path, read_key))
            return
        state.taken.append(read_key)
        if "refused" in read:
            state.notes.append(f"{path}: {read['refused']}")
            return
        summary = self._result(summary_key)
        if summary is None:
            state.notes.append(self._not_done(path, summary_key))
            return
        if not isinstance(summary, dict) or not isinstance(summary.get("text"), str):
            raise Disagreement(f"counts on {summary_key}, whose receipt holds no summary")
        state.taken.append(summary_key)
        state.summaries.append((path, summary["text"]))
        state.receipts[summary_key] = self.d.known[summary_key].receipt.result_digest

    def _not_done(self, path: str, step_key: str) -> str:
        """The note of an action before the checkpoint that has no receipt:
        it failed, or (a read) was never dispatched because research ended."""
        action = self.d.known.get(step_key)
        if action is not None and action.state == ActionState.FAILED:
            return f"{path}: not included ({step_key} failed: {action.error})"
        if action is None and step_key.startswith("read:") and self.d.run.phase != Phase.RESEARCH:
            return f"{path}: not read ({self.d.run.phase_reason})"
        raise Disagreement(f"is past {step_key}, which neither completed nor failed")

    def _result(self, step_key: str) -> dict[str, Any] | None:
        """The result of `step_key`'s receipt, if it has one that verifies."""
        action = self.d.known.get(step_key)
        receipt = getattr(action, "receipt", None)
        if receipt is None or not receipt.verifies(action):
            return None
        return receipt.result


def _difference(name: str, saved: Any, rebuilt: Any) -> str:
    """Says which saved value differs from the one rebuilt from the
    receipts, naming the step whose receipt it contradicts where it can."""
    if name == "receipts":
        step_key = next(k for k in sorted({*saved, *rebuilt}) if saved.get(k) != rebuilt.get(k))
        return f"disagrees with the receipt of {step_key}"
    return f"disagrees with the receipts on its {name}"

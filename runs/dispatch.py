"""One step of a run: boundary, dispatch, receipt -- or no dispatch at all.

`Dispatcher.step()` is where "resume without replay" is decided, for every
action of every agent:

- an action with a receipt is never dispatched again: its receipt is the result;
- an action with a boundary but no receipt is dispatched again only if it is
  a `read`, under its original identity;
- an `effect` action in that state may have happened: it is marked `unknown`
  and the run waits for an operator;
- a new action is dispatched only after its boundary is durable.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from runs.faults import FaultPlan
from runs.leases import Lease, LeaseLost
from runs.models import Action, ActionState, EffectClass, EventKind, Run, action_identity, digest
from runs.timeline import timeline
from runs.tools import TOOLS, OutcomeUnknown, Tool, ToolFailed, ToolRefused


class Stopping(Exception):
    """The executor is shutting down: give the run back, dispatch nothing."""


class NeedsOperator(Exception):
    """The runtime cannot settle this itself: the run waits for a person."""


class ActionFailed(Exception):
    """An action is known not to have completed, and the run cannot go on."""


class Dispatcher:
    def __init__(self, lease: Lease, *, stop: threading.Event, lease_lost: threading.Event):
        self.lease = lease
        self.stop = stop
        self.lease_lost = lease_lost
        self.run = Run.objects.get(pk=lease.run_id)
        self.faults = FaultPlan.parse(self.run.faults)
        # What earlier owners left: every action of the run, with its receipt.
        self.known: dict[str, Action] = {
            a.step_key: a for a in Action.objects.filter(run=self.run).select_related("receipt")
        }
        # Actions completed by this owner.
        self.completed_now: set[str] = set()
        # Steps taken in this run's sequence, whether dispatched now or settled
        # by a receipt: a resumed run counts exactly as the first owner did.
        self.steps = 0

    def completed(self, step_key: str) -> bool:
        if step_key in self.completed_now:
            return True
        action = self.known.get(step_key)
        return action is not None and action.state == ActionState.COMPLETED

    def step(self, step_key: str, tool_name: str, input: dict[str, Any]) -> dict[str, Any]:
        if step_key in self.completed_now:
            raise NeedsOperator(f"the agent used identity {step_key} twice")
        tool = TOOLS[tool_name]
        self.steps += 1
        action = self.known.get(step_key)
        if action is None:
            action_id = self._new_boundary(step_key, tool, input)
        else:
            result = self._settled_result(action, tool, input)
            if result is not None:
                return result
            self._redispatch(action)
            action_id = action.pk
        return self._execute(action_id, step_key, tool, input)

    def _check_can_dispatch(self) -> None:
        if self.stop.is_set():
            raise Stopping()
        if self.lease_lost.is_set():
            raise LeaseLost(f"run {self.lease.run_id}: heartbeat found the lease gone")

    def _new_boundary(self, step_key: str, tool: Tool, input: dict[str, Any]) -> int:
        self._check_can_dispatch()
        action_id = self.lease.record_boundary(
            step_key=step_key,
            kind=tool.name,
            effect_class=tool.effect_class,
            input=input,
        )
        if action_id is None:
            raise NeedsOperator(
                f"identity {step_key} exists but was not loaded: another owner wrote it"
            )
        timeline.record(
            self.run.pk,
            EventKind.ACTION_DISPATCHED,
            f"{tool.name} {step_key}",
            action_id=action_id,
            epoch=self.lease.epoch,
        )
        return action_id

    def _settled_result(
        self, action: Action, tool: Tool, input: dict[str, Any]
    ) -> dict[str, Any] | None:
        """The result of an action that must not be dispatched again, or None
        when it may be dispatched again (a `read` without receipt)."""
        if action.kind != tool.name or action.input_digest != digest(input):
            raise NeedsOperator(
                f"identity {action.step_key} was used for other work (tool or input differs)"
            )
        receipt = getattr(action, "receipt", None)
        if receipt is not None:
            if not receipt.verifies(action):
                raise NeedsOperator(f"the receipt of {action.step_key} does not verify")
            timeline.record(
                self.run.pk,
                EventKind.ACTION_REUSED,
                f"{action.step_key}: receipt found, not dispatched again",
                action_id=action.pk,
            )
            return receipt.result
        if action.state == ActionState.COMPLETED:
            raise NeedsOperator(f"{action.step_key} is completed but its receipt is missing")
        if action.state == ActionState.UNKNOWN:
            raise NeedsOperator(f"the outcome of {action.step_key} is unknown")
        if action.effect_class == EffectClass.EFFECT and action.state == ActionState.FAILED:
            raise NeedsOperator(
                f"{action.step_key} is known not to have happened ({action.error}); sending it "
                "again is an operator's decision"
            )
        if action.effect_class == EffectClass.EFFECT:
            reason = (
                f"{action.step_key} was dispatched under epoch {action.epoch} and has no "
                "receipt: the effect may have happened; only its receiver knows"
            )
            self._mark(action.pk, ActionState.UNKNOWN, reason, EventKind.ACTION_UNKNOWN)
            raise NeedsOperator(reason)
        return None

    def _redispatch(self, action: Action) -> None:
        self._check_can_dispatch()
        self.lease.redispatch_boundary(action.pk)
        action.attempts += 1
        timeline.record(
            self.run.pk,
            EventKind.ACTION_REDISPATCHED,
            f"{action.step_key}: a read with no receipt, dispatched again (attempt "
            f"{action.attempts})",
            action_id=action.pk,
            epoch=self.lease.epoch,
        )

    def _execute(
        self, action_id: int, step_key: str, tool: Tool, input: dict[str, Any]
    ) -> dict[str, Any]:
        if delay := self.faults.tool_delay(self.steps):
            time.sleep(delay)
        try:
            result = tool.run(input, action_identity(self.run.pk, step_key))
        except ToolRefused as refusal:
            result = {"refused": str(refusal)}
        except OutcomeUnknown as error:
            self._mark(action_id, ActionState.UNKNOWN, str(error), EventKind.ACTION_UNKNOWN)
            raise NeedsOperator(f"the outcome of {step_key} is unknown: {error}") from error
        except ToolFailed as error:
            self._mark(action_id, ActionState.FAILED, str(error), EventKind.ACTION_FAILED)
            raise ActionFailed(f"{step_key} failed: {error}") from error
        result_digest = self.lease.record_receipt(action_id, result)
        self.completed_now.add(step_key)
        timeline.record(
            self.run.pk,
            EventKind.ACTION_COMPLETED,
            step_key + (f" refused: {result['refused']}" if "refused" in result else ""),
            action_id=action_id,
            result_digest=result_digest,
        )
        return result

    def _mark(self, action_id: int, state: ActionState, reason: str, kind: EventKind) -> None:
        self.lease.record_action_outcome(action_id, state, reason)
        timeline.record(self.run.pk, kind, reason, action_id=action_id)

"""How far a run has got: what its earlier owners left (`History`) and how
far its sequence has got (`Progress`).  The Dispatcher keeps both; a
checkpoint saves the progress and is checked against the history; an agent
rebuilds its own state from the history (runs/checkpoints.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from runs.models import Action, ActionState, Run


@dataclass
class Progress:
    """The steps taken (dispatched now or settled by a receipt; a step that
    failed counts too), and the keys of those whose results the run has, in
    order.  Counted the same by every owner."""

    steps: int = 0
    taken: list[str] = field(default_factory=list)


class History:
    """Every action earlier owners of a run left, by step key, with its
    receipt: read once when an owner takes the run, never written."""

    def __init__(self, actions: list[Action]) -> None:
        # In the order the run first dispatched them: its sequence.
        self._actions = {action.step_key: action for action in sorted(actions, key=_pk)}

    @classmethod
    def of(cls, run: Run) -> History:
        return cls(list(Action.objects.filter(run=run).select_related("receipt")))

    def __len__(self) -> int:
        return len(self._actions)

    def __iter__(self) -> Iterator[Action]:
        return iter(self._actions.values())

    def get(self, step_key: str) -> Action | None:
        return self._actions.get(step_key)

    def action(self, step_key: str) -> Action:
        return self._actions[step_key]

    def completed(self, step_key: str) -> bool:
        action = self._actions.get(step_key)
        return action is not None and action.state == ActionState.COMPLETED

    def result(self, step_key: str) -> dict[str, Any] | None:
        """The result of `step_key`'s receipt, if it has one that verifies."""
        action = self._actions.get(step_key)
        receipt = getattr(action, "receipt", None)
        if receipt is None or not receipt.verifies(action):
            return None
        return receipt.result

    def result_digest(self, step_key: str) -> str:
        return self._actions[step_key].receipt.result_digest

    def failure(self, step_key: str) -> str | None:
        """The error of an action known not to have completed, if it failed."""
        action = self._actions.get(step_key)
        return action.error if action is not None and action.state == ActionState.FAILED else None

    def step_key_of(self, action_id: int) -> str:
        """The step key of one of these actions ("" if none has that id)."""
        return next((a.step_key for a in self if a.pk == action_id), "")

    def taken_through(self, step_key: str) -> list[str]:
        """The steps with results, in sequence order, up to `step_key`."""
        taken = []
        for action in self:
            if self.result(action.step_key) is not None:
                taken.append(action.step_key)
            if action.step_key == step_key:
                break
        return taken


def _pk(action: Action) -> int:
    return action.pk

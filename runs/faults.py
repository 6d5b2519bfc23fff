"""Fault plans: faults injected at named points of the real code path.

A run carries its plan in `Run.faults`, a JSON list of faults, each
`{"point": NAME, ...}`.  Drills, the demo and the tests use them; the points
live in the runtime, so what a drill exercises is the code that runs in
production.  Points:

- `tool_delay`: `{"point": "tool_delay", "ms": 300, "action": 2}` sleeps
  before the tool of the run's 2nd dispatch (every dispatch without
  "action").  Makes runs slow enough to watch, or to kill mid-way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

POINTS: dict[str, set[str]] = {"tool_delay": {"ms", "action"}}


class FaultPlanError(ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    point: str
    action: int | None
    ms: int


@dataclass(frozen=True)
class FaultPlan:
    faults: tuple[Fault, ...] = ()

    @classmethod
    def parse(cls, raw: Any) -> FaultPlan:
        """Validates a plan; the error says what is wrong and where."""
        if raw in (None, ""):
            return cls()
        if not isinstance(raw, list):
            raise FaultPlanError("a fault plan is a JSON list of faults")
        faults = []
        for i, item in enumerate(raw):
            if not isinstance(item, dict) or item.get("point") not in POINTS:
                raise FaultPlanError(f"fault {i}: 'point' must be one of {sorted(POINTS)}")
            unknown = set(item) - POINTS[item["point"]] - {"point"}
            if unknown:
                raise FaultPlanError(f"fault {i}: unknown keys {sorted(unknown)}")
            action, ms = item.get("action"), item.get("ms", 0)
            if action is not None and (not isinstance(action, int) or action < 1):
                raise FaultPlanError(f"fault {i}: 'action' must be a positive integer")
            if not isinstance(ms, int) or not 0 <= ms <= 600_000:
                raise FaultPlanError(f"fault {i}: 'ms' must be an integer from 0 to 600000")
            faults.append(Fault(point=item["point"], action=action, ms=ms))
        return cls(tuple(faults))

    def tool_delay(self, dispatch: int) -> float:
        """Seconds to sleep before the tool of the run's `dispatch`-th dispatch."""
        return (
            sum(
                f.ms
                for f in self.faults
                if f.point == "tool_delay" and f.action in (None, dispatch)
            )
            / 1000
        )

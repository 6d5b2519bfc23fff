"""An agent the approval tests install (settings.RUNDESK_AGENTS, or the
environment of a real process), on the public agent API alone: it asks
for approval per call (RunContext.step's needs_approval), of a tool that
declares a short approval time, so that expiry is seen within a test."""

from __future__ import annotations

import contextlib
import datetime as dt
from typing import Any, ClassVar

from runs.agent import EFFECT, READ, Agent, Step, Tool, ToolCall
from runs.agents.tools import journal

PATH = "tests.approval_agents:NoticeAgent"
BESIDE = "tests.approval_agents:BesideAgent"
CARELESS = "tests.approval_agents:CarelessAgent"
# The time a notice waits for its approval.
WAITS = dt.timedelta(seconds=1)


def notify(input: dict[str, Any], call: ToolCall) -> dict[str, Any]:
    journal("notify", call.identity, key=call.idempotency_key)
    return {"notified": input["to"]}


class NoticeAgent(Agent):
    """Sends one notice, approved per call, then publishes what happened."""

    name = "notice"
    version = "1"
    input_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "required": ["to", "text"],
        "properties": {"to": {"type": "string"}, "text": {"type": "string"}},
    }
    tools = (
        Tool(
            "notify",
            EFFECT,
            notify,
            input_schema={
                "type": "object",
                "required": ["to", "text"],
                "properties": {
                    "to": {"type": "string", "minLength": 1},
                    "text": {"type": "string"},
                },
            },
            approval_timeout=WAITS,
        ),
    )

    def run(self) -> None:
        sent = self.ctx.step("notice", "notify", dict(self.input), needs_approval=True)
        said = (
            f"not sent: {sent['refused']}" if "refused" in sent else f"sent to {sent['notified']}"
        )
        self.ctx.publish(said, revision=1, final=True)


def look(input: dict[str, Any], call: ToolCall) -> dict[str, Any]:
    journal("look", call.identity)
    return {"seen": input["what"]}


class BesideAgent(Agent):
    """Asks for a read that needs approval side by side: refused, since
    reads side by side are dispatched at once."""

    name = "beside"
    version = "1"
    tools = (Tool("look", READ, look, needs_approval=True),)

    def run(self) -> None:
        self.ctx.side_by_side([Step("look", "look", {"what": "x"})])


class CarelessAgent(NoticeAgent):
    """Catches Exception around the notice that waits for its approval, as
    careless code does, then (`go_on`) sends another, or just returns."""

    name = "careless"
    input_schema: ClassVar[dict[str, Any]] = {"type": "object"}

    def run(self) -> None:
        with contextlib.suppress(Exception):
            self.ctx.step("notice", "notify", {"to": "ops", "text": "x"}, needs_approval=True)
        if self.input.get("go_on"):
            self.ctx.step("another", "notify", {"to": "all", "text": "y"})

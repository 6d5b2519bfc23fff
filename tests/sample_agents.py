"""Agents the tests install (settings.RUNDESK_AGENTS, or the environment of
a real process), written on the public agent API only, as a user would."""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar

from runs.agent import EFFECT, READ, ActionFailed, Agent, Step, Tool, ToolCall, ToolRefused
from runs.agents.tools import journal

# How long each read sleeps, in seconds (the environment of a real process).
DELAY = "SAMPLE_READ_SECONDS"


def slow_read(input: dict[str, Any], call: ToolCall) -> dict[str, Any]:
    """A read that waits, then answers its name; "missing" is refused."""
    time.sleep(float(input.get("seconds", os.environ.get(DELAY, "0"))))
    if input["name"] == "missing":
        raise ToolRefused("no such page")
    journal("slow_read", call.identity)
    return {"name": input["name"], "text": f"page {input['name']}"}


class PagesAgent(Agent):
    """Reads its pages side by side, then publishes what it read."""

    name = "pages"
    version = "1"
    input_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "required": ["pages"],
        "properties": {"pages": {"type": "array", "items": {"type": "string"}, "minItems": 1}},
    }
    tools = (
        Tool(
            "slow_read",
            READ,
            slow_read,
            timeout=1,
            input_schema={
                "type": "object",
                "required": ["name"],
                "properties": {"name": {"type": "string"}, "seconds": {"type": "number"}},
            },
        ),
    )

    def run(self) -> None:
        pages = self.input["pages"]
        results = self.ctx.side_by_side(
            [Step(f"read:{page}", "slow_read", {"name": page}) for page in pages]
        )
        lines, used = [], []
        for page, result in zip(pages, results, strict=True):
            if isinstance(result, ActionFailed):
                lines.append(f"{page}: not read ({result.error})")
            elif "refused" in result:
                lines.append(f"{page}: {result['refused']}")
            else:
                lines.append(f"{page}: {result['text']}")
                used.append(f"read:{page}")
        self.ctx.publish("\n".join(lines), revision=1, final=True, used=used)


class TwoFinalsAgent(Agent):
    """Publishes a final answer, then another: a mistake, the run's own."""

    name = "two-finals"
    version = "1"
    tools = ()

    def run(self) -> None:
        self.ctx.publish("first", revision=1, final=True)
        self.ctx.publish("second", revision=2, final=True)


def post(input: dict[str, Any], call: ToolCall) -> dict[str, Any]:
    journal("post", call.identity, key=call.idempotency_key)
    return {"posted": True}


class BrokenAfterCrashAgent(Agent):
    """Fails before it steps its effect: a bug met by the owner that takes
    the run over from one that died with the effect sent."""

    name = "broken-after-crash"
    version = "1"
    tools = (Tool("post", EFFECT, post, accepts_idempotency_key=True),)

    def run(self) -> None:
        raise RuntimeError("a bug met before the post")

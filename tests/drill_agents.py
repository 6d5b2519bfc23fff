"""An agent the drill tests install, written on the public agent API only,
as a user would: it reads its notes side by side, files one reply (an
effect: a file written once per idempotency key in the folder DRILL_FOLDER
names, so a real process finds it too) and publishes what it filed.  It
saves no checkpoints and makes no model call."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, ClassVar

from runs.agent import EFFECT, READ, ActionFailed, Agent, Step, Tool, ToolCall, ToolFailed
from runs.agents.tools import journal

# Where replies are filed (the environment: a drill's processes inherit it).
FOLDER = "DRILL_FOLDER"


def read_note(input: dict[str, Any], call: ToolCall) -> dict[str, Any]:
    journal("read_note", call.identity, note=input["note"])
    return {"note": input["note"], "text": f"note {input['note']}"}


def file_reply(input: dict[str, Any], call: ToolCall) -> dict[str, Any]:
    """Files the reply under the action's idempotency key: sent again under
    it, it finds the file there and files nothing more."""
    if not os.environ.get(FOLDER):
        raise ToolFailed(f"{FOLDER} names no folder to file replies in")
    folder = Path(os.environ[FOLDER])
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{hashlib.sha256(call.idempotency_key.encode()).hexdigest()}.txt"
    try:
        with target.open("x") as handle:
            handle.write(input["text"])
    except FileExistsError:
        return {"filed": target.name, "already_filed": True}
    journal("file_reply", call.identity, file=target.name)
    return {"filed": target.name}


class FilingAgent(Agent):
    """Reads its notes side by side, files a reply, publishes it."""

    name = "filing"
    version = "1"
    input_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "required": ["notes"],
        "properties": {"notes": {"type": "array", "items": {"type": "string"}, "minItems": 1}},
    }
    tools = (
        Tool(
            "read_note",
            READ,
            read_note,
            timeout=5,
            input_schema={
                "type": "object",
                "required": ["note"],
                "properties": {"note": {"type": "string"}},
            },
        ),
        Tool(
            "file_reply",
            EFFECT,
            file_reply,
            accepts_idempotency_key=True,
            timeout=5,
            input_schema={
                "type": "object",
                "required": ["text"],
                "properties": {"text": {"type": "string"}},
            },
        ),
    )
    drill_input: ClassVar[dict[str, Any]] = {"notes": ["first", "second"]}

    def run(self) -> None:
        notes = self.input["notes"]
        steps = [Step(f"note:{note}", "read_note", {"note": note}) for note in notes]
        read = self.ctx.side_by_side(steps)
        lines = [
            f"{note}: not read ({result.error})"
            if isinstance(result, ActionFailed)
            else f"{note}: {result['text']}"
            for note, result in zip(notes, read, strict=True)
        ]
        reply = "\n".join(lines)
        self.ctx.step("file", "file_reply", {"text": reply})
        used = [
            step.key for step, result in zip(steps, read, strict=True) if isinstance(result, dict)
        ]
        self.ctx.publish(reply, revision=1, final=True, used=used)

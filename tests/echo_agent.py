"""An agent Rundesk does not ship, written against the agent API alone, for
the tests to install (settings.RUNDESK_AGENTS = {..., "echo":
"tests.echo_agent:EchoAgent"}): the pages, the inbox, the CLI, bundles and
versions are tried on it as on any user's agent.

It reads its message (`look`), publishes a draft, sends the message by one
of two effects, as its input's `via` says, and publishes the final answer:

- `post` sends no idempotency key (as SMTP: its receiver keeps every copy
  it is sent);
- `store` sends the action's identity as its Idempotency-Key (as an HTTP
  API that keeps one copy per key).

Every real execution is a line of the tool journal (RUNDESK_TOOL_JOURNAL),
as the shipped tools write it, so that tests count executions.  Other
versions of it (EchoAgentV2, EchoAgentV3) are installed under the same
name to change the installed version between two drives of a run.
"""

from __future__ import annotations

from typing import Any

from runs.agent import EFFECT, READ, Agent, Tool, ToolCall
from runs.agents.tools import journal

INPUT = {
    "type": "object",
    "properties": {
        "message": {"type": "string", "title": "Message", "description": "what is sent"},
        "to": {"type": "string", "title": "Recipient"},
        "via": {"enum": ["post", "store"], "title": "Sent by"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "options": {"type": "object"},
    },
    "required": ["message", "to"],
    "additionalProperties": False,
}
SENT = {
    "type": "object",
    "properties": {"to": {"type": "string"}, "message": {"type": "string"}},
    "required": ["to", "message"],
}
MAIL_HOST = "smtp://mail.echo.test"
STORE_HOST = "https://store.echo.test/messages"


def look(input: dict[str, Any], call: ToolCall) -> dict[str, Any]:
    journal("look", call.identity)
    return {"text": input["message"]}


def post(input: dict[str, Any], call: ToolCall) -> dict[str, Any]:
    journal("post", call.identity, key=call.idempotency_key)
    return {"message_id": f"<{call.idempotency_key}@echo.test>"}


def store(input: dict[str, Any], call: ToolCall) -> dict[str, Any]:
    journal("store", call.identity, key=call.idempotency_key)
    return {"stored": call.idempotency_key}


LOOK = Tool("look", READ, look, timeout=5)
POST = Tool(
    "post",
    EFFECT,
    post,
    timeout=5,
    input_schema=SENT,
    receiver=lambda input, key: f"{MAIL_HOST}, message <{key}@echo.test> to {input['to']}",
)
STORE = Tool(
    "store",
    EFFECT,
    store,
    accepts_idempotency_key=True,
    timeout=5,
    input_schema=SENT,
    receiver=lambda input, key: f"{STORE_HOST}/{input['to']}",
)


class EchoAgent(Agent):
    name = "echo"
    version = "1"
    input_schema = INPUT
    tools = (LOOK, POST, STORE)
    drill_input = {"message": "drill", "to": "drill@echo.test"}

    @classmethod
    def title(cls, input: dict[str, Any]) -> str:
        return f"echo to {input['to']}"

    def run(self) -> None:
        seen = self.ctx.step("look", "look", {"message": self.input["message"]})
        self.ctx.publish(f"Draft: {seen['text']}", revision=1, used=["look"])
        sent = {"to": self.input["to"], "message": seen["text"]}
        self.ctx.step("send", self.input.get("via", "post"), sent)
        self.ctx.publish(f"Sent: {seen['text']}", revision=2, final=True, used=["look"])


class EchoAgentV2(EchoAgent):
    """Its code changed: it does not say it can continue version 1's runs."""

    version = "2"


class EchoAgentV3(EchoAgent):
    """Its code changed, and it continues version 1's runs."""

    version = "3"
    continues = frozenset({"1"})


def install(settings: Any, path: str = "tests.echo_agent:EchoAgent") -> None:
    """Installs the echo agent (a version of it: `path`) under its name."""
    settings.RUNDESK_AGENTS = {**settings.RUNDESK_AGENTS, "echo": path}


def uninstall(settings: Any) -> None:
    settings.RUNDESK_AGENTS = {
        name: path for name, path in settings.RUNDESK_AGENTS.items() if name != "echo"
    }

"""A tool called directly, as the runtime calls it (runs/agent.py ToolCall)."""

from __future__ import annotations

from runs.agent import ToolCall


def call(identity: str, idempotency_key: str = "", timeout: float = 30.0) -> ToolCall:
    return ToolCall(0, identity.rpartition(":")[2], identity, idempotency_key, timeout)

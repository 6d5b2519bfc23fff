"""The research agent with tools that do nothing (`bench --throughput`).

Its runs take the research agent's steps (3 reads, 3 summaries, compose,
deliver), publications and checkpoints, on answers of the sizes the real
tools give, with no work behind them: no file is read, no model text is
made, no report is written.  What the executor spends on them per action
is its own cost; what it spends on the research agent's runs beyond that
is the tools' (reading and decoding files, the offline model's text work,
an fsync'd file per report).

The benchmark's executors install it (HOLLOW_ENTRY in RUNDESK_AGENTS), and
the benchmark while it submits their runs; no other process does."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from runs.agent import ToolCall
from runs.agents.research import ResearchAgent
from runs.agents.tools import DELIVER_REPORT, MODEL_CALL, READ_DOCUMENT

HOLLOW = "bench-hollow"
HOLLOW_ENTRY = f"{HOLLOW}=runs.benchmarks.hollow:HollowResearch"

# About what the sample corpus's documents hold, and what the offline model
# says of one.
DOCUMENT = "# A fund\n\n" + "- A figure: 0.10%\n" * 50
SUMMARY = "## A fund\n\n" + "- A figure: 0.10%\n" * 30


def read_nothing(input: dict[str, Any], call: ToolCall) -> dict[str, Any]:
    return {
        "path": input["path"],
        "bytes": len(DOCUMENT),
        "sha256": hashlib.sha256(DOCUMENT.encode()).hexdigest(),
        "text": DOCUMENT,
    }


def answer_nothing(input: dict[str, Any], call: ToolCall) -> dict[str, Any]:
    return {"provider": "hollow", "text": SUMMARY}


def deliver_nowhere(input: dict[str, Any], call: ToolCall) -> dict[str, Any]:
    return {"delivered_to": "nowhere", "sha256": hashlib.sha256(b"").hexdigest()}


class HollowResearch(ResearchAgent):
    name = HOLLOW
    tools = (
        dataclasses.replace(READ_DOCUMENT, run=read_nothing),
        dataclasses.replace(MODEL_CALL, run=answer_nothing),
        dataclasses.replace(DELIVER_REPORT, run=deliver_nowhere),
    )

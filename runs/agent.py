"""The agent API: everything an agent and its tools are written against.

    from runs.agent import Agent, RunContext, Step, Tool, ToolCall, ToolRefused

A **tool** is a function `run(input, call) -> dict` declared with its name,
its effect class (`READ`: repeatable, no outside effect; `EFFECT`:
irreversible), whether its receiver keeps one copy per idempotency key
(`accepts_idempotency_key`: only then is "send again under the same
identity" ever offered after a lost answer), its timeout and the JSON
Schema of its input.  It answers a JSON object, or raises ToolRefused (a
definite answer, recorded as the result), ToolFailed (known not to have
happened) or OutcomeUnknown (it may have happened: only its receiver can
say; an operator decides).

An **agent** is a subclass of Agent declaring its name, version, input
schema and tools, with `run()`, which works through `self.ctx` (a
RunContext): steps, answer revisions, checkpoints.  After a crash the
runtime runs `run()` again from the start; every step that completed
returns its receipt's result without being dispatched again, so the
agent's state follows from its receipts.  An agent that wants to skip
that re-stepping may save checkpoints, and then says in `replay()` how its
state follows from the receipts: a checkpoint is used only if it holds
exactly that.

Agents are installed by name in RUNDESK_AGENTS (runs/registry.py).
docs/AGENTS.md is the tutorial and the reference.
"""

from __future__ import annotations

import datetime as dt
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import fastjsonschema
import jsonschema

from runs.checkpoints import Disagreement
from runs.models import EffectClass, Phase
from runs.progress import History

T = TypeVar("T")

__all__ = [
    "EFFECT",
    "READ",
    "ActionFailed",
    "Agent",
    "Disagreement",
    "History",
    "OutcomeUnknown",
    "Phase",
    "RunContext",
    "Step",
    "Tool",
    "ToolCall",
    "ToolFailed",
    "ToolRefused",
    "input_refusal",
]

READ, EFFECT = EffectClass.READ, EffectClass.EFFECT
ANY_OBJECT: Mapping[str, Any] = {"type": "object"}
NAME = re.compile(r"[a-z][a-z0-9_.-]{0,62}")


class ToolRefused(Exception):
    """The tool gave a definite answer and did nothing (e.g. a path outside
    the corpus).  It is a result: the receipt records {"refused": message}."""


class ToolFailed(Exception):
    """The tool did not do its work, and is known not to have done it."""


class OutcomeUnknown(Exception):
    """The tool may or may not have done its work (a request was sent and
    its answer was lost): the run waits for an operator, who settles it
    with the receiver's evidence."""


class ActionFailed(Exception):
    """An action is known not to have completed (its tool failed).  Raised
    by `RunContext.step`; an agent catches it to go on without the action,
    or lets it end the run as failed."""

    def __init__(self, step_key: str, error: str) -> None:
        super().__init__(f"{step_key} failed: {error}")
        self.step_key, self.error = step_key, error


@dataclass(frozen=True)
class ToolCall:
    """What a tool is told of the action it performs."""

    run_id: int
    step_key: str
    # How operators and logs name the action: rundesk:run-7:send.
    identity: str
    # What its receiver knows it by: the same on every attempt of this
    # action, unique in the world (an Idempotency-Key, a Message-ID).
    idempotency_key: str
    # Seconds the tool has: its own I/O should give up by then.
    timeout: float


def input_refusal(schema: Mapping[str, Any], value: Any, what: str = "input") -> str:
    """Why `value` does not have the shape `schema` (a JSON Schema) says,
    naming the field; "" when it has."""
    return refusal_by(jsonschema.Draft202012Validator(schema), value, what)


def refusal_by(validator: jsonschema.protocols.Validator, value: Any, what: str = "input") -> str:
    """input_refusal with the schema's validator already built (a tool
    builds its own once: building one costs more than most checks)."""
    if validator.is_valid(value):
        return ""  # the usual case: no error is built to be ranked
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is None:
        return ""
    where = "".join(f"[{part!r}]" if isinstance(part, int) else f".{part}" for part in error.path)
    return f"{what}{where}: {error.message}"


# What draft 7, which fastjsonschema compiles, lacks or reads otherwise than
# 2020-12, which schemas here are: a schema naming any of them (as a
# keyword, or, to be safe, as a property) is checked by jsonschema alone.
NOT_IN_DRAFT_7 = frozenset(
    {
        "$schema",
        "$id",
        "$ref",
        "$defs",
        "definitions",
        "$anchor",
        "$dynamicRef",
        "$dynamicAnchor",
        "$recursiveRef",
        "$recursiveAnchor",
        "$vocabulary",
        "prefixItems",
        "unevaluatedItems",
        "unevaluatedProperties",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "minContains",
        "maxContains",
        "contentSchema",
    }
)


def compiled_check(schema: Mapping[str, Any]) -> Callable[[Any], bool] | None:
    """Whether a value has the shape `schema` says, as code compiled from
    it: about twenty times as fast as jsonschema on a model call's
    messages, which a run checks on every step.  Formats are not checked
    and defaults not filled in, as jsonschema does neither.  None for a
    schema it cannot be trusted with (NOT_IN_DRAFT_7) or cannot compile.
    It only says yes: a no is asked of jsonschema again, which says why."""
    if _names(schema) & NOT_IN_DRAFT_7:
        return None
    try:
        check = fastjsonschema.compile(dict(schema), use_default=False, use_formats=False)
    except Exception:  # a schema jsonschema takes and it does not: jsonschema alone
        return None

    def valid(value: Any) -> bool:
        try:
            check(value)
        except Exception:
            return False
        return True

    return valid


def _names(schema: Any) -> set[str]:
    """Every key of every object in `schema`."""
    if isinstance(schema, Mapping):
        return set(schema).union(*(_names(value) for value in schema.values()))
    if isinstance(schema, list):
        return set().union(*(_names(value) for value in schema))
    return set()


@dataclass(frozen=True)
class Tool:
    """A tool an agent's steps dispatch.  `receiver(input, idempotency_key)`
    says where an effect goes, for an operator to look it up there after
    a lost answer ("smtp://mail.example.com, message <key@host>"); without
    it, operators are told the tool's name only."""

    name: str
    effect: EffectClass
    run: Callable[[dict[str, Any], ToolCall], dict[str, Any]]
    accepts_idempotency_key: bool = False
    timeout: float = 60.0
    input_schema: Mapping[str, Any] = field(default_factory=lambda: ANY_OBJECT)
    receiver: Callable[[dict[str, Any], str], str] | None = None
    # Each call waits for a person's approval before its boundary (an
    # approval item in the inbox; runs/approvals.py), for at most
    # `approval_timeout`: not approved by then, it is refused.
    needs_approval: bool = False
    approval_timeout: dt.timedelta = dt.timedelta(hours=2)

    def __post_init__(self) -> None:
        if not NAME.fullmatch(self.name):
            raise ValueError(
                f"tool name {self.name!r}: lower-case letters, digits, '_', '.', '-', "
                "starting with a letter"
            )
        if self.effect not in (READ, EFFECT):
            raise ValueError(f"tool {self.name}: effect is READ or EFFECT, not {self.effect!r}")
        if not self.timeout > 0:
            raise ValueError(f"tool {self.name}: timeout must be positive seconds")
        jsonschema.Draft202012Validator.check_schema(self.input_schema)
        if not self.approval_timeout > dt.timedelta(0):
            raise ValueError(f"tool {self.name}: approval_timeout must be positive")

    def refusal(self, input: Any) -> str:
        """Why this tool refuses `input` before its boundary ("" if not)."""
        if self._check is not None and self._check(input):
            return ""
        return refusal_by(self._validator, input)

    # Built once per tool, not once per step.
    @functools.cached_property
    def _validator(self) -> jsonschema.protocols.Validator:
        return jsonschema.Draft202012Validator(self.input_schema)

    @functools.cached_property
    def _check(self) -> Callable[[Any], bool] | None:
        return compiled_check(self.input_schema)


@dataclass(frozen=True)
class Step:
    """One step of `RunContext.side_by_side`: a read under its step key."""

    key: str
    tool: str
    input: dict[str, Any]
    sources: Sequence[str] = ()


class RunContext:
    """What an agent does a run through.  Step keys are the agent's to
    choose; each names one action for ever (never reuse one for other
    work): a step whose action completed returns its receipt's result,
    without dispatching it again."""

    def __init__(self, dispatcher: Any) -> None:
        # The runtime's Dispatcher (runs/dispatch.py): not part of the API.
        self._dispatcher = dispatcher
        run = dispatcher.run
        self.run_id: int = run.pk
        self.input: dict[str, Any] = run.input
        # The state a checkpoint restored (when the agent saves them and
        # one agreed with the receipts), or None: run from the beginning.
        self.saved: dict[str, Any] | None = None

    def step(
        self,
        key: str,
        tool: str,
        input: dict[str, Any],
        *,
        sources: Sequence[str] = (),
        needs_approval: bool = False,
    ) -> dict[str, Any]:
        """Dispatches `tool` with `input` under step `key` after its boundary
        is durable, or returns the result its receipt holds.  A refusal is a
        result: {"refused": why} (an input the tool's schema refuses too).
        Raises ActionFailed if the tool failed; an unknown outcome, a lost
        lease or a cancel end the run's turn (do not catch BaseException).
        `sources` names the documents a model call was given.
        `needs_approval` (or the tool's own `needs_approval`): the run
        waits for a person to approve this call first; the result then
        says what was sent under "approval" (an approver may have edited
        the input), and a rejection is a refusal."""
        return self._unless_ended(
            lambda: self._dispatcher.step(
                key, tool, input, sources=sources, needs_approval=needs_approval
            )
        )

    def side_by_side(self, steps: Sequence[Step]) -> list[dict[str, Any] | ActionFailed]:
        """Reads dispatched at once: their boundaries are one durable write,
        their receipts one more; each is still dispatched once.  Returns
        each step's result, or its ActionFailed, in order."""
        return self._unless_ended(lambda: self._dispatcher.side_by_side(steps))

    def publish(
        self, content: str, *, revision: int, final: bool = False, used: Sequence[str] = ()
    ) -> str:
        """Commits answer revision number `revision` (1, 2, ...), naming the
        steps (`used`) whose results it draws on.  Returns the content that
        stands: a revision published before a crash stays as readers read
        it."""
        return self._unless_ended(
            lambda: self._dispatcher.publish(revision, content, is_final=final, model_calls=used)
        )

    def checkpoint_due(self, after: str) -> bool:
        """Whether a checkpoint is due after step `after` (ask before
        gathering the state: most steps need none)."""
        return self._dispatcher.checkpoint_due(after)

    def checkpoint(self, after: str, state: dict[str, Any]) -> None:
        """Saves `state` after step `after`, if one is due.  Only an agent
        whose `replay` rebuilds that state from the receipts saves them."""
        self._unless_ended(lambda: self._dispatcher.checkpoint(after, state))

    def settled(self, key: str) -> bool:
        """Whether step `key`'s outcome is known: it completed or failed."""
        return self._dispatcher.settled(key)

    def finalize_if_due(self, *, steps_needed: int = 0) -> str:
        """Why the run may take no new reads (its budget, counting
        `steps_needed` more steps, or its deadline), moving it to
        finalizing; "" while it may."""
        return self._unless_ended(
            lambda: self._dispatcher.finalize_if_due(actions_needed=steps_needed)
        )

    def _unless_ended(self, work: Callable[[], T]) -> T:
        """`work()`, unless the run's work has ended.  A call that raised
        anything but ActionFailed (a wait for a person or for evidence, a
        hold, a cancel, a lost lease, a stop, a database error) ended it,
        whatever the agent then did with the exception: every later call
        raises it again, and so does the end of `run()`
        (Dispatcher.run_agent).  An agent that catches Exception around a
        step can never go on past an approval nobody gave."""
        if (ended := self._dispatcher.ended) is not None:
            raise ended
        try:
            return work()
        except ActionFailed:
            raise
        except BaseException as ending:
            self._dispatcher.ended = ending
            raise

    @property
    def phase(self) -> Phase:
        return Phase(self._dispatcher.run.phase)

    @property
    def phase_reason(self) -> str:
        return self._dispatcher.run.phase_reason

    @property
    def steps_taken(self) -> int:
        return self._dispatcher.progress.steps

    @property
    def budget(self) -> int:
        """Steps the run may take in all."""
        return self._dispatcher.run.action_budget

    @property
    def deadline(self) -> dt.datetime | None:
        return self._dispatcher.run.deadline


class Agent:
    """Subclass it and declare:

    - `name` (how it is installed and submitted to), `version` (recorded
      on each run), `continues` (earlier versions whose runs this version
      may continue after a resume: any other waits for an operator);
    - `input_schema` (JSON Schema, checked at submission) and, where a
      schema cannot say it, `check_input()`; `title()` names a run;
    - `tools`, and `drill_input` (an input the drills may run it on).

    The runtime makes one instance per turn of a run (`ctx`, `input`) and
    calls `run()`."""

    name: ClassVar[str] = ""
    version: ClassVar[str] = "1"
    continues: ClassVar[frozenset[str]] = frozenset()
    input_schema: ClassVar[Mapping[str, Any]] = ANY_OBJECT
    tools: ClassVar[Sequence[Tool]] = ()
    drill_input: ClassVar[Mapping[str, Any] | None] = None

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.input = ctx.input

    def run(self) -> None:
        raise NotImplementedError(f"agent {self.name} has no run()")

    def replay(self, after: str, history: History) -> dict[str, Any]:
        """The state this agent had when it saved a checkpoint after step
        `after`, rebuilt from `history` (the run's receipts); Disagreement
        if the receipts cannot have led there.  Only an agent that saves
        checkpoints needs one."""
        raise Disagreement("the agent saves no checkpoints")

    @classmethod
    def check_input(cls, input: dict[str, Any]) -> None:
        """Raises ValueError saying what is wrong with `input`, beyond
        what `input_schema` says."""

    @classmethod
    def title(cls, input: dict[str, Any]) -> str:
        """One line naming a run of this agent for operators."""
        first = next((value for value in input.values() if isinstance(value, str)), "")
        return f"{cls.name}: {first}" if first else cls.name

    @classmethod
    def documents(cls, input: dict[str, Any]) -> list[str]:
        """The documents a run of this agent reads, as its page lists them."""
        return []

    @classmethod
    def saves_checkpoints(cls) -> bool:
        return cls.replay is not Agent.replay

    @classmethod
    def can_continue(cls, version: str) -> bool:
        return version == cls.version or version in cls.continues

    @classmethod
    def tool(cls, name: str) -> Tool | None:
        return next((tool for tool in cls.tools if tool.name == name), None)

"""What an agent does through the runtime: its steps, the answers it
publishes, its checkpoints, its budget -- the same for every agent.

`Dispatcher.step()` is where "resume without replay" is decided, for every
action of every agent:

- an action with a receipt is never dispatched again: its receipt is the result;
- an action with a boundary but no receipt is dispatched again only if it is
  a `read`, under its original identity (MAX_READ_DISPATCHES times in all:
  then it fails, and the agent goes on without it); a read known to have
  failed is not: its failure is the result, as it was the first time;
- an `effect` action in that state may have happened: it is marked `unknown`
  and the run waits for an operator; it is dispatched again (under its
  original identity) only as often as operators' decisions authorise
  (runs/decisions.py);
- a new action is dispatched only after its boundary is durable.

The two settled writes live here, side by side: a step's receipt and an
answer revision's publication.  Each is fenced by the lease (runs/leases.py),
and a COMMIT that got no answer is settled by evidence (runs/outcomes.py).
Each completed action's copies (the source read, the model call) are
handed to capture (evidence/capture.py), off the main path, once its
receipt is written.

One durable commit per read: a read's receipt is written with the run's
next write -- the next action's boundary, in one fenced statement, or the
run's finish -- or on its own before any other write (a publication, a
checkpoint, the end of the run however it ends).  The agent has the
result at once; until that commit, the read is a boundary without a
receipt, which a next owner sends again under its identity: a lost merged
write costs a read, never an effect.  An effect's receipt is written the
moment its answer arrives, in its own commit.

The run's progress (`Progress`) is the runtime's, not the agent's: a
checkpoint saves it beside the agent's state, and `resume()` restores both
in one place (runs/checkpoints.py says when a checkpoint may be trusted).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn, TypeVar

from django.db import DEFAULT_DB_ALIAS, DatabaseError, connection, transaction
from django.utils import timezone

from evidence.capture import Record, RunCapture
from runs import approvals, registry
from runs.agent import (
    ActionFailed,
    Agent,
    OutcomeUnknown,
    RunContext,
    Step,
    Tool,
    ToolCall,
    ToolFailed,
    ToolRefused,
)
from runs.checkpoints import Checkpointer
from runs.faults import FaultPlan, inject_cancel, steal_lease
from runs.leases import (
    Boundary,
    CancelRequested,
    Held,
    Lease,
    LeaseExpired,
    LeaseLost,
    PendingReceipt,
    RevisionExists,
    WriteRefused,
)
from runs.models import (
    AUTHORISING,
    Action,
    ActionState,
    AnswerRevision,
    EffectClass,
    OutcomeKind,
    Phase,
    Receipt,
    Run,
    RunStatus,
    action_identity,
    canonical_json,
    digest,
    new_idempotency_key,
)
from runs.outcomes import NeedsOperator, open_item, write_settled
from runs.progress import History, Progress
from runs.sql import release_connection, server_cursor, transient, violated
from runs.timeline import EventKind, timeline

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How often a read is dispatched without its receipt being written before it
# fails (Dispatcher._give_up).
MAX_READ_DISPATCHES = 10
# How long a fact write refused for its moment (a lock or statement
# timeout) is tried again before the run is left to its lease
# (Dispatcher._until_written).
FACT_RETRY_SECONDS = 30.0


class Answer(NamedTuple):
    """What a tool answered, as its receipt keeps it: a JSON object, and
    its canonical text, made when the answer arrives: the check that the
    answer is JSON, the receipt and its digest all use it, and a read's
    receipt, written with the run's next write, keeps what the tool
    answered whatever the agent does meanwhile with the object it got."""

    result: dict[str, Any]
    text: str

    @classmethod
    def of(cls, result: dict[str, Any]) -> Answer:
        return cls(result, canonical_json(result))


@dataclass(frozen=True)
class AwaitingReceipt:
    """A read this owner has the result of, whose receipt is not written
    yet: it goes with the run's next write.  Not yet `ActionState.COMPLETED`:
    until that commit a next owner sends the read again."""

    step_key: str
    step: int  # the run's step count when it completed (fault plans count so)
    receipt: PendingReceipt
    # What capture keeps of it (RunCapture.copy_of), made with the receipt.
    copy: Record | None

    @property
    def action_id(self) -> int:
        return self.receipt.action_id

    @property
    def result(self) -> dict[str, Any]:
        return self.receipt.result


class Stopping(Exception):
    """The executor is shutting down: give the run back, dispatch nothing."""


# Reads side by side run on these threads, one each, so that one that
# outlives its timeout is left behind (its answer, if one comes, is
# dropped) and the run goes on.
TOOL_THREADS = concurrent.futures.ThreadPoolExecutor(
    max_workers=256, thread_name_prefix="rundesk-tool"
)


_RUN_FIELDS = Run._meta.concrete_fields
RUN_TO_DRIVE = f"""SELECT {", ".join(f"run.{field.column}" for field in _RUN_FIELDS)},
        EXISTS (SELECT 1 FROM runs_action WHERE run_id = run.id),
        EXISTS (SELECT 1 FROM runs_approval WHERE run_id = run.id)
    FROM runs_run AS run WHERE run.id = %s"""


def run_to_drive(run_id: int) -> Run:
    """The run's row for its owner, read once after the claim, with whether
    it has actions (`has_actions`) and approvals (`has_approvals`): a new
    run has neither, and its dispatcher then reads neither (each read cost
    more CPU than one of its steps).  Raw SQL, and the row made a Run
    directly: the ORM's compiling of the same query cost more than its
    round trip."""
    with server_cursor() as cursor:
        cursor.execute(RUN_TO_DRIVE, [run_id], prepare=True)
        row = cursor.fetchone()
    if row is None:
        raise Run.DoesNotExist(f"run {run_id} does not exist")
    *values, has_actions, has_approvals = row
    run = Run.from_db(
        DEFAULT_DB_ALIAS,
        [field.attname for field in _RUN_FIELDS],
        [
            field.from_db_value(value, None, connection)
            if hasattr(field, "from_db_value")
            else value
            for field, value in zip(_RUN_FIELDS, values, strict=True)
        ],
    )
    run.has_actions, run.has_approvals = has_actions, has_approvals
    return run


class Ran:
    """A tool call run on the run's own thread, answered as a Future
    answers (`result`, `cancel`), without a Future's condition and its
    locks: about twenty Python calls an action, for a call already over."""

    __slots__ = ("error", "value")

    def __init__(self, value: Any = None, *, error: Exception | None = None) -> None:
        self.value, self.error = value, error

    def result(self, timeout: float | None = None) -> Any:
        if self.error is not None:
            raise self.error
        return self.value

    def cancel(self) -> bool:
        return False  # it ran


class Dispatcher:
    def __init__(
        self,
        lease: Lease,
        *,
        stop: threading.Event,
        lease_lost: threading.Event,
        tools: Sequence[Tool] | None = None,
        run: Run | None = None,
    ):
        self.lease = lease
        self.stop = stop
        self.lease_lost = lease_lost
        # The run's row (run_to_drive) as its driver read it after the
        # claim, or read here.
        self.run = run_to_drive(lease.run_id) if run is None else run
        # The tools its steps may dispatch: its agent's (a benchmark's own).
        declared = registry.agent_class(self.run.agent).tools if tools is None else tools
        self.tools: Mapping[str, Tool] = {tool.name: tool for tool in declared}
        self.faults = FaultPlan.parse(self.run.faults, run_id=self.run.pk)
        # What earlier owners left: every action of the run, with its receipt.
        self.history = History.of(self.run) if self.run.has_actions else History([])
        # Actions completed by this owner: step key -> action id.
        self.completed_now: dict[str, int] = {}
        self.progress = Progress()
        # Steps a restored checkpoint already counted: stepping one of these
        # again returns its receipt's result and counts nothing.
        self.covered: set[str] = set()
        self.capture = RunCapture(self.run.pk)
        self.checkpoints = Checkpointer(lease, self.faults)
        # The reads whose results are in hand, until their receipts are written.
        self.unwritten: list[AwaitingReceipt] = []
        # Steps an approval was asked for: gated whatever the agent says now.
        self.gated = approvals.gated_steps(self.run.pk) if self.run.has_approvals else set()
        # What ended the run's work, raised to its agent through a RunContext
        # call: raised again at its next call and at the end of run().
        self.ended: BaseException | None = None

    def run_agent(self, declared: type[Agent]) -> None:
        """Runs the agent `declared` through this dispatcher, from where
        the run is: a checkpoint that agrees with the receipts, or the
        beginning (completed steps answered by their receipts)."""
        context = RunContext(self)
        agent = declared(context)
        with self.receipt_kept():
            context.saved = self.resume(agent.replay)
            agent.run()
            if self.ended is not None:
                # The agent caught it and went on: it ends the run all the same.
                raise self.ended

    # -- resuming ----------------------------------------------------------

    def resume(self, replay: Callable[[str, History], dict[str, Any]]) -> dict[str, Any] | None:
        """Where a run that earlier owners worked on continues: the agent's
        state from the newest checkpoint that agrees with the receipts
        (`replay` rebuilds it, see runs/checkpoints.py), with the progress
        saved beside it; None to start from the beginning, stepping through
        the receipts.  A new run has nothing to resume."""
        if not self.history:
            return None
        timeline.record(
            self.run.pk,
            EventKind.RESUMED,
            f"resumed by epoch {self.lease.epoch} from {len(self.history)} actions",
        )
        self.capture.resumed()
        point = self.checkpoints.resume_point(self.history, replay)
        if point is None:
            return None
        self.progress = point.progress
        self.covered = set(point.progress.taken)
        self.checkpoints.saved_at(point.progress.steps)
        return point.state

    # -- what an agent does --------------------------------------------------

    def completed(self, step_key: str) -> bool:
        return step_key in self.completed_now or self.history.completed(step_key)

    def settled(self, step_key: str) -> bool:
        """Whether the action's outcome is known: it completed, or it failed
        (stepping a failed read raises its failure again)."""
        return self.completed(step_key) or self.history.failure(step_key) is not None

    def action_id(self, step_key: str) -> int:
        """The id of an action this run has completed (now or earlier)."""
        if step_key in self.completed_now:
            return self.completed_now[step_key]
        return self.history.action(step_key).pk

    def step(
        self,
        step_key: str,
        tool_name: str,
        input: dict[str, Any],
        *,
        sources: Sequence[str] = (),
        needs_approval: bool = False,
    ) -> dict[str, Any]:
        """One action of the run: its result, from its receipt or from
        dispatching it.  `sources` names the documents a model call was
        given (its evidence links to them).  One that needs approval
        passes its gate first (runs/approvals.py): it waits for it, is
        refused by it, or goes on with the input approved."""
        if step_key in self.completed_now:
            raise NeedsOperator(f"the agent used identity {step_key} twice")
        tool = self._tool(tool_name)
        if refusal := self._refused_input(step_key, tool, input):
            return refusal
        if needs_approval or tool.needs_approval or step_key in self.gated:
            passed = approvals.gate(self, step_key, tool, input)
            if passed.refusal is not None:
                return passed.refusal
            tool, input = passed.tool, passed.input
        covered = step_key in self.covered
        self.covered.discard(step_key)
        if not covered:
            self.progress.steps += 1
        action = self.history.get(step_key)
        if action is None:
            key = new_idempotency_key()
            action_id = self._new_boundary(step_key, key, tool, input)
            result = self._call_tool(action_id, step_key, key, tool, input, sources)
        elif (result := self._settled_result(action, tool, input)) is None:
            self._redispatch(action)
            # Sent again under the key its boundary was written with.
            result = self._call_tool(
                action.pk, step_key, action.idempotency_key, tool, input, sources
            )
        else:
            # Handed over again: the owner that wrote the receipt may have
            # died before capture saved it (capture saves each once).
            self.capture.completed(action.pk, tool.name, input, result, sources)
        if not covered:
            self.progress.taken.append(step_key)
        return result

    def side_by_side(self, steps: Sequence[Step]) -> list[dict[str, Any] | ActionFailed]:
        """Reads dispatched at once: the boundaries of those new are one
        write (with the receipts awaiting one), their tools run
        concurrently, and their receipts go together with the run's next
        write.  Each is settled as `step` settles it: one with a receipt
        is not dispatched again, one without is sent again under its
        identity.  Each step's result, or its ActionFailed, in order."""
        keys = [each.key for each in steps]
        if len(set(keys)) != len(keys):
            raise ValueError(f"steps side by side share a key: {keys}")
        results: list[dict[str, Any] | ActionFailed | None] = [None] * len(steps)
        # index -> (tool, the step's number, the action sent again or None)
        to_send: dict[int, tuple[Tool, int, Action | None]] = {}
        counted: list[int] = []
        for index, each in enumerate(steps):
            if each.key in self.completed_now:
                raise NeedsOperator(f"the agent used identity {each.key} twice")
            tool = self._tool(each.tool)
            if tool.effect != EffectClass.READ:
                raise ValueError(f"{each.key}: only reads go side by side, and {tool.name} is not")
            if tool.needs_approval:
                raise ValueError(f"{each.key}: {tool.name} needs approval: step it on its own")
            if refusal := self._refused_input(each.key, tool, each.input):
                results[index] = refusal
                continue
            if each.key in self.covered:
                self.covered.discard(each.key)
            else:
                self.progress.steps += 1
                counted.append(index)
            action = self.history.get(each.key)
            try:
                if action is None:
                    to_send[index] = (tool, self.progress.steps, None)
                elif (result := self._settled_result(action, tool, each.input)) is None:
                    to_send[index] = (tool, self.progress.steps, action)
                else:
                    results[index] = result
                    self.capture.completed(action.pk, tool.name, each.input, result, each.sources)
            except ActionFailed as failed:
                results[index] = failed
        new = [
            Boundary(
                steps[index].key, tool.name, tool.effect, steps[index].input, new_idempotency_key()
            )
            for index, (tool, _, action) in to_send.items()
            if action is None
        ]
        # A read an active hold stops is not sent; the others go on, and
        # the run waits once they are in (runs/holds.py).
        ids, held = self._new_boundaries(new) if new else ({}, None)
        keys_sent = {each.step_key: each.idempotency_key for each in new}
        for _, _, action in to_send.values():
            if action is not None:
                try:
                    self._redispatch(action)
                except Held as stopped:
                    held = held or stopped
                    continue
                ids[action.step_key] = action.pk
                keys_sent[action.step_key] = action.idempotency_key
        started = {
            index: self._start(
                steps[index].key,
                keys_sent[steps[index].key],
                tool,
                steps[index].input,
                number,
                beside=True,
            )
            for index, (tool, number, _) in to_send.items()
            if steps[index].key in ids
        }
        for index, future in started.items():
            each, (tool, number, _) = steps[index], to_send[index]
            answer = self._answer(future, tool, number)
            try:
                results[index] = self._settle_call(
                    ids[each.key],
                    each.key,
                    keys_sent[each.key],
                    tool,
                    each.input,
                    each.sources,
                    number,
                    answer,
                )
            except ActionFailed as failed:
                results[index] = failed
        if held is not None:
            raise held
        for index in counted:
            if not isinstance(results[index], ActionFailed):
                self.progress.taken.append(steps[index].key)
        return [result for result in results if result is not None]

    def publish(
        self, number: int, content: str, *, is_final: bool, model_calls: Sequence[str]
    ) -> str:
        """Commits answer revision `number`, naming the model calls (step
        keys) it used; an unanswered COMMIT is settled by evidence, and
        what stays unknown waits for an operator.  Returns the content that
        stands: a revision this run published before it resumed, written
        otherwise now (its code changed while it waited), stays as its
        readers read it, and is what the run goes on with."""
        used = [self.action_id(step_key) for step_key in model_calls]
        awaiting, self.unwritten = self.unwritten, []
        ids = [each.action_id for each in awaiting]

        def write() -> bool:
            with self.faults.at_commit("publication", self.progress.steps):
                return self.lease.publish_revision(
                    number,
                    content,
                    is_final=is_final,
                    model_call_actions=used,
                    receipts=[each.receipt for each in awaiting],
                )

        def committed() -> bool:
            # The revision and the receipts it carries commit together; a
            # revision published before (a resumed run) says nothing of them.
            return AnswerRevision.objects.filter(
                run_id=self.run.pk, number=number, content_digest=digest(content)
            ).exists() and Receipt.objects.filter(action_id__in=ids).count() == len(ids)

        try:
            published = write_settled(
                write,
                committed,
                what=f"publication of revision {number}",
                run_id=self.run.pk,
                kind=OutcomeKind.PUBLICATION,
                subject=f"publication:run-{self.run.pk}:revision-{number}",
                lease_epoch=self.lease.epoch,
                afterwards="the run waits for an operator",
                revision_number=number,
            )
        except (CancelRequested, LeaseExpired):
            self._receipts_written(awaiting)  # the receipts went; the revision did not
            raise
        except RevisionExists:
            self._receipts_written(awaiting)
            stands = AnswerRevision.objects.get(run_id=self.run.pk, number=number)
            if stands.is_final != is_final:
                raise
            timeline.record(
                self.run.pk,
                EventKind.REVISION_KEPT,
                f"revision {number} stands as published; this run now writes it otherwise",
                number=number,
                content_digest=stands.content_digest,
                not_published_digest=digest(content),
            )
            return stands.content
        except DatabaseError as error:
            # Answered with an error: the statement rolled back, and the
            # receipts can still go on their own (receipt_kept).
            self.unwritten = awaiting
            if violated(error) == "revision_one_final_per_run":
                # The agent's mistake, made again by every owner: the run fails.
                raise RevisionExists(
                    f"revision {number} is final, and a final revision of this run is "
                    "published already: a run publishes one"
                ) from error
            raise
        except (NeedsOperator, LeaseLost):
            self._copied(awaiting)  # the receipts' fate is the revision's: not ours to say
            raise
        self._receipts_written(awaiting)
        if published is not False:
            timeline.record(
                self.run.pk,
                EventKind.REVISION_PUBLISHED,
                f"{'final' if is_final else 'draft'} revision {number}",
                number=number,
                content_digest=digest(content),
            )
        return content

    def checkpoint_due(self, step_key: str) -> bool:
        """Whether a checkpoint is to be saved after the action `step_key`:
        this owner has just completed it (an action settled by an earlier
        receipt needs none) and one is due (Checkpointer.due).  An agent
        asks before it gathers its state."""
        return step_key in self.completed_now and self.checkpoints.due(self.progress.steps)

    def checkpoint(self, step_key: str, state: dict[str, Any]) -> None:
        """Saves the agent's `state` and the run's progress after the action
        `step_key`, if one is due (`checkpoint_due`), the last read's
        receipt first."""
        if self.checkpoint_due(step_key):
            self.write_receipt()
            self.checkpoints.save(step_key, self.completed_now[step_key], self.progress, state)

    def finalize_if_due(self, *, actions_needed: int) -> str:
        """Why research is over, moving the run to finalizing if the budget
        (with `actions_needed` more actions) or the deadline says so now;
        "" while research goes on.  Only those two end research: no
        record-keeping failure does (a cancel or an operator ends the run)."""
        if self.run.phase != Phase.RESEARCH:
            return self.run.phase_reason
        reason = ""
        if self.progress.steps + actions_needed > self.run.action_budget:
            reason = f"action budget of {self.run.action_budget} exhausted"
        elif self.run.deadline is not None and timezone.now() >= self.run.deadline:
            reason = "deadline passed"
        if reason:
            self.write_receipt()
            self.lease.enter_phase(Phase.FINALIZING, reason)
            self.run.phase, self.run.phase_reason = Phase.FINALIZING, reason
            timeline.record(self.run.pk, EventKind.PHASE_CHANGED, f"finalizing: {reason}")
        return reason

    def _tool(self, name: str) -> Tool:
        tool = self.tools.get(name)
        if tool is None:
            raise ValueError(
                f"agent {self.run.agent} declares no tool {name!r} (it has {', '.join(self.tools)})"
            )
        return tool

    def _refused_input(self, step_key: str, tool: Tool, input: Any) -> dict[str, str] | None:
        """The refusal of an input the tool's schema refuses, before any
        boundary: the same input is refused the same way every time, so
        nothing is recorded but the timeline's line."""
        refusal = tool.refusal(input)
        if not refusal:
            return None
        said = f"{tool.name} refused {refusal}"
        timeline.record(self.run.pk, EventKind.ACTION_REFUSED, f"{step_key}: {said}")
        return {"refused": said}

    # -- the unwritten receipt -------------------------------------------------

    def write_receipt(self) -> None:
        """Writes the receipts of the reads awaiting one, if any, on their
        own: before a write that does not carry them."""
        awaiting, self.unwritten = self.unwritten, []
        if awaiting:
            self._record_receipts(awaiting)
            self._receipts_written(awaiting)

    @contextlib.contextmanager
    def receipt_kept(self) -> Iterator[None]:
        """Around the agent: however its work ends early (a failure, a
        cancel, a stop, an operator's turn), the receipts of its last reads
        are written first if they can be; if not, the next owner reads them
        again.
        A receipt whose COMMIT stays unknown makes the run wait for an
        operator (NeedsOperator)."""
        try:
            yield
        except BaseException as ending:
            try:
                self.write_receipt()
            except NeedsOperator as unknown:
                # Whether it committed is unknown: its item holds the run for
                # an operator, whatever else ended research (unless another
                # owner has the run: it decides).
                if not isinstance(ending, LeaseLost):
                    raise unknown from ending
            except (WriteRefused, DatabaseError) as error:
                logger.warning(
                    "run %s: the last read's receipt not written: %s", self.run.pk, error
                )
            raise

    def finish(self, status: RunStatus, reason: str) -> RunStatus:
        """Ends this ownership (Lease.finish), with the last reads' receipts
        in the same statement."""
        awaiting, self.unwritten = self.unwritten, []
        ended = self.lease.finish(status, reason, receipts=[each.receipt for each in awaiting])
        self._receipts_written(awaiting)
        return ended

    def _receipts_written(self, awaiting: Sequence[AwaitingReceipt]) -> None:
        """What follows receipts: the timeline says so, capture saves the
        actions' copies."""
        for each in awaiting:
            result = each.result
            timeline.record(
                self.run.pk,
                EventKind.ACTION_COMPLETED,
                each.step_key + (f" refused: {result['refused']}" if "refused" in result else ""),
                action_id=each.action_id,
                result_digest=each.receipt.result_digest,
            )
        self._copied(awaiting)

    def _copied(self, awaiting: Sequence[AwaitingReceipt]) -> None:
        """Capture saves the actions' copies: the calls completed, whatever
        became of the write that carried their receipts (an unanswered
        COMMIT, a lost lease: the copy of what was called is kept all the
        same; capture keeps one per call)."""
        for each in awaiting:
            self.capture.save(each.copy)

    # -- one step --------------------------------------------------------------

    def _check_can_dispatch(self) -> None:
        if self.faults.fire("lease_stolen", self.progress.steps):
            steal_lease(self.run.pk)
        if self.faults.fire("cancel", self.progress.steps):
            inject_cancel(self.run.pk)
        if self.stop.is_set():
            raise Stopping()
        if self.lease_lost.is_set():
            raise LeaseLost(f"run {self.lease.run_id}: its renewal found the lease gone")

    def _new_boundary(self, step_key: str, key: str, tool: Tool, input: dict[str, Any]) -> int:
        ids, held = self._new_boundaries([Boundary(step_key, tool.name, tool.effect, input, key)])
        if held is not None:
            raise held
        return ids[step_key]

    def _new_boundaries(self, boundaries: Sequence[Boundary]) -> tuple[dict[str, int], Held | None]:
        """Writes the boundaries (one, or reads side by side), each with the
        key its action is sent under (every attempt of this write carries
        the same), and the receipts of reads not written yet (one
        statement: all commit, or nothing).  Their action ids by step key;
        and, when active holds stopped some (not written, the receipts
        written all the same), the Held that says which, for the caller to
        raise once the others are sent."""
        self._check_can_dispatch()
        awaiting, self.unwritten = self.unwritten, []
        held: Held | None = None

        def write(receipts: Sequence[PendingReceipt]) -> dict[str, int]:
            nonlocal held
            try:
                return self.lease.record_boundaries(boundaries, receipts)
            except Held as stopped:
                held = stopped
                return stopped.written

        if not awaiting:
            ids = write(())
        else:
            try:
                written = self._settled_receipts(
                    awaiting,
                    lambda: write([each.receipt for each in awaiting]),
                    fault=("boundary", self.progress.steps),
                )
            except (CancelRequested, LeaseExpired):
                self._receipts_written(awaiting)  # the receipts went; the boundaries did not
                raise
            except NeedsOperator:
                self._copied(awaiting)
                raise
            except LeaseLost as lost:
                self._copied(awaiting)
                keys = ", ".join(each.step_key for each in awaiting)
                said = (
                    f"the receipt of {keys} with it: the next owner reads it again"
                    if len(awaiting) == 1
                    else f"the receipts of {keys} with it: the next owner reads them again"
                )
                raise LeaseLost(f"{lost}, and {said}") from lost
            except DatabaseError:
                # Answered with an error: the statement rolled back, and the
                # receipts can still go on their own (receipt_kept).
                self.unwritten = awaiting
                raise
            self._receipts_written(awaiting)
            # None: an earlier attempt committed, the boundaries with it
            # unless a cancel or a hold refused them (then writing those
            # alone says so).
            if written is not None:
                ids = written
            elif len(ids := self._boundary_ids(boundaries)) < len(boundaries):
                ids = {**ids, **write(())}
        stopped = held.stopped if held is not None else {}
        missing = [each.step_key for each in boundaries if each.step_key not in ids | stopped]
        if missing:
            raise NeedsOperator(
                f"identity {', '.join(missing)} exists but was not loaded: another owner wrote it"
            )
        for each in boundaries:
            if each.step_key in stopped:
                continue
            timeline.record(
                self.run.pk,
                EventKind.ACTION_DISPATCHED,
                f"{each.kind} {each.step_key}",
                action_id=ids[each.step_key],
                epoch=self.lease.epoch,
            )
        return ids, held

    def _boundary_ids(self, boundaries: Sequence[Boundary]) -> dict[str, int]:
        return dict(
            Action.objects.filter(
                run_id=self.run.pk,
                step_key__in=[each.step_key for each in boundaries],
                epoch=self.lease.epoch,
            ).values_list("step_key", "pk")
        )

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
            # Waits for its item; one an operator settled while this owner
            # was loading the run puts the run back in the queue at once.
            item = action.outcome_items.order_by("-id").values_list("pk", flat=True).first()
            raise NeedsOperator(f"the outcome of {action.step_key} is unknown", item)
        if action.effect_class == EffectClass.READ and action.state == ActionState.FAILED:
            # Known not to have completed, and the run went on without it
            # (a note, a draft, a composition that leave it out): a fact,
            # like a receipt.  Read again, the run would take another path
            # than the one its receipts record.
            raise ActionFailed(action.step_key, action.error)
        if action.effect_class == EffectClass.EFFECT and action.state == ActionState.FAILED:
            if action.attempts < 1 + action.decisions.filter(choice__in=AUTHORISING).count():
                return None  # an operator's decision authorises one more dispatch
            raise NeedsOperator(
                f"{action.step_key} is known not to have happened ({action.error}); sending it "
                "again is an operator's decision"
            )
        if action.effect_class == EffectClass.EFFECT:
            reason = (
                f"{action.step_key} was dispatched under epoch {action.epoch} and has no "
                "receipt: the effect may have happened; only its receiver knows"
            )
            self._effect_unknown(action.pk, action.idempotency_key, reason)
        if action.attempts >= MAX_READ_DISPATCHES:
            self._give_up(action)
        return None

    def _give_up(self, action: Action) -> NoReturn:
        """A read dispatched MAX_READ_DISPATCHES times whose receipt was
        never written (each owner died, or its result is one the database
        refuses every time): it fails, and the agent goes on without it,
        instead of the run passing from owner to owner for ever."""
        reason = (
            f"dispatched {action.attempts} times and never recorded as completed: not sent again"
        )
        if action.state == ActionState.DISPATCHED:
            self._mark(action.pk, ActionState.FAILED, reason, EventKind.ACTION_FAILED)
        raise ActionFailed(action.step_key, reason)

    def _redispatch(self, action: Action) -> None:
        self._check_can_dispatch()
        self.write_receipt()
        self.lease.redispatch_boundary(action.pk)
        action.attempts += 1
        why = (
            "sent again under its identity, as an operator decided"
            if action.effect_class == EffectClass.EFFECT
            else "a read with no receipt, dispatched again"
        )
        timeline.record(
            self.run.pk,
            EventKind.ACTION_REDISPATCHED,
            f"{action.step_key}: {why} (attempt {action.attempts})",
            action_id=action.pk,
            epoch=self.lease.epoch,
        )

    def _call_tool(
        self,
        action_id: int,
        step_key: str,
        key: str,
        tool: Tool,
        input: dict[str, Any],
        sources: Sequence[str],
    ) -> dict[str, Any]:
        step = self.progress.steps
        answer = self._answer(self._start(step_key, key, tool, input, step), tool, step)
        return self._settle_call(action_id, step_key, key, tool, input, sources, step, answer)

    def _start(
        self,
        step_key: str,
        key: str,
        tool: Tool,
        input: dict[str, Any],
        step: int,
        *,
        beside: bool = False,
    ) -> concurrent.futures.Future[dict[str, Any]] | Ran:
        """Runs the tool, after the delay the fault plan asks for at `step`:
        here, or (`beside`: reads side by side) on a thread of its own
        (TOOL_THREADS), so that one that outlives its timeout is left
        behind.  A tool run here is told its timeout (ToolCall.timeout) and
        keeps it itself."""
        # No run holds a connection while its tools run (docs/DESIGN.md,
        # "The executor's model").
        release_connection()
        call = ToolCall(
            self.run.pk, step_key, action_identity(self.run.pk, step_key), key, tool.timeout
        )
        if self.faults.fire("tool_error", step):
            return Ran(error=ToolFailed("the tool failed (fault plan: tool_error)"))
        delay = self.faults.tool_delay(step)

        def run() -> dict[str, Any]:
            if delay:
                time.sleep(delay)
            return tool.run(input, call)

        if beside:
            return TOOL_THREADS.submit(run)
        try:
            return Ran(run())
        except Exception as error:
            return Ran(error=error)

    def _answer(
        self, started: concurrent.futures.Future[dict[str, Any]] | Ran, tool: Tool, step: int
    ) -> Answer | Exception:
        """What the tool answered: its result (a refusal is one), or the
        ToolFailed or OutcomeUnknown it raised or that its silence past
        its timeout means.  Any other error is a failure for a read and
        an unknown outcome for an effect (it may have happened first)."""
        try:
            result = started.result(timeout=tool.timeout)
        except ToolRefused as refusal:
            return Answer.of({"refused": str(refusal)})
        except (ToolFailed, OutcomeUnknown) as error:
            return error
        except concurrent.futures.TimeoutError:
            if started.cancel():  # it never started: known not to have happened
                return ToolFailed(f"not started within its timeout of {tool.timeout:g} s")
            silence = f"no answer within its timeout of {tool.timeout:g} s"
            return (
                OutcomeUnknown(silence)
                if tool.effect == EffectClass.EFFECT
                else ToolFailed(silence)
            )
        except Exception as error:
            if tool.effect == EffectClass.EFFECT:
                return OutcomeUnknown(f"the tool raised {error!r}")
            return ToolFailed(f"the tool raised {error!r}")
        if tool.effect == EffectClass.EFFECT and self.faults.fire("delivery_timeout", step):
            return OutcomeUnknown("delivered, but the answer was lost (fault plan)")
        return _as_result(result, tool)

    def _settle_call(
        self,
        action_id: int,
        step_key: str,
        key: str,
        tool: Tool,
        input: dict[str, Any],
        sources: Sequence[str],
        step: int,
        answer: Answer | Exception,
    ) -> dict[str, Any]:
        """Records what the tool answered: an unknown outcome waits for an
        operator (NeedsOperator), a failure is marked (ActionFailed); a
        result's receipt is written at once for an effect, with the run's
        next write for a read."""
        if isinstance(answer, OutcomeUnknown):
            self._effect_unknown(action_id, key, f"the outcome of {step_key} is unknown: {answer}")
        if isinstance(answer, Exception):
            self._mark(action_id, ActionState.FAILED, str(answer), EventKind.ACTION_FAILED)
            raise ActionFailed(step_key, str(answer)) from answer
        self.completed_now[step_key] = action_id
        receipt = PendingReceipt(action_id, answer.result, answer.text)
        # What capture keeps is taken now, as the receipt is: what the tool
        # answered, whatever the agent then does with the objects it has.
        copy = self.capture.copy_of(
            action_id, tool.name, input, answer.result, sources, receipt.result_digest
        )
        awaiting = AwaitingReceipt(step_key, step, receipt, copy)
        # An effect's receipt does not wait; nor any in a run whose fault
        # plan aims at a receipt (FaultPlan.aims_at_writes).
        if tool.effect == EffectClass.EFFECT or self.faults.aims_at_writes:
            self._record_receipts([awaiting])
            self._receipts_written([awaiting])
        else:
            self.unwritten.append(awaiting)
        return answer.result

    def _record_receipts(self, awaiting: Sequence[AwaitingReceipt]) -> None:
        """Writes the receipts on their own, in one statement."""
        self._until_written(
            "receipt of " + ", ".join(each.step_key for each in awaiting),
            lambda: self._settled_receipts(
                awaiting, lambda: self.lease.record_receipts([each.receipt for each in awaiting])
            ),
        )

    def _until_written(self, what: str, write: Callable[[], T]) -> T:
        """`write()`, again after an error the database answered that says
        nothing of the write but that it met its moment (sql.transient: a
        lock or statement timeout, a deadlock): it rolled back, so it is
        known not written, and what it records is in hand only here (an
        effect's outcome: left to the next owner, it is unknown).  For up
        to FACT_RETRY_SECONDS, while the lease is not known lost."""
        deadline = time.monotonic() + FACT_RETRY_SECONDS
        pause = 0.1
        while True:
            try:
                return write()
            except DatabaseError as error:
                if (
                    not transient(error)
                    or self.lease_lost.is_set()
                    or time.monotonic() + pause > deadline
                ):
                    raise
                logger.warning(
                    "run %s: %s not written (%s); again in %.1f s",
                    self.run.pk,
                    what,
                    str(error).strip(),
                    pause,
                )
                release_connection()
                time.sleep(pause)
                pause = min(2 * pause, 2.0)

    def _settled_receipts(
        self,
        awaiting: Sequence[AwaitingReceipt],
        write: Callable[[], T],
        *,
        fault: tuple[str, int] = ("", 0),
    ) -> T | None:
        """Runs a write that carries `awaiting`'s receipts (alone, or with
        what `fault` names: the fault plan's write and step); an unanswered
        COMMIT is settled by evidence (None: an earlier attempt committed).
        All are in one statement: the last one's item speaks for them."""

        def attempt() -> T:
            with self.faults.at_commit(*(fault if fault[0] else ("receipt", awaiting[-1].step))):
                return write()

        ids = [each.action_id for each in awaiting]
        keys = ", ".join(each.step_key for each in awaiting)
        return write_settled(
            attempt,
            lambda: Receipt.objects.filter(action_id__in=ids).count() == len(ids),
            what=f"receipt of {keys}",
            run_id=self.run.pk,
            kind=OutcomeKind.RECEIPT,
            subject=f"receipt:action-{ids[-1]}",
            lease_epoch=self.lease.epoch,
            afterwards=f"{keys} completed; the run waits for an operator",
            action_id=ids[-1],
        )

    def _effect_unknown(self, action_id: int, key: str, reason: str) -> NoReturn:
        """The effect's outcome is unknown (effect_unknown): the run waits
        for an operator."""
        self.write_receipt()
        afterwards = "the run waits for an operator; the effect is not sent again"
        raise NeedsOperator(reason, effect_unknown(self.lease, action_id, key, reason, afterwards))

    def _mark(self, action_id: int, state: ActionState, reason: str, kind: EventKind) -> None:
        self.write_receipt()
        self._until_written(
            f"{state} state of action {action_id}",
            lambda: self.lease.record_action_state(action_id, state, reason),
        )
        timeline.record(self.run.pk, kind, reason, action_id=action_id)


def effect_unknown(lease: Lease, action_id: int, key: str, reason: str, afterwards: str) -> int:
    """Only the receiver knows whether the effect `action_id` (sent under
    `key`) happened: its state becomes unknown and an item asks an operator
    to settle it with the receiver's evidence (both written together, never
    one without the other).  The item's id."""
    step_key, attempts = (
        Action.objects.filter(pk=action_id).values_list("step_key", "attempts").get()
    )
    with transaction.atomic():
        lease.record_action_state(action_id, ActionState.UNKNOWN, reason)
        item = open_item(
            run_id=lease.run_id,
            kind=OutcomeKind.EFFECT,
            subject=f"effect:action-{action_id}:attempt-{attempts}",
            summary=reason,
            evidence={
                "identity": action_identity(lease.run_id, step_key),
                "idempotency_key": key,
                "lease_epoch": lease.epoch,
                "afterwards": afterwards,
            },
            action_id=action_id,
        )
    timeline.record(lease.run_id, EventKind.ACTION_UNKNOWN, reason, action_id=action_id)
    return item.pk


def effects_left_unknown(lease: Lease) -> None:
    """A run about to fail with an effect still dispatched: an earlier
    owner sent it and died before its answer, and the agent failed before
    it stepped it again.  Whether it happened is unknown, and stays so
    until an operator settles it: the run ends, its item does not."""
    left = Action.objects.filter(
        run_id=lease.run_id, effect_class=EffectClass.EFFECT, state=ActionState.DISPATCHED
    ).values_list("pk", "step_key", "idempotency_key")
    for action_id, step_key, key in left:
        effect_unknown(
            lease,
            action_id,
            key,
            f"{step_key} was dispatched under an earlier owner and never answered; the run "
            "failed before it was stepped again: only its receiver knows whether it happened",
            "the run has failed; settle the effect for the record",
        )


def _as_result(result: Any, tool: Tool) -> Answer | Exception:
    """A tool's answer as its receipt keeps it: a JSON object.  Another
    JSON value is kept under "value"; what is no JSON is no result (for
    an effect, it may have happened all the same)."""
    kept = result if isinstance(result, dict) else {"value": result}
    try:
        return Answer.of(kept)
    except (TypeError, ValueError) as error:
        said = f"the tool answered what is no JSON: {error}"
        return OutcomeUnknown(said) if tool.effect == EffectClass.EFFECT else ToolFailed(said)

"""The reference research agent: "compare these documents, deliver a report".

It reads each document as its own action, has the model summarise it,
publishes a draft revision after the first summary, composes the comparison,
publishes the final revision and delivers it.  Every step goes through the
Dispatcher, so a resumed run replays nothing that completed.
"""

from __future__ import annotations

from typing import Any

from django.utils import timezone

from evidence.capture import ModelCallRecord, SourceRecord, capture
from runs.checkpoints import AgentState, Checkpointer
from runs.dispatch import ActionFailed, Dispatcher
from runs.models import AnswerRevision, OutcomeKind, Phase, digest
from runs.outcomes import write_settled
from runs.providers import COMPARE_INSTRUCTIONS, SUMMARIZE_INSTRUCTIONS, document_block
from runs.timeline import EventKind, timeline

# Actions kept back for the end of a run: composing the report and delivering it.
FINISHING_ACTIONS = 2


class ResearchAgent:
    def __init__(self, dispatcher: Dispatcher) -> None:
        self.d = dispatcher
        self.run = dispatcher.run
        self.lease = dispatcher.lease
        self.checkpoints = Checkpointer(dispatcher)

    def execute(self) -> None:
        state = self.checkpoints.resume_state() or AgentState()
        self.d.resume(state.steps, state.taken)
        documents = self.run.documents
        for index in range(state.position, len(documents)):
            state.position = index
            self._research(index, documents[index], state)
        state.position = len(documents)
        final = self._compose(state)
        number = 2 if state.summaries else 1
        used = [*state.receipts, "compose"] if state.summaries else []
        self._publish(number, final, is_final=True, model_calls=used)
        self.d.step("deliver", "deliver_report", {"revision": number, "content": final})

    def _research(self, index: int, path: str, state: AgentState) -> None:
        """Reads one document and has the model summarise it.  A read or a
        summary that fails is noted in the report; the other documents are
        independent work and go on."""
        read_key, summary_key = f"read:{index}", f"summarize:{index}"
        if not (self.d.completed(read_key) or self._may_research(actions_needed=2)):
            state.notes.append(f"{path}: not read ({self.run.phase_reason})")
            return
        try:
            read = self.d.step(read_key, "read_document", {"path": path})
            self.checkpoints.after(read_key, state)
            if "refused" in read:
                state.notes.append(f"{path}: {read['refused']}")
                return
            capture.submit(
                SourceRecord(
                    self.run.pk, self.d.action_id(read_key), path, read["sha256"], read["bytes"]
                )
            )
            prompt = f"Question: {self.run.question}\n\n" + document_block(path, read["text"])
            summary = self._model_call(
                summary_key, _messages(SUMMARIZE_INSTRUCTIONS, prompt), [path]
            )
        except ActionFailed as failure:
            state.notes.append(f"{path}: not included ({failure})")
            return
        state.summaries.append((path, summary["text"]))
        state.receipts[summary_key] = digest(summary)
        state.position = index + 1
        if len(state.summaries) == 1:
            draft = _draft(state.summaries, len(self.run.documents))
            self._publish(1, draft, is_final=False, model_calls=[summary_key])
        self.checkpoints.after(summary_key, state)

    def _model_call(
        self, step_key: str, messages: list[dict[str, str]], paths: list[str]
    ) -> dict[str, Any]:
        """A model call, and its evidence handed to capture: the model record
        and a bounded copy, written off the main path.  A call settled by an
        earlier owner's receipt is handed over again: that owner may have
        died before capture saved it (capture saves each once)."""
        input = {"messages": messages}
        result = self.d.step(step_key, "model_call", input)
        action_id = self.d.action_id(step_key)
        capture.submit(ModelCallRecord.of(self.run.pk, action_id, input, result, paths))
        return result

    def _may_research(self, *, actions_needed: int) -> bool:
        """Research goes on until the budget or the deadline says finalize.
        Only those (and cancel or an operator) move a run to finalizing: no
        record-keeping failure does."""
        if self.run.phase != Phase.RESEARCH:
            return False
        reason = ""
        if self.d.steps + actions_needed + FINISHING_ACTIONS > self.run.action_budget:
            reason = f"action budget of {self.run.action_budget} exhausted"
        elif self.run.deadline is not None and timezone.now() >= self.run.deadline:
            reason = "deadline passed"
        if not reason:
            return True
        self.lease.enter_phase(Phase.FINALIZING, reason)
        self.run.phase, self.run.phase_reason = Phase.FINALIZING, reason
        timeline.record(self.run.pk, EventKind.PHASE_CHANGED, f"finalizing: {reason}")
        return False

    def _compose(self, state: AgentState) -> str:
        if state.summaries:
            prompt = f"Question: {self.run.question}\n\n" + "\n\n".join(
                document_block(path, text) for path, text in state.summaries
            )
            paths = [path for path, _ in state.summaries]
            messages = _messages(COMPARE_INSTRUCTIONS, prompt)
            report = self._model_call("compose", messages, paths)["text"]
            self.checkpoints.after("compose", state)
        else:
            report = (
                f"# {self.run.question}\n\nNo document could be read, so nothing is compared.\n"
            )
        if state.notes:
            report += "\n## Not included\n\n" + "".join(f"- {note}\n" for note in state.notes)
        return report

    def _publish(
        self, number: int, content: str, *, is_final: bool, model_calls: list[str]
    ) -> None:
        """Commits an answer revision, naming the model calls (step keys) it
        used; an unanswered COMMIT is settled by evidence, and what stays
        unknown waits for an operator."""
        used = [self.d.action_id(step_key) for step_key in model_calls]

        def write() -> bool:
            with self.d.faults.at_commit("publication", self.d.steps):
                return self.lease.publish_revision(
                    number, content, is_final=is_final, model_call_actions=used
                )

        published = write_settled(
            write,
            lambda: AnswerRevision.objects.filter(
                run_id=self.run.pk, number=number, content_digest=digest(content)
            ).exists(),
            what=f"publication of revision {number}",
            run_id=self.run.pk,
            kind=OutcomeKind.PUBLICATION,
            subject=f"publication:run-{self.run.pk}:revision-{number}",
            lease_epoch=self.lease.epoch,
            afterwards="the run waits for an operator",
            revision_number=number,
        )
        if published is not False:
            timeline.record(
                self.run.pk,
                EventKind.REVISION_PUBLISHED,
                f"{'final' if is_final else 'draft'} revision {number}",
                number=number,
                content_digest=digest(content),
            )


def _messages(instructions: str, prompt: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": instructions}, {"role": "user", "content": prompt}]


def _draft(summaries: list[tuple[str, str]], total: int) -> str:
    head = f"**Draft** — {len(summaries)} of {total} documents summarised so far.\n\n"
    return head + "\n\n".join(text for _, text in summaries)

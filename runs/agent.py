"""The reference research agent: "compare these documents, deliver a report".

It reads each document as its own action, has the model summarise it,
publishes a draft revision after the first summary, composes the comparison,
publishes the final revision and delivers it.  Every step goes through the
Dispatcher, so a resumed run replays nothing that completed.
"""

from __future__ import annotations

from django.utils import timezone

from runs.dispatch import Dispatcher
from runs.models import EventKind, Phase, RunStatus, digest
from runs.providers import COMPARE_INSTRUCTIONS, SUMMARIZE_INSTRUCTIONS, document_block
from runs.timeline import timeline

# Actions kept back for the end of a run: composing the report and delivering it.
FINISHING_ACTIONS = 2


class ResearchAgent:
    def __init__(self, dispatcher: Dispatcher) -> None:
        self.d = dispatcher
        self.run = dispatcher.run
        self.lease = dispatcher.lease

    def execute(self) -> None:
        summaries: list[tuple[str, str]] = []
        notes: list[str] = []
        for index, path in enumerate(self.run.documents):
            if not (self.d.completed(f"read:{index}") or self._may_research(actions_needed=2)):
                notes.append(f"{path}: not read ({self.run.phase_reason})")
                continue
            read = self.d.step(f"read:{index}", "read_document", {"path": path})
            if "refused" in read:
                notes.append(f"{path}: {read['refused']}")
                continue
            prompt = f"Question: {self.run.question}\n\n" + document_block(path, read["text"])
            summary = self.d.step(
                f"summarize:{index}",
                "model_call",
                {"messages": _messages(SUMMARIZE_INSTRUCTIONS, prompt)},
            )
            summaries.append((path, summary["text"]))
            if len(summaries) == 1:
                self._publish(1, _draft(summaries, len(self.run.documents)), is_final=False)
        final = self._compose(summaries, notes)
        number = 2 if summaries else 1
        self._publish(number, final, is_final=True)
        self.d.step("deliver", "deliver_report", {"revision": number, "content": final})
        self.lease.finish(RunStatus.COMPLETED)
        timeline.record(self.run.pk, EventKind.RUN_COMPLETED, f"{self.d.steps} steps")

    def _may_research(self, *, actions_needed: int) -> bool:
        """Research goes on until the budget or the deadline says finalize.
        Only those (and cancel or an operator) move a run to finalizing."""
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

    def _compose(self, summaries: list[tuple[str, str]], notes: list[str]) -> str:
        if summaries:
            prompt = f"Question: {self.run.question}\n\n" + "\n\n".join(
                document_block(path, text) for path, text in summaries
            )
            report = self.d.step(
                "compose", "model_call", {"messages": _messages(COMPARE_INSTRUCTIONS, prompt)}
            )["text"]
        else:
            report = (
                f"# {self.run.question}\n\nNo document could be read, so nothing is compared.\n"
            )
        if notes:
            report += "\n## Not included\n\n" + "".join(f"- {note}\n" for note in notes)
        return report

    def _publish(self, number: int, content: str, *, is_final: bool) -> None:
        if self.lease.publish_revision(number, content, is_final=is_final):
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

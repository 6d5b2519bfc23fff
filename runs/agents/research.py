"""The reference research agent: "compare these documents, deliver a report".

It reads each document as its own action, has the model summarise it,
publishes a draft revision after the first summary, composes the comparison,
publishes the final revision and delivers it.  It is written on the public
agent API (runs/agent.py) alone: every step, publication, checkpoint and
budget check goes through its run context, which makes a resumed run replay
nothing that completed.  How the run ends is the runtime's to say.

It saves checkpoints, and says how its state follows from the run's
receipts (`replay`): a checkpoint is trusted only if it holds exactly that.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from django.conf import settings

from runs.agent import ActionFailed, Agent, Disagreement, History, Phase
from runs.agents import corpus
from runs.agents.providers import COMPARE_INSTRUCTIONS, SUMMARIZE_INSTRUCTIONS, research_prompt
from runs.agents.tools import DELIVER_REPORT, MODEL_CALL, READ_DOCUMENT
from runs.models import UNSTORABLE, digest

# Actions kept back for the end of a run: composing the report and delivering it.
FINISHING_ACTIONS = 2


@dataclass
class ResearchState:
    """What the agent needs to continue: where it is, what it has learned,
    and the digests of the receipts that learning came from."""

    position: int = 0
    summaries: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    receipts: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, raw: dict[str, Any]) -> ResearchState:
        return cls(
            position=raw["position"],
            summaries=[(path, text) for path, text in raw["summaries"]],
            notes=list(raw["notes"]),
            receipts=dict(raw["receipts"]),
        )


# The longest document path a run may name (Run.documents holds them).
LONGEST_PATH = 500


class ResearchAgent(Agent):
    name = "research"
    version = "1"
    input_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "required": ["question", "documents"],
        "properties": {
            "question": {"type": "string"},
            "documents": {"type": "array", "items": {"type": "string"}},
        },
        "additionalProperties": False,
    }
    tools = (READ_DOCUMENT, MODEL_CALL, DELIVER_REPORT)
    drill_input: ClassVar[dict[str, Any]] = {
        "question": "Which fund has the lowest fees?",
        "documents": ["northwind-clean-energy.md", "meridian-world-equity.md"],
    }

    @classmethod
    def check_input(cls, input: dict[str, Any]) -> None:
        question, documents = input["question"], input["documents"]
        if not question.strip():
            raise ValueError("the question is empty")
        if UNSTORABLE.search(question):
            raise ValueError("the question holds a character no text can: NUL or a lone surrogate")
        if not documents:
            raise ValueError("name at least one document")
        for number, path in enumerate(documents, start=1):
            if not path.strip() or min(path) < " " or UNSTORABLE.search(path):
                # NUL, a newline, a tab: no file a corpus means to be named so.
                raise ValueError(f"document {number} is not a path: {path!r}")
            if len(path) > LONGEST_PATH:
                # The database would cut it short, and the run read another file.
                raise ValueError(
                    f"document {number} is a path of {len(path)} characters; at most {LONGEST_PATH}"
                )
            # What the read tool would refuse (absolute, '..', a symlink out
            # of the corpus), refused now in its words, before anything is
            # queued; a document not there yet may still come.
            corpus.check_path(path, settings.RUNDESK_CORPUS_DIR)

    @classmethod
    def title(cls, input: dict[str, Any]) -> str:
        return input["question"]

    @classmethod
    def documents(cls, input: dict[str, Any]) -> list[str]:
        return list(input["documents"])

    @property
    def question(self) -> str:
        return self.input["question"]

    def run(self) -> None:
        """Researches from the state a checkpoint restored, or the
        beginning, until the report is delivered."""
        saved = self.ctx.saved
        state = ResearchState.load(saved) if saved else ResearchState()
        documents = self.documents(self.input)
        for index in range(state.position, len(documents)):
            state.position = index
            self._research(index, documents[index], state)
        state.position = len(documents)
        final = self._compose(state)
        number = 2 if state.summaries else 1
        used = [*state.receipts, "compose"] if state.summaries else []
        final = self.ctx.publish(final, revision=number, final=True, used=used)
        self.ctx.step("deliver", "deliver_report", {"revision": number, "content": final})

    def _research(self, index: int, path: str, state: ResearchState) -> None:
        """Reads one document and has the model summarise it.  A read or a
        summary that fails is noted in the report; the other documents are
        independent work and go on."""
        read_key, summary_key = f"read:{index}", f"summarize:{index}"
        if not self.ctx.settled(read_key):
            needed = 2 + FINISHING_ACTIONS
            if over := self.ctx.finalize_if_due(steps_needed=needed):
                state.notes.append(_not_read(path, over))
                return
        try:
            read = self.ctx.step(read_key, "read_document", {"path": path})
            self._checkpoint(read_key, state)
            if "refused" in read:
                state.notes.append(_refused(path, read))
                return
            prompt = research_prompt(self.question, [(path, read["text"])])
            messages = _messages(SUMMARIZE_INSTRUCTIONS, prompt)
            summary = self.ctx.step(
                summary_key, "model_call", {"messages": messages}, sources=[path]
            )
        except ActionFailed as failure:
            state.notes.append(_not_included(path, failure.step_key, failure.error))
            return
        state.summaries.append((path, summary["text"]))
        state.receipts[summary_key] = digest(summary)
        state.position = index + 1
        if len(state.summaries) == 1:
            draft = _draft(state.summaries, len(self.input["documents"]))
            self.ctx.publish(draft, revision=1, used=[summary_key])
        self._checkpoint(summary_key, state)

    def _compose(self, state: ResearchState) -> str:
        if state.summaries:
            prompt = research_prompt(self.question, state.summaries)
            messages = _messages(COMPARE_INSTRUCTIONS, prompt)
            paths = [path for path, _ in state.summaries]
            report = self.ctx.step("compose", "model_call", {"messages": messages}, sources=paths)[
                "text"
            ]
            self._checkpoint("compose", state)
        else:
            report = f"# {self.question}\n\nNo document could be read, so nothing is compared.\n"
        if state.notes:
            report += "\n## Not included\n\n" + "".join(f"- {note}\n" for note in state.notes)
        return report

    def _checkpoint(self, step_key: str, state: ResearchState) -> None:
        if self.ctx.checkpoint_due(step_key):  # its state, only then
            self.ctx.checkpoint(step_key, asdict(state))

    # -- the state the receipts lead to ---------------------------------------

    def replay(self, after: str, history: History) -> dict[str, Any]:
        """The state this agent had when it saved a checkpoint after the
        action `after`, rebuilt from the run's documents and the receipts in
        `history`, with the same wording; Disagreement if the receipts
        cannot have led there."""
        state = ResearchState(position=self._position_after(after))
        for index, path in enumerate(self.input["documents"][: state.position]):
            self._replay(index, path, state, history)
        return asdict(state)

    def _position_after(self, step_key: str) -> int:
        """The document the agent is at when it saves a checkpoint after
        `step_key`: after a read, that document; after its summary, the
        next one; after composing, past the last."""
        total = len(self.input["documents"])
        if step_key == "compose":
            return total
        kind, _, index = step_key.partition(":")
        if kind in ("read", "summarize") and index.isdigit() and int(index) < total:
            return int(index) + (kind == "summarize")
        raise Disagreement(f"was saved after {step_key}, which the agent does not save after")

    def _replay(self, index: int, path: str, state: ResearchState, history: History) -> None:
        """What `_research` kept of document `index`: a summary (and its
        receipt's digest), or a note saying why there is none."""
        read_key, summary_key = f"read:{index}", f"summarize:{index}"
        read = history.result(read_key)
        if read is None:
            state.notes.append(self._replayed_note(path, read_key, history))
            return
        if "refused" in read:
            state.notes.append(_refused(path, read))
            return
        summary = history.result(summary_key)
        if summary is None:
            state.notes.append(self._replayed_note(path, summary_key, history))
            return
        if not isinstance(summary, dict) or not isinstance(summary.get("text"), str):
            raise Disagreement(f"counts on {summary_key}, whose receipt holds no summary")
        state.summaries.append((path, summary["text"]))
        state.receipts[summary_key] = history.result_digest(summary_key)

    def _replayed_note(self, path: str, step_key: str, history: History) -> str:
        """The note of an action before the checkpoint that has no receipt:
        it failed, or (a read) was never dispatched because research ended."""
        if (error := history.failure(step_key)) is not None:
            return _not_included(path, step_key, error)
        never_read = step_key.startswith("read:") and history.get(step_key) is None
        if never_read and self.ctx.phase != Phase.RESEARCH:
            return _not_read(path, self.ctx.phase_reason)
        raise Disagreement(f"is past {step_key}, which neither completed nor failed")


# -- the report's words ----------------------------------------------------------


def _not_read(path: str, reason: str) -> str:
    return f"{path}: not read ({reason})"


def _refused(path: str, read: dict[str, Any]) -> str:
    return f"{path}: {read['refused']}"


def _not_included(path: str, step_key: str, error: str) -> str:
    return f"{path}: not included ({step_key} failed: {error})"


def _messages(instructions: str, prompt: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": instructions}, {"role": "user", "content": prompt}]


def _draft(summaries: list[tuple[str, str]], total: int) -> str:
    head = f"**Draft** — {len(summaries)} of {total} documents summarised so far.\n\n"
    return head + "\n\n".join(text for _, text in summaries)

"""A run's checkpoints as an operator sees them: one row per checkpoint
number, with its final outcome and its history.  Shown by the run page
and a bundle's report (evidence/run_facts.py) and drawn on their timeline
(evidence/charts.py)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass, field

from runs.models import Checkpoint, CheckpointOutcome
from runs.words import plain


@dataclass
class Step:
    """One thing that happened to a checkpoint: attempted, saved, settled."""

    at: dt.datetime | None
    what: str
    detail: str = ""


@dataclass
class CheckpointRow:
    """A checkpoint number of a run, with its final outcome and its history.

    The database keeps the saved state and the record of an attempt whose
    COMMIT got no answer (or that failed before writing) as separate rows
    under the same number; an operator sees one checkpoint."""

    number: int
    after: str
    outcome: str
    outcome_label: str
    xid: int | None
    at: dt.datetime
    history: list[Step] = field(default_factory=list)

    @property
    def summary(self) -> str:
        return "; ".join(
            f"{step.what}{': ' + step.detail if step.detail else ''}" for step in self.history
        )


def checkpoint_rows(records: Iterable[Checkpoint]) -> list[CheckpointRow]:
    """One row per checkpoint number.  Its outcome: unknown while any attempt
    is still unknown (an open item says so too); else written when a saved
    state exists (settled by evidence if an attempt needed settling); else
    the last attempt's outcome."""
    by_number: dict[int, list[Checkpoint]] = {}
    for record in records:
        by_number.setdefault(record.number, []).append(record)
    rows = []
    for number, group in sorted(by_number.items()):
        saved = next((r for r in group if r.state is not None), None)
        attempts = [r for r in group if r.state is None]
        outcomes = {r.outcome for r in attempts}
        if CheckpointOutcome.UNKNOWN in outcomes:
            outcome = CheckpointOutcome.UNKNOWN
        elif saved is not None:
            settled = CheckpointOutcome.SETTLED_COMMITTED in outcomes
            outcome = CheckpointOutcome.SETTLED_COMMITTED if settled else saved.outcome
        else:
            outcome = attempts[-1].outcome
        history = []
        for record in attempts:
            if record.outcome == CheckpointOutcome.FAILED_BEFORE_WRITE:
                history.append(Step(record.created_at, "failed before write", record.error))
                continue
            # Unknown first, whatever settled it since.
            history.append(Step(record.created_at, record.error or "COMMIT sent, no answer"))
            if record.resolved_at:
                history.append(Step(record.resolved_at, "settled", record.resolution))
        history.sort(key=lambda step: step.at)
        if saved is not None and attempts:  # alone, a saved state needs no history
            history.append(Step(None, "its saved state is readable"))
        rows.append(
            CheckpointRow(
                number=number,
                after=group[0].after_action.step_key,
                outcome=outcome,
                outcome_label=plain(CheckpointOutcome, outcome),
                xid=next((r.xid for r in group if r.xid is not None), None),
                at=min(r.created_at for r in group),
                history=history,
            )
        )
    return rows

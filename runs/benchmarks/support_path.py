"""`bench --support-path`: what a step of the support agent's path costs
in durable commits and WAL syncs, counted as `bench` counts the research
agent's (steps.count_path): support runs of the sample tickets, one after
another, each reading its ticket and every article side by side, drafting
with the offline model, publishing, then mailing the customer over SMTP
and updating the ticket over HTTP.  The receivers are real (runs/agents/
receivers.py), started by the bench in a folder of its own; the runs read
the sample folder, whatever RUNDESK_SUPPORT_DIR says, and what they send
goes to those receivers alone.  Every run must have completed with exactly
one mail and one ticket update, or the benchmark fails saying which."""

from __future__ import annotations

import contextlib
import tempfile
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from django.conf import settings

from runs.agents import support
from runs.agents.receivers import Helpdesk, Mailbox
from runs.agents.support import message_id
from runs.benchmarks import steps
from runs.models import Action, Run, RunStatus
from runs.submission import submit

RUNS = 40
SAMPLES = Path(support.__file__).resolve().parent / "support_samples"


def report(runs: int = RUNS) -> dict[str, Any]:
    """`runs` support runs, the sample tickets in turn, counted as one
    stretch of the agent path."""
    if runs < 1:
        raise ValueError("the support path needs at least one run")
    tickets = sorted(path.stem for path in (SAMPLES / support.TICKETS).glob("*.json"))
    with (
        tempfile.TemporaryDirectory(prefix="rundesk-bench-support-") as folder,
        Mailbox(Path(folder) / "mailbox") as mailbox,
        Helpdesk(Path(folder) / "helpdesk") as helpdesk,
        _pointed_at(mailbox, helpdesk),
    ):
        submitted = [
            submit(agent="support", input={"ticket": tickets[i % len(tickets)]})
            for i in range(runs)
        ]
        with steps.cancelled_if_left(submitted):
            counted = steps.count_path(submitted)
        mails = [message["Message-ID"] for message in mailbox.messages()]
        updates = [update["idempotency_key"] for update in helpdesk.updates()]
    check_delivered(submitted, mails, updates)
    return {
        "steps": counted.steps,
        "runs": runs,
        "tickets": len(tickets),
        **counted.per_step(),
        "mails": len(mails),
        "ticket_updates": len(updates),
    }


@contextlib.contextmanager
def _pointed_at(mailbox: Mailbox, helpdesk: Helpdesk) -> Iterator[None]:
    """The support agent's settings, for the bench's life: the sample
    tickets and articles, and the bench's own receivers."""
    names = ("RUNDESK_SUPPORT_DIR", "RUNDESK_SMTP_URL", "RUNDESK_HELPDESK_URL")
    previous = {name: getattr(settings, name) for name in names}
    settings.RUNDESK_SUPPORT_DIR = SAMPLES
    settings.RUNDESK_SMTP_URL = mailbox.url
    settings.RUNDESK_HELPDESK_URL = helpdesk.url
    try:
        yield
    finally:
        for name, value in previous.items():
            setattr(settings, name, value)


def check_delivered(runs: Sequence[Run], mails: list[str], updates: list[str]) -> None:
    """RuntimeError naming each of `runs` that did not complete, or whose
    mail (by Message-ID, `mails`) or ticket update (by Idempotency-Key,
    `updates`) did not arrive exactly once; and anything that arrived
    from no run of them."""
    keys = {
        (run_id, step_key): key
        for run_id, step_key, key in Action.objects.filter(
            run__in=runs, step_key__in=("send", "update")
        ).values_list("run_id", "step_key", "idempotency_key")
    }
    status = dict(Run.objects.filter(pk__in=[run.pk for run in runs]).values_list("pk", "status"))
    mailed, updated = Counter(mails), Counter(updates)
    wrong = []
    for run in runs:
        said = []
        if status[run.pk] != RunStatus.COMPLETED:
            said.append(f"status {status[run.pk]}")
        sent = keys.get((run.pk, "send"))
        if (count := mailed.pop(message_id(sent), 0) if sent else 0) != 1:
            said.append(f"{count} mails")
        update = keys.get((run.pk, "update"))
        if (count := updated.pop(update, 0) if update else 0) != 1:
            said.append(f"{count} ticket updates")
        if said:
            wrong.append(f"run {run.pk}: {', '.join(said)}")
    if stray := mailed.total() + updated.total():
        wrong.append(f"{stray} mails or ticket updates of no run of the bench")
    if wrong:
        raise RuntimeError(
            f"not every support run completed with one mail and one ticket update: "
            f"{'; '.join(wrong)}"
        )
